"""Modules, functions and classes the RemoteModule test workers (``remote_module_scenarios``)
call on each other.

Every worker imports this module by name, so every module class and factory here can be built
on any worker. Models are float64 and initialised from a seed only, so the driver builds the
same model locally as its single-process reference. Module-level state (``_kept``) is per
process: a worker keeps RemoteModules it was sent there until :func:`drop`.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch
from torch import nn

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist.nn import RemoteModule

DTYPE = torch.float64

_kept: dict[str, Any] = {}
_kept_lock = threading.Lock()


# ----------------------------------------------------------------------------- modules
class Mlp(nn.Module):
    """Linear-tanh-linear times a scalar ``scale`` (a direct parameter, so ``recurse=False``
    differs from ``recurse=True``), initialised from ``seed`` only."""

    def __init__(self, n_in: int, hidden: int, n_out: int, seed: int = 0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden, dtype=DTYPE), nn.Tanh())
        self.head = nn.Linear(hidden, n_out, dtype=DTYPE)
        self.scale = nn.Parameter(torch.ones((), dtype=DTYPE))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=DTYPE) * 0.5 + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def make_mlp(n_in: int, hidden: int, n_out: int, seed: int = 0) -> Mlp:
    """A factory, as ``module_cls`` may be any callable returning a module."""
    return Mlp(n_in, hidden, n_out, seed=seed)


def linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(n_in, n_out, dtype=DTYPE)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=DTYPE) * 0.5)
    return layer


class MyModule(nn.Module):
    """torch's RemoteModule test module: forward returns its arguments reversed."""

    def __init__(self, first_arg: Any, first_kwarg: Any = -1) -> None:
        super().__init__()
        self.param1 = nn.Parameter(torch.ones(1))

    def forward(
        self, tensor: torch.Tensor, number: int, word: str = "default"
    ) -> tuple[str, int, torch.Tensor]:
        return word, number, tensor


class BadModule:
    """Not an nn.Module."""

    def __init__(self, first_arg: Any, first_kwarg: Any = -1) -> None:
        self.first_arg = first_arg


def returns_not_a_module(*args: Any, **kwargs: Any) -> BadModule:
    return BadModule(*args, **kwargs)


class ModuleBuildError(Exception):
    """Raised by :class:`Exploding`'s constructor; importable on every worker."""


class Exploding(nn.Module):
    """A module whose constructor refuses a bad argument."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        if hidden <= 0:
            raise ModuleBuildError(f"hidden size must be positive, got {hidden}")
        self.layer = nn.Linear(2, hidden)


class Hybrid(nn.Module):
    """A local layer feeding a RemoteModule held as a submodule."""

    def __init__(self, remote: RemoteModule, seed: int) -> None:
        super().__init__()
        self.local = linear(3, 4, seed)  # the RemoteModules of these tests take 4 features
        self.remote = remote

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.remote(self.local(x))


def call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).detach()


def data(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=DTYPE)


# ----------------------------------------------------------------------------- run on the owner
def training_flags(module_rref: rpc.RRef[nn.Module]) -> list[bool]:
    """The ``training`` flag of the module behind ``module_rref`` and of all its submodules."""
    return [m.training for m in module_rref.local_value().modules()]


def module_params(module_rref: rpc.RRef[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


def module_grads(module_rref: rpc.RRef[nn.Module], context_id: int) -> list[torch.Tensor | None]:
    """The gradients of the module's parameters in distributed autograd context ``context_id``."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module_rref.local_value().parameters()]


def dot_grads_none(module_rref: rpc.RRef[nn.Module]) -> bool:
    return all(p.grad is None for p in module_rref.local_value().parameters())


# ----------------------------------------------------------------------------- RemoteModules sent here
def use_remote_module(remote_module: RemoteModule, x: torch.Tensor) -> dict[str, Any]:
    """Call a RemoteModule received in the arguments every way there is; report what it is."""
    return {
        "where": rpc.get_worker_info().name,
        "type": type(remote_module).__name__,
        "is_module": isinstance(remote_module, nn.Module),
        "on": remote_module.on,
        "device": remote_module.device,
        "training": remote_module.training,
        "owner": remote_module.get_module_rref().owner_name(),
        "forward": remote_module.forward(x).detach(),
        "forward_async": remote_module.forward_async(x).wait().detach(),
        "call": remote_module(x).detach(),
    }


def attribute_names(remote_module: RemoteModule) -> list[str]:
    return sorted(vars(remote_module))


def echo(obj: Any) -> Any:
    return obj


def make_remote_module(remote_device: str, seed: int) -> RemoteModule:
    """Create a RemoteModule here (on whoever runs this) and return it to the caller."""
    return RemoteModule(remote_device, Mlp, args=(4, 6, 3), kwargs={"seed": seed})


def forward_through_module_rref(
    remote_device: str, module_rref: rpc.RRef[nn.Module], x: torch.Tensor
) -> torch.Tensor:
    """Make a RemoteModule here over ``module_rref`` and run its forward."""
    return RemoteModule.init_from_module_rref(remote_device, module_rref).forward(x).detach()


def keep(key: str, obj: Any) -> None:
    with _kept_lock:
        _kept[key] = obj


def forward_kept(key: str, x: torch.Tensor) -> torch.Tensor:
    with _kept_lock:
        remote_module = _kept[key]
    return remote_module(x).detach()


def drop(prefix: str = "") -> int:
    with _kept_lock:
        keys = [k for k in _kept if k.startswith(prefix)]
        for k in keys:
            del _kept[k]
    gc.collect()
    return len(keys)


def debug() -> dict[str, int]:
    """This worker's RRef counts, after collecting garbage."""
    gc.collect()
    return rpc.debug_info()
