"""bench/autograd_bench.py --quick runs end to end and prints the whole rpcdist-vs-torch table.

Only the shape of the output is checked, never a time: the machines are far too noisy.
A second run (rpcdist only) injects a failure and a hang and checks that both are reported,
with tracebacks and stacks, and that the run still prints its table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "autograd_bench.py"

torch_rpc = pytest.importorskip("torch.distributed.rpc")
pytestmark = pytest.mark.skipif(
    not torch_rpc.is_available(), reason="torch built without torch.distributed.rpc"
)

HEADER_COLUMNS = ["metric", "unit", "torch", "rpcdist", "rpcdist/torch", "better when", "verdict"]
# row label -> (unit, better when)
ROWS = {
    "(a) PS training, 2 trainers: aggregate rate": ("steps/s", "higher"),
    "(a) PS training, 2 trainers: time per step, per trainer": ("ms", "lower"),
    "(a) PS training, 4 trainers: aggregate rate": ("steps/s", "higher"),
    "(a) PS training, 4 trainers: time per step, per trainer": ("ms", "lower"),
    "(b) 2-stage iteration with dist autograd": ("µs", "lower"),
    "(b) same forward, plain RPC, no autograd": ("µs", "lower"),
    "(b) distributed autograd overhead per iteration": ("µs", "lower"),
}
ROW_IDS = {
    "ps_steps_per_s",
    "ps_step_ms",
    "ps4_steps_per_s",
    "ps4_step_ms",
    "pipe_autograd_us",
    "pipe_plain_us",
    "pipe_overhead_us",
}
CELL = r"(?:-?[\d,]+(?:\.\d+)?\*?|ERR|HANG|SKIP|LOST|-)"
NUMBER = r"-?[\d,]+(?:\.\d+)?\*?"


def run_bench(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, str]:
    # Own session, so a timeout can kill the orchestrator and every process it started.
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"autograd_bench.py did not finish in {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
        )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
    return stdout, stderr


def table_row(lines: list[str], label: str) -> list[str]:
    """The cells after the label of the table row ``label``."""
    row = next((ln for ln in lines if ln.startswith(label + " ")), None)
    assert row is not None, f"missing row {label!r}\n" + "\n".join(lines)
    return row[len(label) :].split()


def check_table(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    title = "rpcdist vs torch.distributed.rpc + torch.distributed.autograd"
    assert lines and lines[0].startswith(title), stdout
    for line, trainers in ((lines[1], 2), (lines[2], 4)):
        target = f"target: rpcdist's PS training throughput with {trainers} trainers at least 1.3x"
        assert line.startswith(target), line
        assert re.search(r"met: (yes|NO|-)$", line), line
    header = next((ln for ln in lines if ln.startswith("metric ")), None)
    assert header is not None, stdout
    for column in HEADER_COLUMNS:
        assert column in header, header
    for label, (unit, better) in ROWS.items():
        cells = table_row(lines, label)
        assert cells[0] == unit, (label, cells)
        assert re.fullmatch(CELL, cells[1]) and re.fullmatch(CELL, cells[2]), (label, cells)
        assert re.fullmatch(r"-?[\d.]+x|-", cells[3]), (label, cells)  # rpcdist/torch
        assert cells[4] == better, (label, cells)
    assert any(ln.startswith("per-round values") for ln in lines), stdout
    assert any(ln.startswith("machine:") for ln in lines), stdout
    assert any(ln.startswith("total runtime") for ln in lines), stdout
    return lines


@pytest.mark.timeout(300)
def test_quick_bench_prints_full_table(tmp_path: Path) -> None:
    out_json = tmp_path / "autograd.json"
    stdout, _ = run_bench(["--quick", "--json", str(out_json)], timeout=280)
    lines = check_table(stdout)
    # torch's column is measured (a number) on every row: the workload itself runs
    for label in ROWS:
        assert re.fullmatch(NUMBER, table_row(lines, label)[1]), (label, stdout)

    doc = json.loads(out_json.read_text())
    assert {(r["system"], r["scenario"]) for r in doc["rounds"]} == {
        (s, sc) for s in ("torch", "rpcdist") for sc in ("ps", "ps4", "pipeline")
    }
    assert set(doc["summary"]) == ROW_IDS
    for rnd in doc["rounds"]:
        if rnd["system"] == "torch":
            assert not rnd["errors"], rnd["errors"]
    # rpcdist's failures, if any, are reported with their tracebacks
    for f in doc["failures"]:
        assert f["system"] and f["phase"] and f["text"], f
        assert f"phase {f['phase']}" in stdout, stdout


@pytest.mark.timeout(300)
def test_failure_and_hang_are_reported(tmp_path: Path) -> None:
    out_json = tmp_path / "autograd.json"
    stdout, stderr = run_bench(
        ["--quick", "--systems", "rpcdist", "--window", "1", "--phase-budget", "8", "--json", str(out_json)],
        timeout=280,
        env={
            "AGBENCH_FAIL": "rpcdist:ps_train",  # raises on the last trainer
            "AGBENCH_HANG": "rpcdist:pipeline:0",  # the driver never returns
        },
    )
    lines = check_table(stdout)
    for label in ROWS:
        assert table_row(lines, label)[1] == "-", (label, stdout)  # torch did not run
    assert table_row(lines, "(a) PS training, 2 trainers: aggregate rate")[2] == "ERR", stdout
    assert table_row(lines, "(a) PS training, 4 trainers: aggregate rate")[2] == "ERR", stdout
    assert table_row(lines, "(b) distributed autograd overhead per iteration")[2] == "HANG", stdout

    failures = stdout[stdout.index("failures") :]
    assert "phase ps_train: trainer2: RuntimeError: failure injected" in failures, failures
    assert "phase pipeline: HANG" in failures, failures
    assert "Traceback (most recent call last)" in stderr
    assert "--- driver stacks ---" in stderr

    doc = json.loads(out_json.read_text())
    by_phase = {f["phase"]: f for f in doc["failures"]}
    assert "Traceback" in by_phase["ps_train"]["text"]
    assert by_phase["pipeline"]["text"].startswith("HANG")
    assert "_autograd_workers.py" in by_phase["pipeline"]["text"]  # the hung driver's stack
    assert all(f["system"] == "rpcdist" for f in doc["failures"]), doc["failures"]
