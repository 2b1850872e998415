"""Packaging: the wheel ships every subpackage, the type-hint marker and stubs, the programs, and
one version (``rpcdist.__version__``), which ``python -m rpcdist --version`` prints.

The wheel is built here without build isolation (the venv's setuptools, no download); .ci/run
also installs a wheel in a fresh venv and runs RPC from it outside the repository.
"""

from __future__ import annotations

import configparser
import email
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import rpcdist

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _source_dir(package: str) -> Path:
    """Where ``package`` lives in the repository (pyproject's package-dir mapping applied)."""
    mapping = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for n in range(len(parts), 0, -1):  # the longest mapped prefix wins, as in setuptools
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[n:])
    return ROOT / Path(*parts)


def _folders_with_modules() -> set[str]:
    """Every folder of rpcdist/ (and of the mapped program folders) holding a module."""
    found = set()
    for top, folder in [("rpcdist", ROOT / "rpcdist")] + [
        (pkg, ROOT / src) for pkg, src in SETUPTOOLS.get("package-dir", {}).items() if pkg != "rpcdist"
    ]:
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.parent.relative_to(folder).parts
            found.add(".".join((top, *rel)))
    return found


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(SETUPTOOLS["packages"])
    missing = _folders_with_modules() - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml (else not installed): {missing}"
    gone = {p for p in listed if not _source_dir(p).is_dir()}
    assert not gone, f"pyproject.toml lists packages with no folder: {gone}"


def test_version_comes_from_one_place() -> None:
    assert "version" not in PYPROJECT["project"], "the version belongs in rpcdist/__init__.py only"
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert SETUPTOOLS["dynamic"]["version"] == {"attr": "rpcdist.__version__"}
    assert metadata.version("rpcdist") == rpcdist.__version__


def test_python_m_rpcdist_version(capsys: pytest.CaptureFixture[str]) -> None:
    # in-process (a fresh interpreter would spend seconds importing torch); .ci/check_wheel
    # runs the real `python -m rpcdist --version` from the installed wheel
    from rpcdist.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"rpcdist {rpcdist.__version__}"
    assert main([]) == 0
    assert "rpcdist-run" in capsys.readouterr().out  # without arguments: the programs


@pytest.mark.timeout(180)
def test_wheel_ships_packages_typing_marker_and_programs(tmp_path: Path) -> None:
    try:
        setuptools_version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("building without isolation needs setuptools in this venv")
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools_version} here; pyproject.toml's build needs >= 77")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--wheel-dir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("rpcdist-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(f"{dist_info}/METADATA"))
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())

    assert meta["Version"] == rpcdist.__version__
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert "rpcdist/py.typed" in names
    assert {"rpcdist/v1/agent_pb2.pyi", "rpcdist/v1/store_pb2.pyi"} <= names
    assert "rpcdist/__main__.py" in names
    for package in SETUPTOOLS["packages"]:  # every module of every package, at its installed path
        for module in _source_dir(package).glob("*.py"):
            installed = "/".join([*package.split("."), module.name])
            assert installed in names, f"{installed} is not in the wheel"
    scripts = dict(entry_points["console_scripts"])
    assert scripts == PYPROJECT["project"]["scripts"]
    assert {"rpcdist-run", "rpcdist-server", "rpcdist-worker"} <= scripts.keys()
