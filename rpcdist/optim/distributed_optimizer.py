"""``DistributedOptimizer``: one local optimizer per owner of the parameters, stepped with the
gradients of a distributed autograd context, as ``torch.distributed.optim``.

    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        ...
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections import defaultdict
from typing import Any

import torch

from rpcdist.agent.markers import for_context
from rpcdist.autograd import get_gradients
from rpcdist.errors import RpcError
from rpcdist.futures import Future, wait_all
from rpcdist.rpc import RRef, rpc_async
from rpcdist.rpc.api import start_call
from rpcdist.serialization import trust

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner. One lock per process (as torch's) serializes every
    ``step`` there: trainers with their own DistributedOptimizers over the same parameters
    must not interleave setting ``.grad`` and stepping.

    Each has a key on its owner (:data:`_live`), which a step names instead of sending the
    RRef again: a step is then one small message, with no RRef fork to register."""

    _step_lock = threading.Lock()
    _keys = itertools.count(1)
    _live: weakref.WeakValueDictionary[int, _LocalOptimizer] = weakref.WeakValueDictionary()

    def __init__(
        self, optimizer_class: type[torch.optim.Optimizer], params: list[RRef[Any]], *args: Any, **kwargs: Any
    ):
        self._params = [rref.local_value() for rref in params]
        self._optimizer = optimizer_class(self._params, *args, **kwargs)
        self.key = next(_LocalOptimizer._keys)
        _LocalOptimizer._live[self.key] = self  # for as long as its RRef keeps it alive

    def step(self, context_id: int) -> None:
        gradients = get_gradients(context_id)
        with _LocalOptimizer._step_lock:
            for param in self._params:
                param.grad = gradients.get(param)
            self._optimizer.step()
            for param in self._params:
                param.grad = None  # the context's gradients were lent for this step only


@trust
def _new_local_optimizer(
    optimizer_class: type[torch.optim.Optimizer], params: list[RRef[Any]], args: Any, kwargs: Any
) -> tuple[RRef[_LocalOptimizer], int]:
    """On the owner: build the local optimizer; returns an RRef that keeps it alive, and its key."""
    local = _LocalOptimizer(optimizer_class, params, *args, **kwargs)
    return RRef(local), local.key


@trust
@for_context
def _step(key: int, context_id: int) -> None:
    """On the owner: step the local optimizer ``key`` with ``context_id``'s gradients."""
    local = _LocalOptimizer._live.get(key)
    if local is None:
        raise RpcError(f"local optimizer {key} no longer exists here (its DistributedOptimizer was freed)")
    local.step(context_id)


class DistributedOptimizer:
    """Applies ``optimizer_class`` to parameters spread over workers (``params_rref``: RRefs to
    them), each owner updating its own with the gradients of the given context.

    The constructor returns once every owner has built its local optimizer, as torch's (and
    raises an owner's error then); inside a running event loop it never blocks: the first
    ``step_async`` waits for them instead."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: list[RRef[Any]],
        *args: Any,
        **kwargs: Any,
    ):
        by_owner: dict[Any, list[RRef[Any]]] = defaultdict(list)
        for rref in params_rref:
            by_owner[rref.owner()].append(rref)
        self._creating: list[Future[tuple[RRef[_LocalOptimizer], int]]] | None = [
            rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()
        ]
        self._made: list[tuple[RRef[_LocalOptimizer], int]] = []
        if not _in_running_loop():
            self._created()

    def _created(self) -> list[tuple[RRef[_LocalOptimizer], int]]:
        if self._creating is not None:
            self._made, self._creating = wait_all(self._creating), None
        return self._made

    async def _created_async(self) -> list[tuple[RRef[_LocalOptimizer], int]]:
        if self._creating is not None:
            made = [await future for future in self._creating]
            self._made, self._creating = made, None
        return self._made

    @property
    def remote_optimizers(self) -> list[RRef[Any]]:
        """An RRef to each owner's local optimizer."""
        return [rref for rref, _ in self._created()]

    def _start(
        self, made: list[tuple[RRef[_LocalOptimizer], int]], context_id: int, waited: bool = False
    ) -> list[Future[Any]]:
        if waited:  # this thread waits for them next: each may be written right here
            return [
                start_call(
                    "async", rref.owner(), _step, (key, context_id), None, -1.0, waited=True, pulled=True
                )
                for rref, key in made
            ]
        return [rpc_async(rref.owner(), _step, args=(key, context_id)) for rref, key in made]

    def step(self, context_id: int) -> None:
        """Update every owner's parameters with ``context_id``'s gradients, concurrently;
        raises the first owner's error."""
        wait_all(self._start(self._created(), context_id, waited=True))

    async def step_async(self, context_id: int) -> None:
        """Awaitable form of :meth:`step`."""
        for future in self._start(await self._created_async(), context_id):
            await future


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
