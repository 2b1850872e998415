"""examples/ddp_rpc.py with --quick: DDP over the "rpcdist" backend and RPC/RRefs in one program.

Two trainers train a dense layer with DistributedDataParallel (torch's process group on the
``"rpcdist"`` backend) on top of an embedding table that lives on a parameter server behind a
RemoteModule (distributed autograd + DistributedOptimizer). The run must exit 0 with every
worker shut down, both trainers' losses must fall, their dense layers must end identical, and
the server's table must have been trained.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _examples import run_example

TIMEOUT = 200  # seconds; a quick run takes well under a minute on 2 idle cores
EPOCH = re.compile(r"^epoch +(\d+)/(\d+) +trainer(\d) +loss ([\d.]+)", re.MULTILINE)
RESULT = re.compile(r"result: first loss ([\d.]+), last loss ([\d.]+)")
MOVED = re.compile(r"ps: the embedding table moved by ([\d.]+)")


@pytest.mark.timeout(TIMEOUT + 20)
def test_ddp_rpc_quick_loss_falls(tmp_path: Path) -> None:
    stdout, report = run_example("ddp_rpc.py", "--quick", cwd=tmp_path, timeout=TIMEOUT)
    assert "all 4 workers shut down cleanly" in stdout, report

    epochs: dict[int, list[float]] = {0: [], 1: []}
    for match in EPOCH.finditer(stdout):
        epochs[int(match.group(3))].append(float(match.group(4)))
    for trainer, losses in epochs.items():
        assert len(losses) >= 2, f"trainer{trainer}: epoch lines {losses}\n{report}"
        assert losses[-1] < losses[0], f"trainer{trainer}'s loss did not fall: {losses}\n{report}"

    assert "dense layers identical on every trainer (DDP over rpcdist): True" in stdout, report
    moved = MOVED.search(stdout)
    assert moved is not None and float(moved.group(1)) > 0, f"the server's table did not train\n{report}"
    result = RESULT.search(stdout)
    assert result is not None, f"no result line\n{report}"
    first, last = float(result.group(1)), float(result.group(2))
    assert last < first, f"the loss did not fall: {first} -> {last}\n{report}"
