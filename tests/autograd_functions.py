"""Models, functions and classes the distributed autograd test workers call on each other.

Every worker imports this module by name. Models live in a per-process registry
(:data:`_models`) under a name; :func:`build` makes the same model from the same seed on any
worker, so the driver can rebuild every remote stage locally as its single-process reference.
Everything is float64, so the distributed results can be compared with tight tolerances.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch
from torch import nn

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist.autograd import _contexts

DTYPE = torch.float64
FAILING_BACKWARD_TEXT = "backward failed on purpose (autograd test)"

_models: dict[str, nn.Module] = {}
_models_lock = threading.Lock()


# ----------------------------------------------------------------------------- models
def build(in_features: int, out_features: int, seed: int) -> nn.Module:
    """Linear + tanh, initialised from ``seed`` only (identical on every worker)."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen, dtype=DTYPE) * 0.5)
        linear.bias.copy_(torch.randn(out_features, generator=gen, dtype=DTYPE) * 0.1)
    return nn.Sequential(linear, nn.Tanh())


def data(rows: int, cols: int, seed: int, requires_grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=DTYPE).requires_grad_(requires_grad)


def create_model(name: str, in_features: int, out_features: int, seed: int) -> None:
    """Register a fresh model under ``name`` on this worker."""
    with _models_lock:
        _models[name] = build(in_features, out_features, seed)


def model(name: str) -> nn.Module:
    with _models_lock:
        return _models[name]


def forward(name: str, x: torch.Tensor) -> torch.Tensor:
    return model(name)(x)


def forward_twice(name: str, x: torch.Tensor) -> torch.Tensor:
    """The model (its parameters) used twice in one forward."""
    m = model(name)
    return m(x) * m(x.flip(0))


def add_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` and ``b`` may be the very same tensor, sent twice in one call."""
    return a * b + a


def chain_mid(
    x: torch.Tensor, mid: str, head: str, nxt: str, nxt_model: str, fail_next: bool = False
) -> torch.Tensor:
    """Middle stage of a 3-worker chain: local stage, then an RPC to ``nxt`` made inside the
    caller's autograd context, combined with a local head on the same hidden state. With
    ``fail_next`` the next stage's backward raises."""
    h = forward(mid, x)
    y = rpc.rpc_sync(nxt, failing_stage if fail_next else forward, (nxt_model, h))
    return y + forward(head, h)


def param_rrefs(name: str) -> list[rpc.RRef[Any]]:
    return [rpc.RRef(p) for p in model(name).parameters()]


def local_ready(rref: rpc.RRef[Any]) -> bool:
    """On the owner: ``local_value()`` of an RRef that may have been created a moment ago."""
    rref.local_value()
    return True


def params(name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model(name).parameters()]


def dot_grads_none(name: str) -> bool:
    return all(p.grad is None for p in model(name).parameters())


def grads(name: str, context_id: int) -> dict[str, Any]:
    """The gradients of ``name``'s parameters in ``context_id`` on this worker (None where the
    context has none), and whether every ``.grad`` is still None."""
    found = dist_autograd.get_gradients(context_id)
    ps = list(model(name).parameters())
    return {
        "grads": [None if found.get(p) is None else found[p].clone() for p in ps],
        "dot_grad_none": all(p.grad is None for p in ps),
    }


class Stage(nn.Module):
    """A module to keep behind an RRef (``rref.rpc_sync().forward(x)``)."""

    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        super().__init__()
        self.net = build(in_features, out_features, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def grads(self, context_id: int) -> list[torch.Tensor | None]:
        found = dist_autograd.get_gradients(context_id)
        return [found.get(p) for p in self.parameters()]


# ----------------------------------------------------------------------------- failures
class FailingBackward(torch.autograd.Function):
    """Identity forward; backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError(FAILING_BACKWARD_TEXT)


def failing_stage(name: str, x: torch.Tensor) -> torch.Tensor:
    return FailingBackward.apply(forward(name, x))


class PassThrough(torch.autograd.Function):
    """Identity that notes where the gradient it passes back lives (``buffers``, in order)."""

    buffers: list[int] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        PassThrough.buffers.append(grad.data_ptr())
        return grad


class SameGradTwice(torch.autograd.Function):
    """``a + b`` whose backward gives both inputs one and the same gradient tensor."""

    buffers: list[int] = []

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        SameGradTwice.buffers.append(grad.data_ptr())
        return grad, grad


class OverlappingSGD(torch.optim.SGD):
    """SGD whose step waits (up to :attr:`WAIT` s) until a second step has started in this
    process: if nothing serializes the steps of several optimizers, two steps overlap for
    sure (whatever the machine's load); if something does, the first waits out the timeout."""

    WAIT = 1.5
    _started = 0
    _cond = threading.Condition()

    def step(self, closure: Any = None) -> Any:
        cls = OverlappingSGD
        with cls._cond:
            cls._started += 1
            cls._cond.notify_all()
            cls._cond.wait_for(lambda: cls._started >= 2, timeout=cls.WAIT)
        return super().step(closure)


# ----------------------------------------------------------------------------- utilities
def context_count() -> int:
    return _contexts.count()


def no_tensors(a: int, b: int) -> int:
    return a + b


_barriers: dict[str, tuple[list[int], asyncio.Event]] = {}


async def barrier(tag: str, n: int, timeout: float = 120.0) -> None:
    """Returns once ``n`` calls with ``tag`` arrived (runs on this worker's event loop)."""
    count, event = _barriers.setdefault(tag, ([0], asyncio.Event()))
    count[0] += 1
    if count[0] >= n:
        event.set()
    await asyncio.wait_for(event.wait(), timeout)


def context_count_of(worker: str) -> int:
    """How many contexts ``worker`` holds, asked by this worker (whose calls carry nothing a
    third worker deferred for ``worker``)."""
    return rpc.rpc_sync(worker, context_count, timeout=60.0)
