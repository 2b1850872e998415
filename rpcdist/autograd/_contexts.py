"""Distributed autograd contexts: what each worker recorded about the tensors requiring grad
that crossed it inside a ``dist_autograd.context()``.

- A tensor requiring grad pickled into an RPC message (argument or result) inside a context
  becomes a **send**: the sender keeps it (and so its graph) under a send id.
- On the receiver it is rebuilt as a leaf requiring grad and kept as a **recv**, tagged with
  the sender's rank and send id, so its gradient can be passed back.

The current context follows the code that runs: a ``contextvars`` variable, set for the body
of ``with context()`` and, on a callee, for the function an RPC made in a context runs, so
nested RPCs join the same context. The agent consults this module only through
:data:`CALL_EXTENSION`, which ``init_rpc`` installs on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcdist import serialization
from rpcdist.serialization import trust

__all__ = ["DistAutogradContext", "current_id", "lookup", "create", "release"]

_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rpcdist_autograd_context", default=None
)
_contexts: dict[int, DistAutogradContext] = {}
_registry_lock = threading.Lock()
_local_ids = itertools.count(1)
_worker_rank = -1


@dataclass(eq=False)
class DistAutogradContext:
    """One context on one worker."""

    id: int
    sends: dict[int, torch.Tensor] = field(default_factory=dict)
    recvs: dict[int, tuple[torch.Tensor, int, int]] = field(
        default_factory=dict
    )  # id(leaf) -> (leaf, src, send)
    gradients: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # id(leaf) -> (leaf, grad)
    workers: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _send_ids: Any = field(default_factory=lambda: itertools.count(1))

    def add_send(self, tensor: torch.Tensor, peer: int) -> int:
        with self.lock:
            send_id = next(self._send_ids)
            self.sends[send_id] = tensor
            self.workers.add(peer)
        return send_id

    def add_recv(self, leaf: torch.Tensor, src: int, send_id: int) -> None:
        with self.lock:
            self.recvs[id(leaf)] = (leaf, src, send_id)
            self.workers.add(src)

    def recv_of(self, leaf: torch.Tensor) -> tuple[int, int] | None:
        entry = self.recvs.get(id(leaf))
        return None if entry is None or entry[0] is not leaf else (entry[1], entry[2])

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor, owned: bool = False) -> None:
        """Add ``grad`` to ``leaf``'s gradient in this context.

        The first gradient of a leaf is kept without a copy when ``owned`` (nothing else holds
        its buffer), as torch's gradient stealing does; otherwise it is copied, so that later
        accumulation never writes into a buffer someone else sees."""
        with self.lock:
            held = self.gradients.get(id(leaf))
            if held is None:
                self.gradients[id(leaf)] = (leaf, grad.detach() if owned else grad.detach().clone())
            else:
                held[1].add_(grad)

    def local_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return {leaf: grad for leaf, grad in self.gradients.values()}


def set_worker_rank(rank: int) -> None:
    global _worker_rank
    _worker_rank = rank


def worker_rank() -> int:
    return _worker_rank


def current_id() -> int | None:
    """The context the running code is in (None outside any)."""
    return _current.get()


def create() -> DistAutogradContext:
    """A new context, unique across workers (the rank is in the high bits of its id)."""
    if _worker_rank < 0:
        raise RuntimeError("distributed autograd needs RPC: call rpcdist.rpc.init_rpc(...) first")
    context_id = (_worker_rank << 40) | next(_local_ids)
    return lookup(context_id, create=True)  # type: ignore[return-value]


def lookup(context_id: int, create: bool = False) -> DistAutogradContext | None:
    with _registry_lock:
        context = _contexts.get(context_id)
        if context is None and create:
            context = _contexts[context_id] = DistAutogradContext(context_id)
        return context


def release(context_id: int) -> DistAutogradContext | None:
    with _registry_lock:
        return _contexts.pop(context_id, None)


def count() -> int:
    with _registry_lock:
        return len(_contexts)


def clear() -> None:
    with _registry_lock:
        _contexts.clear()


def enter(context_id: int | None) -> None:
    """Make ``context_id`` current in the running contextvars context (callee side)."""
    _current.set(context_id)


@contextlib.contextmanager
def entered(context_id: int | None) -> Iterator[None]:
    """Make ``context_id`` the current context for this block."""
    token = _current.set(context_id)
    try:
        yield
    finally:
        _current.reset(token)


class _AutogradCalls:
    """The agent's :class:`~rpcdist.agent.extensions.CallExtension` for distributed autograd:
    a call made inside a context carries its id, the callee runs in it, and the tensors
    requiring grad in its messages become sends (and receives on the other side)."""

    def capture(self) -> int | None:
        return _current.get()

    def enter(self, state: Any) -> None:
        _current.set(state)

    def tensor_reducer(self, state: Any, peer: int) -> Any:
        if state is None:
            return None
        context = lookup(state, create=True)
        assert context is not None
        with context.lock:
            context.workers.add(peer)  # it will have to release the context too

        def reduce(tensor: torch.Tensor, rebuild: Any, rebuild_args: tuple[Any, ...]) -> Any:
            send_id = context.add_send(tensor, peer)
            return (_rebuild_received, (rebuild, rebuild_args, context.id, _worker_rank, send_id))

        return reduce


CALL_EXTENSION = _AutogradCalls()
"""Installed on the RPC agent by ``init_rpc``."""


@trust
def _rebuild_received(
    rebuild: Any, rebuild_args: tuple[Any, ...], context_id: int, src: int, send_id: int
) -> torch.Tensor:
    """Unpickles a tensor sent inside a context: a leaf whose gradient goes back to the sender."""
    if rebuild not in (serialization.rebuild_tensor, serialization.rebuild_sparse_coo):
        raise TypeError(f"a tensor sent in a distributed autograd context cannot be rebuilt by {rebuild!r}")
    leaf = rebuild(*rebuild_args)
    if not leaf.requires_grad:
        leaf.requires_grad_(True)
    record_recv(leaf, context_id, src, send_id)
    return leaf


def record_recv(leaf: torch.Tensor, context_id: int, src: int, send_id: int) -> None:
    """Called by the deserializer for a tensor that was sent in a context."""
    context = lookup(context_id, create=True)
    assert context is not None
    context.add_recv(leaf, src, send_id)
