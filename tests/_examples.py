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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib's first two line colours (C0, C1), as RGB in [0, 1]
CURVE_COLOURS = {"C0 blue": (31 / 255, 119 / 255, 180 / 255), "C1 orange": (1.0, 127 / 255, 14 / 255)}


def assert_curve_png(stdout: str, expected: Path, report: str) -> None:
    """The example printed ``curve: <expected>`` and wrote there a valid PNG of a plot: the PNG
    signature and header, a figure's size, and both of its first two lines drawn across a panel."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("curve: ")), None)
    assert line is not None, f"no 'curve: PATH' line\n{report}"
    assert Path(line.removeprefix("curve: ")) == expected.resolve(), report
    data = expected.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{expected} is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 200, (width, height)
    assert len(data) > 10_000, f"{expected}: {len(data)} bytes, too small for a plot"

    import matplotlib.image
    import numpy as np

    rgb = matplotlib.image.imread(expected)[..., :3]
    for name, colour in CURVE_COLOURS.items():
        # Columns holding the colour (antialiased, lines cross each other): a line across a
        # panel covers well over 60; a legend's handle alone about 25.
        columns = (np.abs(rgb - np.array(colour)) < 0.1).all(axis=-1).any(axis=0).sum()
        assert columns >= 60, f"{expected}: the {name} line spans only {columns} columns: no curve drawn?"
