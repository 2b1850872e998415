"""bench/rpc_bench.py --quick runs end to end and prints the whole comparison table.

Only the shape of the output is checked, never a time: the machines are far too noisy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "rpc_bench.py"

torch_rpc = pytest.importorskip("torch.distributed.rpc")
pytestmark = pytest.mark.skipif(
    not torch_rpc.is_available(), reason="torch built without torch.distributed.rpc"
)

# rows comparing rpcdist with torch (each says which direction is better), then the raw-only row
COMPARED_ROWS = [
    "(a) rpc_sync no-op round trip",
    "(b) rpc_async no-op, 64 in flight",
    "(c) float32 tensor 1 MB one way",
    "(d) remote() + to_here()",
    "(e) idle CPU, callee process",
    "(e) idle CPU, caller process",
    "(f) RRef proxy call latency",
    "(g) owner memory per live RRef, 10,000 held",  # --quick holds 10,000 RRefs
    "(g) caller memory per live RRef, 10,000 held",
]
ROW_PREFIXES = [*COMPARED_ROWS, "grpc.aio raw: 64 MB client-stream"]


@pytest.mark.timeout(240)
def test_quick_bench_prints_full_table(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    # Own session, so a timeout can kill the orchestrator and every worker it spawned.
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--quick", "--json", str(out_json)],
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
        pytest.fail(
            f"rpc_bench.py --quick did not finish in 220 s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
        )

    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
    lines = stdout.splitlines()
    assert lines and lines[0].startswith("rpcdist vs torch.distributed.rpc"), stdout
    header = next((ln for ln in lines if ln.startswith("metric")), None)
    assert header is not None, stdout
    for column in ["unit", "torch", "rpcdist", "rpcdist/torch", "better when", "grpc.aio raw", "rpcdist/raw"]:
        assert column in header, header

    for prefix in ROW_PREFIXES:
        row = next((ln for ln in lines if ln.startswith(prefix)), None)
        assert row is not None, f"missing row {prefix!r}\n{stdout}"
    # Each comparison row names the direction that is better.
    for prefix in COMPARED_ROWS:
        row = next(ln for ln in lines if ln.startswith(prefix))
        assert (" lower " in row) or (" higher " in row), row
    units = {
        "(a)": "µs",
        "(b)": "calls/s",
        "(c)": "MB/s",
        "(d)": "µs",
        "(e)": "% core",
        "(f)": "µs",
        "(g)": "B/RRef",
    }
    for tag, unit in units.items():
        assert any(ln.startswith(tag) and f" {unit} " in ln for ln in lines), (tag, unit, stdout)

    doc = json.loads(out_json.read_text())
    systems = {r["system"] for r in doc["rounds"]}
    assert systems == {"torch", "rpcdist", "grpc"}, systems
    assert set(doc["summary"]) >= {
        "latency",
        "calls",
        f"oneway_{1 << 20}",
        "remote",
        "idle_callee",
        "rref_call",
        "rref_owner_mem",
        "rref_caller_mem",
        "stream",
    }
    # The memory phase ran with the --quick count wherever it produced a result.
    for rnd in doc["rounds"]:
        mem = rnd["results"].get("rref_memory")
        if mem is not None:
            assert mem["count"] == 10_000, mem
