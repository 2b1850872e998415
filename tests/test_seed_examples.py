"""The programs of PyTorch's "Writing Distributed Applications with PyTorch" tutorial
(examples/seed_*.py), run with ``import rpcdist as dist``: each one as its own command, as a
user would, checking its exit status and what it prints.

Each example starts its worker processes with torch.multiprocessing and picks a free
MASTER_PORT, so the tests can run in parallel with each other and with other suites.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 170  # seconds per example (the pytest timeout below leaves room to kill and report)


def run_command(args: list[str], cwd: Path, what: str) -> tuple[str, str]:
    """Run ``python *args`` in its own session; returns (stdout, report) after asserting exit 0."""
    # The worker processes print concurrently, one print() argument at a time when unbuffered,
    # so their lines would interleave mid-line: let each write its output whole (block-buffered
    # to the pipe, flushed at exit in one write).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,  # examples must not depend on the current directory
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so a hung example's workers can be killed too
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} did not finish in {TIMEOUT} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers an example left behind
    report = f"{what} exited {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert proc.returncode == 0, report
    return stdout, report


def run_example(script: str, tmp_path: Path) -> tuple[str, str]:
    return run_command([str(EXAMPLES_DIR / script)], tmp_path, script)


def has_data(stdout: str, rank: int, value: str) -> bool:
    """The tutorial's ``print('Rank ', rank, ' has data ', tensor[0])``."""
    return re.search(rf"Rank\s+{rank}\s+has data\s+tensor\({re.escape(value)}\)", stdout) is not None


@pytest.mark.timeout(180)
def test_p2p_blocking(tmp_path: Path) -> None:
    stdout, report = run_example("seed_p2p_blocking.py", tmp_path)
    assert has_data(stdout, 0, "1.") and has_data(stdout, 1, "1."), report


@pytest.mark.timeout(180)
def test_p2p_nonblocking(tmp_path: Path) -> None:
    stdout, report = run_example("seed_p2p_nonblocking.py", tmp_path)
    assert "Rank 0 started sending" in stdout and "Rank 1 started receiving" in stdout, report
    assert has_data(stdout, 0, "1.") and has_data(stdout, 1, "1."), report


@pytest.mark.timeout(180)
def test_all_reduce_group(tmp_path: Path) -> None:
    stdout, report = run_example("seed_all_reduce_group.py", tmp_path)
    assert has_data(stdout, 0, "2.") and has_data(stdout, 1, "2."), report


FOUR_PROCESSES = textwrap.dedent(
    """
    import os, sys
    from torch.multiprocessing import Process
    sys.path.insert(0, sys.argv[1])
    from seed_all_reduce_group import free_port, init_process, run

    os.environ['MASTER_PORT'] = free_port()
    processes = [Process(target=init_process, args=(rank, 4, run)) for rank in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    sys.exit(max(abs(p.exitcode) for p in processes))
    """
)


@pytest.mark.timeout(180)
def test_all_reduce_group_four_processes(tmp_path: Path) -> None:
    """The tutorial's figure: 4 processes, group [0, 1]. Ranks 2 and 3 are not members, so
    torch.distributed's all_reduce warns and returns: they print 1.0, ranks 0 and 1 print 2.0."""
    stdout, report = run_command(
        ["-c", FOUR_PROCESSES, str(EXAMPLES_DIR)], tmp_path, "seed_all_reduce_group.py with 4 processes"
    )
    assert has_data(stdout, 0, "2.") and has_data(stdout, 1, "2."), report
    assert has_data(stdout, 2, "1.") and has_data(stdout, 3, "1."), report


@pytest.mark.timeout(180)
def test_sync_sgd_loss_falls_on_every_rank(tmp_path: Path) -> None:
    stdout, report = run_example("seed_sync_sgd.py", tmp_path)
    # print('Rank ', dist.get_rank(), ', epoch ', epoch, ': ', epoch_loss / num_batches)
    losses: dict[int, dict[int, float]] = {}
    for rank, epoch, loss in re.findall(r"Rank\s+(\d+)\s*,\s*epoch\s+(\d+)\s*:\s+([-+0-9.eE]+)", stdout):
        losses.setdefault(int(rank), {})[int(epoch)] = float(loss)
    assert sorted(losses) == [0, 1], report
    for rank, by_epoch in losses.items():
        assert sorted(by_epoch) == list(range(10)), f"rank {rank}: epochs {sorted(by_epoch)}\n{report}"
        first, last = by_epoch[0], by_epoch[9]
        assert last < first, f"rank {rank}: loss {first} -> {last} did not fall\n{report}"


@pytest.mark.timeout(180)
def test_ring_allreduce_matches_all_reduce(tmp_path: Path) -> None:
    stdout, report = run_example("seed_ring_allreduce.py", tmp_path)
    for rank in range(4):
        assert re.search(rf"Rank\s+{rank}\s+ring allreduce check passed", stdout), report
    assert "equals dist.all_reduce:  False" not in stdout, report
