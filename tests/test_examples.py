"""Every example runs to completion with one command and prints what it promises.

To cover a new example, add a line to EXAMPLES: the script (relative to examples/), its extra
command-line arguments, and substrings its stdout must contain.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 120  # seconds per example

EXAMPLES: list[tuple[str, list[str], list[str]]] = [
    (
        "hello_rpc.py",
        [],
        [
            "the group is worker0, worker1, worker2",
            "rpc_sync('worker2', whoami) -> worker2 (pid ",
            "1. rpc_sync:   worker1 computed scale([1.0, 2.0, 3.0], 10) = [10.0, 20.0, 30.0]",
            "6 calls of async def slow_square",
            "worker2: 5^2 = 25",
            "Counter(100) lives on worker2",
            "add(5), add(7) ran there -> 112; to_here() fetched a copy: total=112",
            "divide(1, 0) on worker1 raised ZeroDivisionError",
            "done: all 3 workers shut down cleanly",
        ],
    ),
]


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize(("script", "args", "expected"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(script: str, args: list[str], expected: list[str], tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES_DIR / script), *args],
        cwd=tmp_path,  # examples must not depend on the current directory
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
        pytest.fail(f"{script} did not finish in {TIMEOUT} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers an example left behind
    report = f"{script} exited {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert proc.returncode == 0, report
    missing = [text for text in expected if text not in stdout]
    assert not missing, f"missing from the output: {missing}\n{report}"
