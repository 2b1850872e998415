"""bench/c10d_bench.py --quick runs end to end and prints the whole rpcdist-vs-gloo table.

Only the shape of the output is checked, never a time: the machines are far too noisy.
A second run injects a failure and a hang into rpcdist's phases and checks that both are
reported and that the run goes on (the phases after them are still measured).
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
BENCH = ROOT / "bench" / "c10d_bench.py"

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo"
)

HEADER_COLUMNS = ["metric", "unit", "gloo", "rpcdist", "rpcdist/gloo time", "target", "met", "better"]
# row prefix -> unit, for --quick
QUICK_ROWS = {
    "send/recv 1 MB, rank 0 -> 1, world 2": "MB/s",
    "all_reduce SUM 4 KB, world 2": "µs",
    "all_reduce SUM 1 MB, world 2": "ms",
    "all_reduce SUM 4 KB, world 4": "µs",
    "all_reduce SUM 1 MB, world 4": "ms",
    "broadcast 1 MB from rank 0, world 2": "ms",
    "broadcast 1 MB from rank 0, world 4": "ms",
    "barrier, world 2": "µs",
    "barrier, world 4": "µs",
}
CELL = r"(?:[\d,]+(?:\.\d+)?\*?|ERR|HANG|SKIP|LOST|-)"


def run_bench(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, str]:
    # Own session, so a timeout can kill the orchestrator and every rank it started.
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
            f"c10d_bench.py did not finish in {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
        )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
    return stdout, stderr


def table_row(lines: list[str], prefix: str) -> list[str]:
    """The cells after the label of the row starting with ``prefix``."""
    row = next((ln for ln in lines if ln.startswith(prefix + " ")), None)
    assert row is not None, f"missing row {prefix!r}\n" + "\n".join(lines)
    return row[len(prefix) :].split()


def check_table(stdout: str, rows: dict[str, str]) -> list[str]:
    lines = stdout.splitlines()
    assert lines and lines[0].startswith("rpcdist vs gloo (torch.distributed, backend gloo)"), stdout
    assert lines[1].startswith("targets:") and "1.5x" in lines[1] and "3x" in lines[1], lines[1]
    header = next((ln for ln in lines if ln.startswith("metric ")), None)
    assert header is not None, stdout
    for column in HEADER_COLUMNS:
        assert column in header, header
    for prefix, unit in rows.items():
        cells = table_row(lines, prefix)
        assert cells[0] == unit, (prefix, cells)
        assert re.fullmatch(CELL, cells[1]) and re.fullmatch(CELL, cells[2]), (prefix, cells)
        assert re.fullmatch(r"[\d.]+x|-", cells[3]), (prefix, cells)  # rpcdist/gloo time
        assert cells[4:6] in (["<=", "1.5x"], ["<=", "3x"]), (prefix, cells)
        assert cells[6] in ("yes", "NO", "-"), (prefix, cells)
    assert any(ln.startswith("per-round values") for ln in lines), stdout
    assert any(ln.startswith("total runtime") for ln in lines), stdout
    return lines


@pytest.mark.timeout(300)
def test_quick_bench_prints_full_table(tmp_path: Path) -> None:
    out_json = tmp_path / "c10d.json"
    stdout, _ = run_bench(["--quick", "--json", str(out_json)], timeout=280)
    lines = check_table(stdout, QUICK_ROWS)
    # the gloo column is measured (a number) on every row
    for prefix in QUICK_ROWS:
        assert re.fullmatch(r"[\d,]+(?:\.\d+)?\*?", table_row(lines, prefix)[1]), (prefix, stdout)

    doc = json.loads(out_json.read_text())
    assert {(r["system"], r["world"]) for r in doc["rounds"]} == {
        (s, w) for s in ("gloo", "rpcdist") for w in (2, 4)
    }
    assert set(doc["summary"]) == {
        "send_recv_1048576_w2",
        "all_reduce_4096_w2",
        "all_reduce_1048576_w2",
        "all_reduce_4096_w4",
        "all_reduce_1048576_w4",
        "broadcast_1048576_w2",
        "broadcast_1048576_w4",
        "barrier_w2",
        "barrier_w4",
    }
    # rpcdist's failures, if any, are reported with their tracebacks
    for f in doc["failures"]:
        assert f["system"] and f["phase"] and f["text"], f
        assert f"phase {f['phase']}" in stdout, stdout


@pytest.mark.timeout(300)
def test_failure_and_hang_are_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    out_json = tmp_path / "c10d.json"
    stdout, stderr = run_bench(
        ["--quick", "--worlds", "2", "--phase-budget", "8", "--json", str(out_json)],
        timeout=280,
        env={
            "C10DBENCH_FAIL": "rpcdist:all_reduce_4096",  # raises on the last rank
            "C10DBENCH_HANG": "rpcdist:broadcast_1048576:1",  # rank 1 never returns
        },
    )
    rows = {k: v for k, v in QUICK_ROWS.items() if k.endswith("world 2") or k.startswith("send/recv")}
    lines = check_table(stdout, rows)
    assert table_row(lines, "all_reduce SUM 4 KB, world 2")[2] == "ERR", stdout
    assert table_row(lines, "broadcast 1 MB from rank 0, world 2")[2] == "HANG", stdout
    # the phases after the failure and after the hang ran in fresh groups
    for prefix in ("all_reduce SUM 1 MB, world 2", "send/recv 1 MB, rank 0 -> 1, world 2"):
        assert re.fullmatch(r"[\d,]+(?:\.\d+)?", table_row(lines, prefix)[2]), (prefix, stdout)

    failures = stdout[stdout.index("failures") :]
    assert "phase all_reduce_4096: rank 1: RuntimeError: failure injected" in failures, failures
    assert "phase broadcast_1048576: HANG" in failures, failures
    assert "Traceback (most recent call last)" in stderr
    assert "--- rank 1 stacks ---" in stderr

    doc = json.loads(out_json.read_text())
    by_phase = {f["phase"]: f for f in doc["failures"]}
    assert "Traceback" in by_phase["all_reduce_4096"]["text"]
    assert "rank 0 in 'all_reduce_4096'" in by_phase["all_reduce_4096"]["text"]  # the peer's stacks
    assert by_phase["broadcast_1048576"]["text"].startswith("HANG")
    assert all(f["system"] == "rpcdist" for f in doc["failures"]), doc["failures"]
