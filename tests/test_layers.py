"""The package's layers: no import cycle among rpcdist's modules, every module imports on its
own, and lower layers never import higher ones.

    wire/transport  ->  agent  ->  rpc / rref / autograd / collectives / optim

Edges are read from the source (every ``import``, also inside functions; only
``if TYPE_CHECKING:`` blocks are left out), so a cycle hidden in a function-level import
counts too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rpcdist

PACKAGE_DIR = Path(rpcdist.__file__).parent
# server/ and worker/ install as rpcdist.programs.*; they sit on top of everything.
PROGRAM_DIRS = {
    "rpcdist.programs.server": PACKAGE_DIR.parent / "server",
    "rpcdist.programs.worker": PACKAGE_DIR.parent / "worker",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        relative = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[:2] == ["rpcdist", "v1"]:
            continue  # generated protobuf code
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for name, folder in PROGRAM_DIRS.items():
        if (folder / "__init__.py").exists():
            found[name] = folder / "__init__.py"
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The rpcdist modules ``module`` imports (a ``from pkg import sub`` names ``pkg.sub``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    edges: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edges.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    edges.add(sub)
                elif base in modules:
                    edges.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges.discard(module)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_the_graph_sees_the_real_imports() -> None:
    graph = _graph()
    assert "rpcdist.agent.core" in graph["rpcdist.rpc.api"] or "rpcdist.agent" in graph["rpcdist.rpc.api"]
    assert "rpcdist.transport.frames" in graph["rpcdist.agent.caller"]
    # A cycle planted in a copy of the graph is found.
    planted = {k: set(v) for k, v in graph.items()}
    planted["rpcdist.transport.frames"].add("rpcdist.rpc.api")
    assert _find_cycle(planted) is not None


def test_no_import_cycle_among_rpcdist_modules() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


LAYERS = [
    # (package prefix, what it must never import)
    (
        "rpcdist.transport",
        ("rpcdist.agent", "rpcdist.rpc", "rpcdist.autograd", "rpcdist.collectives", "rpcdist.optim"),
    ),
    ("rpcdist.agent", ("rpcdist.rpc", "rpcdist.autograd", "rpcdist.collectives", "rpcdist.optim")),
    (
        "rpcdist.store",
        ("rpcdist.transport", "rpcdist.agent", "rpcdist.rpc", "rpcdist.autograd", "rpcdist.collectives"),
    ),
    ("rpcdist.serialization", ("rpcdist.transport", "rpcdist.agent", "rpcdist.rpc", "rpcdist.autograd")),
    ("rpcdist.collectives", ("rpcdist.rpc", "rpcdist.autograd", "rpcdist.optim")),
    ("rpcdist.autograd", ("rpcdist.rpc", "rpcdist.collectives", "rpcdist.optim")),
    # Every layer records through it, so it sits below them all.
    (
        "rpcdist.metrics",
        ("rpcdist.store", "rpcdist.transport", "rpcdist.agent", "rpcdist.rpc", "rpcdist.collectives"),
    ),
]


@pytest.mark.parametrize(("layer", "forbidden"), LAYERS, ids=[layer for layer, _ in LAYERS])
def test_a_layer_never_imports_the_layers_above_it(layer: str, forbidden: tuple[str, ...]) -> None:
    graph = _graph()
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    )
    assert not wrong, f"{layer} imports a layer above it: {wrong}"


@pytest.mark.timeout(900)  # one fresh interpreter (and torch import) per module, on a busy machine
def test_every_module_imports_on_its_own() -> None:
    """``python -c "import <module>"`` works for each module in a fresh interpreter (an import
    cycle that only bites when a module is imported first shows up here)."""
    names = sorted(n for n in _modules() if not n.startswith("rpcdist.programs"))
    script = (
        "import importlib, subprocess, sys\n"
        "failed = []\n"
        "procs = []\n"
        "for name in sys.argv[1:]:\n"
        "    procs.append((name, subprocess.Popen([sys.executable, '-c', f'import {name}'],"
        " stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))\n"
        "    if len(procs) >= 4:\n"
        "        n, p = procs.pop(0); out = p.communicate()[0]\n"
        "        if p.returncode: failed.append((n, out.decode()[-800:]))\n"
        "for n, p in procs:\n"
        "    out = p.communicate()[0]\n"
        "    if p.returncode: failed.append((n, out.decode()[-800:]))\n"
        "for n, out in failed: print('FAILED', n, out)\n"
        "sys.exit(1 if failed else 0)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=840, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(names) > 30  # the walk found the package
