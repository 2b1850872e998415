"""bench/run.py: the one benchmark driver lists its scenarios and rejects unknown ones clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_list_names_every_scenario() -> None:
    proc = run("--list")
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == ["rpc", "c10d", "autograd", "failure", "security", "metrics", "ddp", "workloads"], (
        proc.stdout
    )


def test_unknown_scenario_is_a_clear_error() -> None:
    proc = run("no-such-scenario", "--quick")
    assert proc.returncode != 0
    assert "unknown scenario 'no-such-scenario'" in proc.stderr, proc.stderr
    for name in ("rpc", "c10d", "autograd", "failure", "security", "metrics", "ddp", "workloads"):
        assert name in proc.stderr, proc.stderr


def test_scenario_help_shows_its_own_flags() -> None:
    proc = run("c10d", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--quick", "--repeats", "--json", "--systems", "--worlds"):
        assert flag in proc.stdout, proc.stdout
