"""Running an example program the way a user does, for the example tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def run_example(script: str, *args: str, cwd: Path, timeout: float) -> tuple[str, str]:
    """Run ``examples/<script> args`` in ``cwd``; returns its stdout and the report to fail
    with. Fails the test if it does not exit 0 within ``timeout`` seconds (its whole process
    group, workers included, is killed either way)."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES_DIR / script), *args],
        cwd=cwd,  # the examples must not depend on the current directory
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so a hung run's workers can be killed too
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script}: no result in {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers it may have left behind
    report = f"{script} exited {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert proc.returncode == 0, report
    return stdout, report
