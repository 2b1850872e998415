"""examples/parameter_server.py and examples/pipeline_parallel.py, each run with --quick.

- parameter_server: a server and two trainers train a digits MLP with distributed autograd and
  a DistributedOptimizer; the server's parameters must classify the test set far better than
  chance (0.1).
- pipeline_parallel: a master drives an MLP split into two stages on two workers, micro-batches
  pipelined with rpc_async; the training loss must fall.

Both write their curves to a PNG (by default in the current directory) and print its path.
"""

from __future__ import annotations

import re
from pathlib import Path

import _examples
import pytest

pytest.importorskip("sklearn")

TIMEOUT = 200  # seconds per example; each quick run takes well under a minute on 2 idle cores
ACCURACY = re.compile(r"result: test accuracy ([\d.]+)")
LOSSES = re.compile(r"result: first loss ([\d.]+), last loss ([\d.]+)")
STEP = re.compile(r"^step +(\d+)/(\d+) +loss ([\d.]+)", re.MULTILINE)


def run_example(script: str, *args: str, cwd: Path) -> tuple[str, str]:
    return _examples.run_example(script, *args, cwd=cwd, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 20)
def test_parameter_server_quick_learns(tmp_path: Path) -> None:
    stdout, report = run_example("parameter_server.py", "--quick", cwd=tmp_path)
    for trainer in ("trainer1", "trainer2"):  # progress lines of both trainers, to the last epoch
        assert re.search(rf"epoch +3/3 +{trainer} +loss [\d.]+", stdout), report
    assert "all 3 workers shut down cleanly" in stdout, report
    match = ACCURACY.search(stdout)
    assert match is not None, f"no result line\n{report}"
    accuracy = float(match.group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (chance is 0.1)\n{report}"
    _examples.assert_curve_png(stdout, tmp_path / "parameter_server.png", report)  # the default


@pytest.mark.timeout(TIMEOUT + 20)
@pytest.mark.parametrize("flags", [(), ("--remote-modules",)], ids=["rrefs", "remote_modules"])
def test_pipeline_parallel_quick_loss_falls(tmp_path: Path, flags: tuple[str, ...]) -> None:
    # one run writes its curve where --plot says (folders made), the other to the default
    plot = tmp_path / "curves" / "loss.png" if flags else tmp_path / "pipeline_parallel.png"
    plot_flags = ("--plot", str(plot)) if flags else ()
    stdout, report = run_example("pipeline_parallel.py", "--quick", *flags, *plot_flags, cwd=tmp_path)
    steps = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in STEP.finditer(stdout)]
    assert steps, f"no step lines\n{report}"
    assert [s[0] for s in steps] == list(range(1, steps[0][1] + 1)), report  # every step, in order
    assert "all 3 workers shut down cleanly" in stdout, report
    match = LOSSES.search(stdout)
    assert match is not None, f"no result line\n{report}"
    first, last = float(match.group(1)), float(match.group(2))
    assert (first, last) == (steps[0][2], steps[-1][2]), report
    assert last < first, f"the loss did not fall: {first} -> {last}\n{report}"
    _examples.assert_curve_png(stdout, plot, report)
