"""bench/run.py security --quick runs end to end: every configuration (plain, token, token +
mTLS) measures every row. Only the shape of the output is checked, never a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    "(a) rpc_sync no-op round trip",
    "(b) rpc_async no-op, 64 in flight",
    "(c) float32 tensor 16 MB one way",
]


@pytest.mark.timeout(180)
def test_quick_security_bench_reports_every_configuration(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.Popen(  # own session: a timeout kills the driver and its workers
        [sys.executable, str(ROOT / "bench" / "run.py"), "security", "--quick", "--json", str(out_json)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=160)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the security bench did not finish in 160 s\n{stdout}\n{stderr[-5000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout}\n{stderr[-5000:]}"
    lines = stdout.splitlines()
    assert lines[0].startswith("rpcdist without auth vs with a token vs token + mTLS (gRPC links"), stdout
    header = next(line for line in lines if line.startswith("metric"))
    assert header.split() == [
        "metric",
        "unit",
        "plain",
        "token",
        "token/plain",
        "tls",
        "tls/plain",
        "better",
        "when",
    ]
    for label in ROWS:
        row = next((line for line in lines if line.startswith(label)), None)
        assert row is not None, f"missing row {label!r}\n{stdout}"
        ratios = [cell for cell in row[len(label) :].split() if cell.endswith("x")]
        assert len(ratios) == 2, row  # token/plain and tls/plain: every configuration measured it
    data = json.loads(out_json.read_text())
    assert {r["system"] for r in data["rounds"]} == {"plain", "token", "tls"}, data["rounds"]
