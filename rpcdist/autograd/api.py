"""``rpcdist.autograd``: distributed autograd, as ``torch.distributed.autograd``.

with dist_autograd.context() as context_id:
    loss = rpc.rpc_sync("ps", forward, args=(x,)).sum()
    dist_autograd.backward(context_id, [loss])
    grads = dist_autograd.get_gradients(context_id)   # {tensor: grad} on this worker
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence

import torch

from rpcdist._runtime import current_loop, run_on
from rpcdist.agent import Agent, current_agent
from rpcdist.agent.markers import anywhere, inline
from rpcdist.autograd import _contexts
from rpcdist.autograd.engine import local_pass, local_pass_here
from rpcdist.errors import BlockingCallError, RpcError
from rpcdist.serialization import trust

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
        # torch's wording (tests match it)
        raise RpcError(f"Could not find autograd context with id: {context_id} (none on this worker)")
    return context


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id. On exit it is released on every worker
    that took part (also after an error). Contexts do not nest: opening one inside another
    (on the same thread) raises, as in torch."""
    _agent()  # RPC must be up
    if _contexts.current_id() is not None:
        raise RpcError(f"Already have an autograd context id for this thread: {_contexts.current_id()}")
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
    if released is not None:
        _tell_to_release(agent, context_id, released.workers, ())


def _tell_to_release(agent: Agent, context_id: int, workers: set[int], told: tuple[int, ...]) -> None:
    """Send the release of ``context_id`` to ``workers`` but those already ``told``; each
    message names everyone told so far, so a worker cascades only to workers nobody told
    (a parameter server's release does not come back to the trainer that sent it)."""
    me = agent.info.id
    targets = sorted(workers - set(told) - {me})
    if not targets:
        return
    everyone = tuple(sorted({*told, *targets, me}))
    for rank in targets:
        try:  # a notice: nobody waits for the release, so nothing needs to come back
            # Deferred: it goes out with the next message to that worker (the next step's
            # call, typically), within 0.1 s at the latest; it costs that worker no wake-up.
            name = "rpcdist.autograd.release"
            release = (context_id, everyone)
            agent.notify(rank, _release, release, function_name=name, deferred=True, plain=True)
        except Exception as exc:  # noqa: BLE001 - a gone worker has nothing to release
            log.debug("cannot release context %s on rank %s: %s", context_id, rank, exc)


@trust
@anywhere
@inline
def _release(context_id: int, told: tuple[int, ...] = ()) -> None:
    """On a worker that took part: forget the context, and tell the workers it involved that
    nobody told yet (``told``: the workers the release was sent to so far, and its sender)."""
    context = _contexts.release(context_id)
    if context is not None:
        _tell_to_release(_agent(), context_id, context.workers, told)


def _check_args(context_id: object, roots: object) -> None:
    """torch's argument checks of ``backward`` (pybind's TypeError wording for wrong types)."""
    if not isinstance(context_id, int) or isinstance(context_id, bool) or not isinstance(roots, Sequence):
        raise TypeError(
            "backward(): incompatible function arguments. The following argument types are supported: "
            "(context_id: int, roots: List[torch.Tensor], retain_graph: bool = False); got "
            f"({type(context_id).__name__}, {type(roots).__name__})"
        )


def _roots(roots: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The roots and their seed gradients, checked as torch checks them (torch's wording)."""
    roots = list(roots)
    if not roots:
        raise RpcError("No tensors provided for gradient computation.")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RpcError("requires_grad not set on root (backward roots must require grad)")
        if root.numel() != 1:
            raise RpcError(
                f"Tensors provided as roots should be scalars, found a tensor of size {tuple(root.shape)}, "
                "which is not a scalar, all roots need to be scalar"
            )
        if root.grad_fn is None:
            raise RpcError("Root tensor does not have a valid gradient function (it is a leaf)")
    return roots, [torch.ones_like(r) for r in roots]


def _node_error(agent: Agent, exc: Exception) -> RuntimeError:
    """The error of a failed backward pass, as torch reports it: ``Error on Node <rank>: ...``
    (the rank of the worker where it was raised): a copy of a RuntimeError (its type kept),
    else a RuntimeError chained to the original, keeping its remote attributes and notes."""
    node = agent.info.id
    worker = getattr(exc, "remote_worker", None)
    if worker is not None:
        with contextlib.suppress(Exception):
            node = agent.worker(worker).id
    message = f"Error on Node {node}: {exc}"
    if isinstance(exc, RuntimeError):
        # Keep its type (every rpcdist error is a RuntimeError): `except WorkerDiedError`
        # still catches a backward pass that reached a dead worker.
        try:
            same = copy.copy(exc)
            same.args = (message,)
            if str(same) == message:
                return same
        except Exception:  # noqa: BLE001 - an exception type that cannot be copied
            pass
    error = RuntimeError(message)
    for attribute in ("remote_worker", "remote_function", "remote_traceback"):
        if hasattr(exc, attribute):
            setattr(error, attribute, getattr(exc, attribute))
    for note in getattr(exc, "__notes__", ()):
        error.add_note(note)
    return error


async def backward_async(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Awaitable form of :func:`backward`."""
    _check_args(context_id, roots)
    context = _context(context_id)
    outputs, grads = _roots(roots)
    agent = _agent()
    with _contexts.entered(None):  # the passes it starts are not calls made in the context
        try:
            await run_on(agent.loop, local_pass(agent, context, outputs, grads, root=True))
        except Exception as exc:
            raise _node_error(agent, exc) from exc


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` through every worker of the context (FAST mode).

    Gradients accumulate in the context on each worker (see :func:`get_gradients`); ``.grad``
    is left untouched. The graph is kept until the context exits, so calling ``backward``
    again (``retain_graph=True`` in torch) accumulates once more.
    """
    agent = _agent()
    _check_args(context_id, roots)
    context = _context(context_id)
    outputs, grads = _roots(roots)
    if current_loop() is agent.loop:
        raise BlockingCallError(
            "dist_autograd.backward() on the rpcdist event loop would block it; "
            "use `await dist_autograd.backward_async(...)`"
        )
    # This thread may block: the local graph runs here (no hop to the loop and a pool thread
    # and back); the loop only carries the gradients that go to other workers.
    try:
        with _contexts.entered(None):  # the passes it starts are not calls made in the context
            local_pass_here(agent, context, outputs, grads)
    except Exception as exc:
        raise _node_error(agent, exc) from exc


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in ``context_id`` on this worker, keyed by tensor."""
    return _context(context_id).local_gradients()


def _context_count() -> int:
    """How many contexts this worker holds (for leak checks)."""
    return _contexts.count()
