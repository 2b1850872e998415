"""The distributed backward pass (FAST mode, as torch documents it).

Each worker runs its *local* graph as gradients arrive: from the roots on the worker that
calls ``backward``, and from a send whenever a peer passes back the gradient of a tensor it
received. A local pass computes the gradients of every leaf the outputs depend on
(``torch.autograd.grad``, so ``.grad`` is never touched): leaves that are parameters of this
worker accumulate in the context; leaves that were received from a peer send their gradient
back to that peer's send, which runs its own local pass, and so on. A pass completes when
all the passes it started have, so ``backward`` returns once the whole distributed graph is
done; an error anywhere reaches its caller.

A pass whose gradients all go back to the worker that called it (a pipeline stage whose input
came from the driver that runs the backward, a chain's last hop) does not call that worker: it
hands the gradients back in its answer, and the caller runs them as its own pass. The same
work, two messages instead of four (a call back, its answer, then this pass's answer), and the
pass keeps its caller's failure detection (it is an ordinary call with an ordinary answer).

A pass sends the gradients of everything it received from one worker in one call (a
pipeline's micro-batches each came back from the last stage: one call carries them all), and
that worker runs one local pass over all of them, so a backward costs messages and engine runs
per worker it crosses, not per tensor that crossed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

try:  # torch's own entry into its engine, under autograd.grad's handling of its arguments
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # (a torch without it)
    _engine_run_backward = None

from rpcdist._runtime import channel_thread
from rpcdist.agent import current_agent
from rpcdist.agent.markers import ASYNC_EXECUTION_ATTR, for_context
from rpcdist.autograd import _contexts
from rpcdist.errors import RpcError
from rpcdist.futures import Future, wait_all
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
    if _engine_run_backward is None:
        grads = torch.autograd.grad(outputs, leaves, grad_outputs, retain_graph=True, allow_unused=True)
    else:
        # What autograd.grad runs, without its argument handling: that costs ~40-70 us a pass
        # on a worker that just woke (cold caches), and the arguments here are tensors already
        # (the engine still checks each gradient's shape against its output's).
        grads = _engine_run_backward(
            tuple(outputs), tuple(grad_outputs), True, False, tuple(leaves), True, accumulate_grad=False
        )
    owned = _made_for_this_pass(grads, grad_outputs)
    return [
        (leaf, grad, mine) for leaf, grad, mine in zip(leaves, grads, owned, strict=True) if grad is not None
    ]


def _made_for_this_pass(grads: Sequence[torch.Tensor | None], given: Sequence[torch.Tensor]) -> list[bool]:
    """For each of the engine's results, whether the context may keep it without a copy (as
    torch's gradient stealing does): a dense tensor in memory torch allocated, that no other
    result and no gradient ``given`` to the pass shares, and that nothing else refers to: not a
    tensor a backward function saved or returned from elsewhere, nor a view of one (the engine
    hands many results over as views of a buffer made for them, such as a transposed product).
    Each copy spared is an allocation and a copy of a parameter's size on the pass's path."""
    storages = []
    for grad in grads:
        storages.append(_fresh_storage(grad) if grad is not None else 0)
    taken = {grad.untyped_storage().data_ptr() for grad in given if grad.layout is torch.strided}
    shared = collections.Counter(storages)
    return [storage != 0 and storage not in taken and shared[storage] == 1 for storage in storages]


def _fresh_storage(grad: torch.Tensor) -> int:
    """Where ``grad``'s memory is, if only ``grad`` refers to it (see _made_for_this_pass); else 0.
    The counts are those of a result of the engine that nothing else holds, here: the results'
    tuple, the loop's name and the call's argument (``sys.getrefcount``); the tensor's own
    reference to its base, and the base's Python object (``_use_count``)."""
    if (
        grad.layout is not torch.strided
        or grad.requires_grad
        or not grad.numel()
        or grad._use_count() != 1  # (a saved tensor is held by its node too)
        or sys.getrefcount(grad) != _RESULT_REFERENCES + 1
    ):
        return 0
    if grad._base is not None and (
        grad._base._use_count() != 2 or sys.getrefcount(grad._base) != _BASE_REFERENCES
    ):
        return 0
    storage = grad.untyped_storage()
    return storage.data_ptr() if storage.resizable() else 0  # (not memory from numpy, say)


_RESULT_REFERENCES = 3
_BASE_REFERENCES = 2


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


# What a pass hands back to its caller: (send id, gradient) of tensors the caller sent.
HandedBack = list[tuple[int, torch.Tensor]]
# The gradients a pass passes on to other workers: (the sender, its send id, the gradient).
Outgoing = list[tuple[int, int, torch.Tensor]]


async def local_pass(
    agent: Any,
    context: _contexts.DistAutogradContext,
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    root: bool = False,
) -> None:
    """Run this worker's graph from ``outputs``; pass received leaves' gradients back, and
    run what those passes hand back, until the whole distributed pass is done.

    ``root``: this is the worker that called ``backward`` (see :func:`_gradients_at_root`)."""
    if root:
        pairs = await agent.run_user_function(_gradients_at_root, (context, outputs, grad_outputs), {})
    else:
        pairs = await agent.run_user_function(_local_gradients, (outputs, grad_outputs), {})
    passes = pass_on(agent, context, pairs)
    while passes:
        handed = await asyncio.gather(*(asyncio.ensure_future(_awaitable(p)) for p in passes))
        passes = []
        if any(handed):
            pairs = await agent.run_user_function(_handed_gradients, (context, _joined(handed)), {})
            passes = pass_on(agent, context, pairs)


def local_pass_here(
    agent: Any,
    context: _contexts.DistAutogradContext,
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
) -> None:
    """:func:`local_pass` for a thread that may block (the caller of a blocking ``backward``):
    the local graph, and what the passes it starts hand back, run right here, with no hop to
    the loop and the pool and back; the loop only carries the gradients that go to other
    workers."""
    passes = pass_on(agent, context, _gradients_at_root(context, outputs, grad_outputs), pulled=True)
    while passes:
        handed = wait_all(passes)
        if any(handed):
            passes = pass_on(agent, context, _handed_gradients(context, _joined(handed)), pulled=True)
        else:
            passes = []


def _joined(handed: Sequence[HandedBack | None]) -> HandedBack:
    return [pair for part in handed if part for pair in part]


def _handed_gradients(context: _contexts.DistAutogradContext, handed: HandedBack) -> list[LeafGradient]:
    """The local pass from the sends whose gradients a peer handed back, or passed back in one
    call (one pass for all)."""
    tensors = []
    for send_id, _ in handed:
        tensor = context.sends.get(send_id)
        if tensor is None:
            where = current_agent().info.name
            raise RpcError(f"context {context.id} on worker {where} has no send {send_id}")
        tensors.append(tensor)
    return _local_gradients(tensors, [grad for _, grad in handed])


def _outgoing(context: _contexts.DistAutogradContext, pairs: list[LeafGradient]) -> Outgoing:
    """Accumulate the gradients of this worker's leaves; returns (sender, send id, gradient)
    of the received leaves, whose gradients go back to their senders."""
    outgoing = []
    for leaf, grad, owned in pairs:
        origin = context.recv_of(leaf)
        if origin is None:
            context.accumulate(leaf, grad, owned)
        else:
            outgoing.append((origin[0], origin[1], grad))
    return outgoing


def _start(
    agent: Any, context: _contexts.DistAutogradContext, outgoing: Outgoing, pulled: bool = False
) -> list[Any]:
    """Start the passes of ``outgoing`` on their senders, one call per sender carrying all its
    gradients (a pipeline's micro-batches: one message and one local pass on the stage, not
    one per micro-batch); returns their futures (each one's value: what that pass hands back
    to this worker, or None). ``pulled``: this thread waits for them next with ``wait_all``
    (see ``Caller.submit``)."""
    me = agent.info.id
    by_sender: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for src, send_id, grad in outgoing:
        by_sender.setdefault(src, []).append((send_id, grad))
    return [
        agent.submit(
            src,
            backward_from_send,
            (context.id, gradients, me),
            None,
            0,
            function_name="rpcdist.autograd.backward",
            waited=True,  # (this thread waits for them, or hands them to the loop)
            pulled=pulled,
        )
        for src, gradients in by_sender.items()
    ]


def pass_on(
    agent: Any, context: _contexts.DistAutogradContext, pairs: list[LeafGradient], pulled: bool = False
) -> list[Any]:
    """Accumulate the gradients of this worker's leaves; send those of received leaves back to
    their senders (returns the futures of those passes)."""
    return _start(agent, context, _outgoing(context, pairs), pulled)


async def _awaitable(future: Any) -> Any:
    return await future


@trust
@for_context
def backward_from_send(context_id: int, gradients: HandedBack, caller: int) -> Any:
    """On the worker that sent tensors (a pool thread): continue the backward pass from them,
    given (send id, gradient) for each. The local graph runs right on this thread, once for
    all of them (no hop back to the loop between the message and the work); the call completes
    once the passes it started elsewhere did, through the Future it returns
    (``async_execution``), never a wait on a pool thread: one blocked in that wait could be the
    one a nested pass coming back here needs, and many concurrent backward passes (torch's
    test_async_dist_autograd: 40 threads) would hold every pool thread so, a deadlock. A reply
    channel's thread is no pool thread: there the passes are waited for in place.

    When every gradient it passes on goes to ``caller`` (the worker that called this pass),
    they are handed back in the answer instead (see the module's docstring)."""
    agent = current_agent()
    context = _contexts.lookup(context_id)
    if context is None:
        raise RpcError(
            f"distributed autograd context {context_id} does not exist on worker {agent.info.name}"
        )
    done: Future[HandedBack | None] = Future()
    outgoing = _outgoing(context, _handed_gradients(context, gradients))
    if not outgoing:  # a leaf of the distributed graph: answered at once, from this thread
        done.set_result(None)
        return done
    if all(src == caller for src, _, _ in outgoing):
        done.set_result([(sid, g) for _, sid, g in outgoing])  # answered at once, as above
        return done
    if getattr(channel_thread, "serving", False):
        # A reply channel's thread (no pool thread, and its caller waits for this answer):
        # it waits for the passes it starts right here, their calls and answers on channels
        # of its own, and answers from here; no hop to the loop and the pool on either side.
        try:
            _passes_here(agent, context, outgoing)
        except BaseException as exc:  # noqa: BLE001 - the pass's error, for the caller
            done.set_exception(exc)
            return done
        done.set_result(None)
        return done
    _Passes(agent, context, done).start(outgoing)
    return done


setattr(backward_from_send, ASYNC_EXECUTION_ATTR, True)  # (returns an awaitable; see above)


def _passes_here(agent: Any, context: _contexts.DistAutogradContext, outgoing: Outgoing) -> None:
    """Start the passes of ``outgoing`` and wait for them on this thread, running what they
    hand back (and waiting for the passes that starts) until all are done; raises the first
    failure. Only on a thread that may block (see ``backward_from_send``)."""
    while outgoing:
        with _contexts.entered(None):  # the passes it starts are not calls made in the context
            passes = _start(agent, context, outgoing, pulled=True)
        handed = wait_all(passes)
        outgoing = _outgoing(context, _handed_gradients(context, _joined(handed))) if any(handed) else []


class _Passes:
    """The passes one pass started on other workers, and the work they hand back (run on the
    pool, its own passes added before the one that handed it back counts as done): settles
    ``done`` once all are done (answered from that completion, on the loop: no task, no
    wake-up of the loop to start waiting), or at the first failure."""

    def __init__(self, agent: Any, context: _contexts.DistAutogradContext, done: Future[Any]) -> None:
        self.agent, self.context, self.done = agent, context, done
        self.remaining = 0
        self.lock = threading.Lock()

    def start(self, outgoing: Outgoing) -> None:
        with _contexts.entered(None):  # the passes it starts are not calls made in the context
            passes = _start(self.agent, self.context, outgoing)
        with self.lock:
            self.remaining += len(passes)
        for p in passes:
            p._on_done(self._one_done)

    def _one_done(self, finished: Any) -> None:
        error = finished.exception()
        if error is None and finished.value():
            with self.lock:
                self.remaining += 1  # (the handed-back work, until it has started its passes)
            self.agent.pool.submit(functools.partial(self._run_handed, finished.value()))
        self._settle_one(error)

    def _run_handed(self, handed: HandedBack) -> None:
        try:
            outgoing = _outgoing(self.context, _handed_gradients(self.context, handed))
            if outgoing:
                self.start(outgoing)
        except Exception as exc:  # noqa: BLE001 - the pass's error
            self._settle_one(exc)
            return
        self._settle_one(None)

    def _settle_one(self, error: BaseException | None) -> None:
        with self.lock:
            if self.remaining <= 0:  # settled already (an earlier pass failed)
                return
            self.remaining = 0 if error is not None else self.remaining - 1
            if self.remaining:
                return
        if error is not None:  # the first failure is the pass's error
            self.done.set_exception(error)
        else:
            self.done.set_result(None)
