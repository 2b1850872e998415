"""``bench/run.py failure --quick`` runs end to end and prints the whole failure/start-up table.

Only the shape of the output is checked, never a time: the machines are far too noisy. What
is checked beyond the shape: every measurement ran (a number, or torch's "> cap" for a
stopped peer), and rpcdist's futures failed with WorkerDiedError.
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
RUN = ROOT / "bench" / "run.py"

torch_rpc = pytest.importorskip("torch.distributed.rpc")
pytestmark = pytest.mark.skipif(
    not torch_rpc.is_available(), reason="torch built without torch.distributed.rpc"
)

HEADER_COLUMNS = ["metric", "unit", "torch", "rpcdist", "rpcdist/torch", "better when", "verdict", "target"]
# row label (--quick) -> unit
ROWS = {
    "SIGKILL -> call fails, rpcdist default (Unix socket)": "ms",
    "SIGKILL -> call fails, rpcdist transport=grpc": "ms",
    "SIGSTOP -> call fails, rpcdist grpc, heartbeat 1 s x 3": "s",
    "SIGSTOP -> call fails, rpcdist grpc, heartbeat 0.1 s x 3": "s",
    "idle CPU per worker, 8 workers, heartbeat 1 s (default)": "% core",
    "idle CPU of the busiest worker, heartbeat 1 s": "% core",
    "idle, heartbeat 1 s: busiest thread runnable": "% time",
    "idle CPU per worker, 8 workers, heartbeat 0.1 s": "% core",
    "start-up, 4 workers: launch -> rank 0 imported": "s",
    "start-up, 4 workers: launch -> rank 0's first call": "s",
    "start-up, 4 workers: launch -> launcher exits": "s",
}
NUMBER = r"[\d,]+(?:\.\d+)?"
CAPPED = r"> \d+(?:\.\d+)? s"  # torch's future had not failed when w0 stopped waiting


def table_cells(lines: list[str], label: str) -> list[str]:
    """The cells after the label of the row ``label`` (columns are 2+ spaces apart)."""
    row = next((ln for ln in lines if ln.startswith(label + " ")), None)
    assert row is not None, f"missing row {label!r}\n" + "\n".join(lines)
    return re.split(r"\s{2,}", row[len(label) :].strip())


@pytest.mark.timeout(240)
def test_quick_failure_bench_prints_full_table(tmp_path: Path) -> None:
    out_json = tmp_path / "failure.json"
    # Own session, so a timeout can kill the orchestrator and every process it started.
    proc = subprocess.Popen(
        [sys.executable, str(RUN), "failure", "--quick", "--json", str(out_json)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=220)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"failure --quick did not finish in 220 s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"

    lines = stdout.splitlines()
    assert lines and lines[0].startswith("failure detection and start-up: rpcdist vs torch"), stdout
    header = next((ln for ln in lines if ln.startswith("metric ")), None)
    assert header is not None, stdout
    for column in HEADER_COLUMNS:
        assert column in header, header
    for label, unit in ROWS.items():
        cells = table_cells(lines, label)
        assert cells[0] == unit, (label, cells)
        # rpcdist measured every row; torch too, or its future outlived the cap
        assert re.fullmatch(NUMBER, cells[2]), (label, cells)
        torch_cell = CAPPED if label.startswith("SIGSTOP") else NUMBER
        assert re.fullmatch(f"{torch_cell}|{NUMBER}", cells[1]), (label, cells)
        assert re.fullmatch(r"<? ?[\d.e+-]+x", cells[3]), (label, cells)  # rpcdist/torch
        assert cells[4] == "lower", (label, cells)
    assert any(ln.startswith("per-round values") for ln in lines), stdout
    assert any(ln.startswith("machine:") for ln in lines), stdout
    assert any(ln.startswith("total runtime") for ln in lines), stdout

    doc = json.loads(out_json.read_text())
    assert {(r["system"], r["case"], r["world"]) for r in doc["rounds"]} == {
        (s, case, world)
        for s in ("torch", "rpcdist")
        for case, world in (("detection", 3), ("heartbeat", 8), ("startup", 4))
    }
    results = {r["system"]: {} for r in doc["rounds"]}
    for rnd in doc["rounds"]:
        results[rnd["system"]].update(rnd["results"])
    for phase in ("kill_unix", "kill_grpc", "stop_hb_1s", "stop_hb_100ms"):
        res = results["rpcdist"][phase]
        assert res["detected"] and res["error"].startswith("WorkerDiedError"), (phase, res)
    assert "heartbeat" in results["rpcdist"]["stop_hb_1s"]["error"]
    assert len(results["rpcdist"]["idle_hb_1s"]["per_worker_pct"]) == 8
    for system in ("torch", "rpcdist"):
        assert results[system]["startup"]["ranks_shut_down"] == 4, results[system]["startup"]
