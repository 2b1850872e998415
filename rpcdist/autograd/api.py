"""``rpcdist.autograd``: distributed autograd, as ``torch.distributed.autograd``.

with dist_autograd.context() as context_id:
    loss = rpc.rpc_sync("ps", forward, args=(x,)).sum()
    dist_autograd.backward(context_id, [loss])
    grads = dist_autograd.get_gradients(context_id)   # {tensor: grad} on this worker
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch

from rpcdist._runtime import current_loop, run_on
from rpcdist.agent import Agent, current_agent
from rpcdist.agent.markers import inline
from rpcdist.autograd import _contexts
from rpcdist.autograd.engine import local_pass, local_pass_here
from rpcdist.errors import BlockingCallError, RpcError
from rpcdist.futures import wait_all

log = logging.getLogger(__name__)

__all__ = ["context", "backward", "backward_async", "get_gradients", "is_available", "DistAutogradContext"]

DistAutogradContext = _contexts.DistAutogradContext  # torch's name for one context on one worker


def is_available() -> bool:
    """True: rpcdist's distributed autograd is always built (torch's depends on its build)."""
    return True


def _agent() -> Agent:
    return current_agent()


def _context(context_id: int) -> _contexts.DistAutogradContext:
    context = _contexts.lookup(context_id)
    if context is None:
        raise RpcError(f"no distributed autograd context {context_id} on this worker")
    return context


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id. On exit it is released on every worker
    that took part (also after an error)."""
    _agent()  # RPC must be up
    ctx = _contexts.create()
    try:
        with _contexts.entered(ctx.id):
            yield ctx.id
    finally:
        _release_everywhere(ctx.id)


def _release_everywhere(context_id: int) -> None:
    """Forget the context here and tell every worker it reached (without waiting, as torch:
    each of them cascades to the workers it involved)."""
    agent = _agent()
    released = _contexts.release(context_id)
    if released is None:
        return
    for rank in sorted(released.workers - {agent.info.id}):
        try:
            agent.submit(rank, _release, (context_id,), None, 30.0, function_name="rpcdist.autograd.release")
        except Exception as exc:  # noqa: BLE001 - a gone worker has nothing to release
            log.debug("cannot release context %s on rank %s: %s", context_id, rank, exc)


@inline
def _release(context_id: int) -> None:
    """On a worker that took part: forget the context, and tell the workers it involved."""
    context = _contexts.release(context_id)
    if context is None:
        return
    agent = _agent()
    for rank in context.workers - {agent.info.id}:
        try:
            agent.submit(rank, _release, (context_id,), None, 30.0, function_name="rpcdist.autograd.release")
        except Exception as exc:  # noqa: BLE001
            log.debug("cannot cascade release of %s to rank %s: %s", context_id, rank, exc)


def _roots(roots: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    roots = list(roots)
    for root in roots:
        if not isinstance(root, torch.Tensor) or not root.requires_grad:
            raise RpcError("backward roots must be tensors that require grad")
    return roots, [torch.ones_like(r) for r in roots]


async def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Awaitable form of :func:`backward`."""
    context = _context(context_id)
    outputs, grads = _roots(roots)
    agent = _agent()
    with _contexts.entered(None):  # the passes it starts are not calls made in the context
        await run_on(agent.loop, local_pass(agent, context, outputs, grads, root=True))


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` through every worker of the context (FAST mode).

    Gradients accumulate in the context on each worker (see :func:`get_gradients`); ``.grad``
    is left untouched. The graph is kept until the context exits, so calling ``backward``
    again (``retain_graph=True`` in torch) accumulates once more.
    """
    agent = _agent()
    context = _context(context_id)
    outputs, grads = _roots(roots)
    if current_loop() is agent.loop:
        raise BlockingCallError(
            "dist_autograd.backward() on the rpcdist event loop would block it; "
            "use `await dist_autograd.backward_async(...)`"
        )
    # This thread may block: the local graph runs here (no hop to the loop and a pool thread
    # and back); the loop only carries the gradients that go to other workers.
    with _contexts.entered(None):  # the passes it starts are not calls made in the context
        passes = local_pass_here(agent, context, outputs, grads)
    wait_all(passes)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in ``context_id`` on this worker, keyed by tensor."""
    return _context(context_id).local_gradients()


def _context_count() -> int:
    """How many contexts this worker holds (for leak checks)."""
    return _contexts.count()
