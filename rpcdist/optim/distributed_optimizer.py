"""``DistributedOptimizer``: one local optimizer per owner of the parameters, stepped with the
gradients of a distributed autograd context, as ``torch.distributed.optim``.

    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        ...
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from rpcdist.autograd import get_gradients
from rpcdist.futures import Future, wait_all
from rpcdist.rpc import RRef, remote, rpc_async

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner. One lock per process (as torch's) serializes every
    ``step`` there: trainers with their own DistributedOptimizers over the same parameters
    must not interleave setting ``.grad`` and stepping."""

    _step_lock = threading.Lock()

    def __init__(
        self, optimizer_class: type[torch.optim.Optimizer], params: list[RRef[Any]], *args: Any, **kwargs: Any
    ):
        self._params = [rref.local_value() for rref in params]
        self._optimizer = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        gradients = get_gradients(context_id)
        with _LocalOptimizer._step_lock:
            for param in self._params:
                param.grad = gradients.get(param)
            self._optimizer.step()
            for param in self._params:
                param.grad = None  # the context's gradients were lent for this step only


def _step(optimizer: RRef[_LocalOptimizer], context_id: int) -> None:
    optimizer.local_value().step(context_id)


class DistributedOptimizer:
    """Applies ``optimizer_class`` to parameters spread over workers (``params_rref``: RRefs to
    them), each owner updating its own with the gradients of the given context."""

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
        self.remote_optimizers = [
            remote(owner, _LocalOptimizer, args=(optimizer_class, rrefs, *args), kwargs=kwargs)
            for owner, rrefs in by_owner.items()
        ]

    def _start(self, context_id: int) -> list[Future[Any]]:
        return [rpc_async(opt.owner(), _step, args=(opt, context_id)) for opt in self.remote_optimizers]

    def step(self, context_id: int) -> None:
        """Update every owner's parameters with ``context_id``'s gradients, concurrently;
        raises the first owner's error."""
        wait_all(self._start(context_id))

    async def step_async(self, context_id: int) -> None:
        """Awaitable form of :meth:`step`."""
        for future in self._start(context_id):
            await future
