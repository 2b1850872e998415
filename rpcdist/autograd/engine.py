"""The distributed backward pass (FAST mode, as torch documents it).

Each worker runs its *local* graph as gradients arrive: from the roots on the worker that
calls ``backward``, and from a send whenever a peer passes back the gradient of a tensor it
received. A local pass computes the gradients of every leaf the outputs depend on
(``torch.autograd.grad``, so ``.grad`` is never touched): leaves that are parameters of this
worker accumulate in the context; leaves that were received from a peer send their gradient
back to that peer's send, which runs its own local pass, and so on. A pass completes when
all the passes it started have, so ``backward`` returns once the whole distributed graph is
done; an error anywhere reaches its caller.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rpcdist.agent import current_agent
from rpcdist.agent.markers import ASYNC_EXECUTION_ATTR
from rpcdist.autograd import _contexts
from rpcdist.errors import RpcError
from rpcdist.futures import Future
from rpcdist.serialization import trust


def _leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf requiring grad that ``outputs`` depend on (graph walk, no execution)."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = []
    for out in outputs:
        if out.grad_fn is None:
            if out.requires_grad:
                leaves[id(out)] = out
        else:
            stack.append(out.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = variable
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return list(leaves.values())


# (leaf, its gradient, whether the gradient's buffer is this pass's own: see _root_gradients)
LeafGradient = tuple[torch.Tensor, torch.Tensor, bool]


def _local_gradients(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    leaves: list[torch.Tensor] | None = None,
) -> list[LeafGradient]:
    if leaves is None:
        leaves = _leaves(outputs)
    if not leaves:
        return []
    grads = torch.autograd.grad(outputs, leaves, grad_outputs, retain_graph=True, allow_unused=True)
    return [(leaf, grad, False) for leaf, grad in zip(leaves, grads, strict=True) if grad is not None]


def _buffer(grad: torch.Tensor) -> int:
    """Where a gradient's data lives (a sparse one's: its values)."""
    return grad._values().data_ptr() if grad.is_sparse else grad.data_ptr()


def _root_gradients(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    leaves: list[torch.Tensor] | None = None,
) -> list[LeafGradient]:
    """:func:`_local_gradients` for the worker that called ``backward``, through torch's full
    engine so that gradient-accumulation hooks run as in a local backward: a
    DistributedDataParallel module in the graph averages its gradients across its group, as it
    does under torch's distributed autograd. ``.grad`` is restored afterwards (distributed
    autograd leaves it untouched); the parameters are this caller's, as in a local backward.

    Each gradient comes with whether the context may keep it without a copy, as torch's
    distributed autograd does (its gradient stealing): when the leaf's accumulation took the
    very buffer the backward pass computed (torch's rules: dense and laid out like the leaf, or
    sparse with contiguous parts, and referenced by nothing else), and no other leaf received
    that buffer too (torch's distributed engine holds every leaf's gradient until all are
    accumulated, so a buffer given to two leaves is copied for both)."""
    if leaves is None:
        leaves = _leaves(outputs)
    if not leaves:
        return []
    arrived: list[int | None] = [None] * len(leaves)

    def note(index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:  # keeps only the address: a reference would
            arrived[index] = _buffer(grad)  # make the accumulation copy the buffer

        return hook

    saved = [leaf.grad for leaf in leaves]
    handles = []
    try:
        for index, leaf in enumerate(leaves):
            leaf.grad = None
            # (last of the leaf's hooks: it sees the gradient the accumulation receives)
            handles.append(leaf.register_hook(note(index)))
        torch.autograd.backward(outputs, grad_outputs, retain_graph=True, inputs=leaves)
        grads = [leaf.grad for leaf in leaves]
    finally:
        for handle in handles:
            handle.remove()
        for leaf, grad in zip(leaves, saved, strict=True):
            leaf.grad = grad
    given = collections.Counter(arrived)
    out = []
    for leaf, grad, buffer in zip(leaves, grads, arrived, strict=True):
        if grad is not None:
            out.append((leaf, grad, buffer is not None and given[buffer] == 1 and _buffer(grad) == buffer))
    return out


def _gradients_at_root(
    context: _contexts.DistAutogradContext,
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
) -> list[LeafGradient]:
    """The local gradients of the worker that called ``backward``: :func:`_root_gradients`,
    unless every leaf was received from a peer (a trainer whose loss depends on its own
    parameters only through a parameter server, the last stage's caller of a pipeline). Their
    gradients go back to their senders, and no accumulation hook of this worker can be on
    them (DDP's are on its parameters), so the plain :func:`_local_gradients` serves, without
    the hooks and the ``.grad`` juggling."""
    leaves = _leaves(outputs)
    if all(context.recv_of(leaf) is not None for leaf in leaves):
        return _local_gradients(outputs, grad_outputs, leaves)
    return _root_gradients(outputs, grad_outputs, leaves)


async def local_pass(
    agent: Any,
    context: _contexts.DistAutogradContext,
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    root: bool = False,
) -> None:
    """Run this worker's graph from ``outputs``; pass received leaves' gradients back.

    ``root``: this is the worker that called ``backward`` (see :func:`_gradients_at_root`)."""
    if root:
        pairs = await agent.run_user_function(_gradients_at_root, (context, outputs, grad_outputs), {})
    else:
        pairs = await agent.run_user_function(_local_gradients, (outputs, grad_outputs), {})
    passes = pass_on(agent, context, pairs)
    if passes:
        await asyncio.gather(*(asyncio.ensure_future(_awaitable(p)) for p in passes))


def local_pass_here(
    agent: Any,
    context: _contexts.DistAutogradContext,
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
) -> list[Any]:
    """:func:`local_pass` for a thread that may block (the caller of a blocking ``backward``):
    the local graph runs right here, with no hop to the loop and the pool and back; returns the
    futures of the passes it started on other workers."""
    return pass_on(agent, context, _gradients_at_root(context, outputs, grad_outputs))


def pass_on(agent: Any, context: _contexts.DistAutogradContext, pairs: list[LeafGradient]) -> list[Any]:
    """Accumulate the gradients of this worker's leaves; send those of received leaves back to
    their senders (returns the futures of those passes)."""
    passes = []
    for leaf, grad, owned in pairs:
        origin = context.recv_of(leaf)
        if origin is None:
            context.accumulate(leaf, grad, owned)
        else:
            src, send_id = origin
            passes.append(
                agent.submit(
                    src,
                    backward_from_send,
                    (context.id, send_id, grad),
                    None,
                    0,
                    function_name="rpcdist.autograd.backward",
                    waited=True,  # (this thread waits for them, or hands them to the loop)
                )
            )
    return passes


async def _awaitable(future: Any) -> Any:
    return await future


@trust
def backward_from_send(context_id: int, send_id: int, grad: torch.Tensor) -> Any:
    """On the worker that sent a tensor (a pool thread): continue the backward pass from it.
    The local graph runs right on this thread (no hop back to the loop between the message and
    the work); the call completes once the passes it started elsewhere did, through the
    Future it returns (``async_execution``), never a wait on this thread: a pool thread blocked
    in that wait could be the one a nested pass coming back here needs, and many concurrent
    backward passes (torch's test_async_dist_autograd: 40 threads) would hold every pool
    thread so, a deadlock."""
    agent = current_agent()
    context = _contexts.lookup(context_id)
    if context is None:
        raise RpcError(
            f"distributed autograd context {context_id} does not exist on worker {agent.info.name}"
        )
    tensor = context.sends.get(send_id)
    if tensor is None:
        raise RpcError(f"context {context_id} on worker {agent.info.name} has no send {send_id}")
    with _contexts.entered(None):  # the passes it starts are not calls made in the context
        passes = pass_on(agent, context, _local_gradients([tensor], [grad]))
    done: Future[None] = Future()
    if not passes:  # a leaf of the distributed graph: answered at once, from this thread
        done.set_result(None)
        return done
    # Answered when the last pass it started completes (the callee answers from that
    # completion, on the loop: no task, no wake-up of the loop to start waiting).
    remaining = [len(passes)]
    lock = threading.Lock()

    def one_done(finished: Any) -> None:
        error = finished.exception()
        with lock:
            if remaining[0] <= 0:  # settled already (an earlier pass failed)
                return
            remaining[0] = 0 if error is not None else remaining[0] - 1
            if remaining[0]:
                return
        if error is not None:  # the first failure is the pass's error
            done.set_exception(error)
        else:
            done.set_result(None)

    for p in passes:
        p._on_done(one_done)
    return done


setattr(backward_from_send, ASYNC_EXECUTION_ATTR, True)  # (returns an awaitable; see above)
