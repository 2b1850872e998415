"""The committed protobuf/gRPC code in rpcdist/v1 is exactly what protos/ generates (drift check).

Regenerate with::

    python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \\
        protos/rpcdist/v1/*.proto
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED = ROOT / "rpcdist" / "v1"
PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def generated_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in PATTERNS for p in sorted(directory.glob(pattern))}


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (PROTOS / "rpcdist" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"

    fresh = generated_files(tmp_path / "rpcdist" / "v1")
    committed = generated_files(GENERATED)
    assert fresh, "protoc generated nothing"
    assert sorted(fresh) == sorted(committed), "generated file set differs; regenerate rpcdist/v1"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, (
        f"rpcdist/v1 is out of date with protos/ for {stale}; regenerate it (see module docstring)"
    )
