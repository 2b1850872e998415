"""The import hook: rpcdist's modules under torch's names, in the harness's worker processes.

torch's test modules write ``import torch.distributed.rpc as rpc``, ``from torch.distributed.nn
import RemoteModule``, ... . After :func:`install`, those imports give rpcdist:

* :data:`MODULES`: the torch module *and every submodule of it* is replaced by a
  :class:`StandIn`, a module object that serves the public names of the rpcdist module of the
  same place (``torch.distributed.rpc.api`` -> ``rpcdist.rpc.api``). Private (``_``) names are
  served only where :data:`PRIVATE_COUNTERPARTS` says rpcdist implements that very name.
* :data:`ATTRIBUTES`: single names replaced inside torch's own module, whose other contents
  stay torch's (``torch.distributed.optim`` keeps its functional optimizers, ZeRO, ...).
* :data:`TORCH_DATA`: plain data of torch's (an enum the suites use at import time), served
  from torch's own module: it has no behaviour to substitute.

A name rpcdist has no counterpart for is served as a :class:`NoCounterpart`: importing it
works (so a torch test module that merely imports it still loads), using it raises an error
that names it. No behaviour falls back to torch's implementation, so no test can pass through
torch's own RPC agent.

torch's real modules are imported first, so torch's own internals keep the references they
took to each other; only code imported afterwards (torch's test modules) sees the stand-ins.
:func:`original` gives the real module, e.g. to check that torch's agent never started.

Only the worker processes call :func:`install` (``tests/compat/worker.py``, before any torch
test module is imported); the pytest process keeps torch's modules untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

# torch module -> the rpcdist module that takes its place (with its submodules).
MODULES: dict[str, str] = {
    "torch.distributed.rpc": "rpcdist.rpc",
    "torch.distributed.autograd": "rpcdist.autograd",
    "torch.distributed.nn.api.remote_module": "rpcdist.nn.api.remote_module",
}

# torch module -> {name: rpcdist module that has it}: set inside torch's own module.
ATTRIBUTES: dict[str, dict[str, str]] = {
    "torch.distributed.optim": {"DistributedOptimizer": "rpcdist.optim"},
    "torch.distributed.nn": {"RemoteModule": "rpcdist.nn"},
}

# Private names of torch's that rpcdist implements under the same name and meaning. Any other
# private name is a NoCounterpart (torch's private hooks are not rpcdist's API).
PRIVATE_COUNTERPARTS: dict[str, frozenset[str]] = {
    "torch.distributed.rpc": frozenset({"_set_rpc_timeout", "_get_current_rpc_agent"}),
    "torch.distributed.rpc.api": frozenset(
        {
            "_set_rpc_timeout",
            "_wait_all",
            "_thread_local_var",
            "_wait_all_workers",
            "_barrier",
            "_get_current_rpc_agent",
        }
    ),
    "torch.distributed.nn.api.remote_module": frozenset(
        {"_RemoteModule", "_REMOTE_MODULE_PICKLED_ATTRIBUTES"}
    ),
}

# Plain data of torch's (enums, constants: no behaviour) that torch's test modules use at import
# time; served from torch's own module.
TORCH_DATA: dict[str, frozenset[str]] = {
    "torch.distributed.rpc.internal": frozenset({"RPCExecMode"}),
}

_originals: dict[str, types.ModuleType] = {}  # torch's real modules, by name, once installed


class NoCounterpartError(NotImplementedError):
    """A torch name that rpcdist has no counterpart for was used."""


class NoCounterpart:
    """Stands for a torch name rpcdist does not have: calling it raises
    :class:`NoCounterpartError`, reading an attribute of it raises ``AttributeError``."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _message(self) -> str:
        return f"{self._qualname} has no rpcdist counterpart (tests/compat/substitution.py)"

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NoCounterpartError(self._message())

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self._message()}; its attribute {name!r} was read")

    def __repr__(self) -> str:
        return f"<NoCounterpart {self._qualname}>"


class StandIn(types.ModuleType):
    """torch's module ``name`` as the tests see it: ``target``'s public names (rpcdist's), the
    listed private counterparts, torch's submodules as stand-ins too, and a
    :class:`NoCounterpart` for anything else."""

    def __init__(self, name: str, target: types.ModuleType | None, torch_dir: Path | None) -> None:
        super().__init__(name, f"rpcdist stand-in for {name} ({target.__name__ if target else 'nothing'})")
        self.__rpcdist_module__ = target
        self.__torch_dir__ = torch_dir  # the real torch package's directory (None: not a package)
        if target is not None and hasattr(target, "__file__"):
            self.__file__ = target.__file__
        if torch_dir is not None:
            self.__path__: list[str] = []  # a package: its submodules come from _Finder

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if _torch_has_submodule(self.__torch_dir__, name):
            return importlib.import_module(f"{self.__name__}.{name}")  # served by _Finder
        if name in TORCH_DATA.get(self.__name__, ()):
            return getattr(original(self.__name__), name)
        target = self.__rpcdist_module__
        public = not name.startswith("_")
        if target is not None and hasattr(target, name):
            if public or name in PRIVATE_COUNTERPARTS.get(self.__name__, ()):
                return getattr(target, name)
        return NoCounterpart(f"{self.__name__}.{name}")


def _torch_has_submodule(torch_dir: Path | None, name: str) -> bool:
    """Whether the real torch package in ``torch_dir`` has a submodule ``name``."""
    if torch_dir is None or not name.isidentifier():
        return False
    return (torch_dir / name / "__init__.py").is_file() or (torch_dir / f"{name}.py").is_file()


def _rpcdist_module(torch_name: str) -> types.ModuleType | None:
    """The rpcdist module at the place of ``torch_name`` (a MODULES entry or a submodule of
    one), or None if rpcdist has no such module."""
    for root, rpcdist_root in MODULES.items():
        if torch_name == root or torch_name.startswith(root + "."):
            name = rpcdist_root + torch_name[len(root) :]
            break
    else:
        raise KeyError(torch_name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            return None  # rpcdist has no such module (an import failing inside one is raised)
        raise


def _package_dir(parent_dir: Path | None, leaf: str) -> Path | None:
    """The directory of torch's package ``leaf`` in ``parent_dir`` (None: not a package)."""
    if parent_dir is None or not (parent_dir / leaf / "__init__.py").is_file():
        return None
    return parent_dir / leaf


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``import torch.distributed.rpc.<anything torch has>`` as a StandIn (first on
    ``sys.meta_path``, so torch's own files are never loaded again under these names)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent, _, leaf = fullname.rpartition(".")
        parent_module = sys.modules.get(parent)
        if not isinstance(parent_module, StandIn):
            return None
        torch_dir = parent_module.__torch_dir__
        if not _torch_has_submodule(torch_dir, leaf):
            return None  # torch has no such module either: ModuleNotFoundError, as with torch
        package_dir = _package_dir(torch_dir, leaf)
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=package_dir is not None)
        spec.loader_state = package_dir
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandIn(spec.name, _rpcdist_module(spec.name), spec.loader_state)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: a StandIn serves its names on demand."""


def install() -> None:
    """Put rpcdist in place of torch's RPC modules in this process (idempotent)."""
    if installed():
        return
    # torch's modules first, so torch's internals bind each other; then rpcdist's, before any
    # torch module leaves sys.modules.
    rpcdist_modules = [*MODULES.values(), *(m for names in ATTRIBUTES.values() for m in names.values())]
    for name in [*MODULES, *ATTRIBUTES, *rpcdist_modules]:
        importlib.import_module(name)
    for torch_name in MODULES:
        real = sys.modules[torch_name]
        _originals[torch_name] = real
        for loaded in [n for n in sys.modules if n.startswith(torch_name + ".")]:
            _originals[loaded] = sys.modules.pop(loaded)  # imported again as stand-ins, on demand
        torch_dir = Path(real.__file__).parent if hasattr(real, "__path__") else None
        stand_in = StandIn(torch_name, _rpcdist_module(torch_name), torch_dir)
        stand_in.__spec__ = importlib.machinery.ModuleSpec(torch_name, None, is_package=torch_dir is not None)
        sys.modules[torch_name] = stand_in
        parent, _, leaf = torch_name.rpartition(".")
        setattr(sys.modules[parent], leaf, stand_in)  # `import a.b.c as x` reads attributes
    sys.meta_path.insert(0, _Finder())
    for torch_name, names in ATTRIBUTES.items():
        for name, rpcdist_name in names.items():
            setattr(sys.modules[torch_name], name, getattr(importlib.import_module(rpcdist_name), name))


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return isinstance(sys.modules.get("torch.distributed.rpc"), StandIn)


def original(torch_name: str) -> types.ModuleType:
    """torch's own module ``torch_name`` (one that :func:`install` replaced)."""
    return _originals[torch_name]
