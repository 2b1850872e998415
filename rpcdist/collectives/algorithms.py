"""The collectives, as coroutines over a group's messages.

Each call of a collective gets the group's next sequence number; its messages are tagged
``(sequence, step)`` and carry the collective's name and what each rank passed, so a rank
that called a different collective, or passed a different shape or dtype, gets a clear
error instead of garbage.

Algorithms are picked by size: small all_reduce exchanges tensors directly (one step,
latency-optimal); large ones run a ring of reduce-scatter then all-gather, each rank
sending 1/n of the tensor per step (bandwidth-optimal), with the send of one step on the
wire while the previous received segment is reduced. Reductions combine in rank order,
so every rank gets bit-identical results.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import torch

from rpcdist._runtime import wait_for
from rpcdist.collectives.group import CollectiveTimeoutError, DistributedError, ProcessGroup
from rpcdist.collectives.loans import Loan
from rpcdist.collectives.reduce_ops import ReduceOp, combine, finish

RING_MIN_BYTES = 256 << 10
DIRECT_MAX_BYTES_PAIR = 4 << 20
log = logging.getLogger(__name__)


class Exchange:
    """The messages of one collective call in one group."""

    def __init__(self, group: ProcessGroup, name: str, sequence: int) -> None:
        self.group = group
        self.name = name
        self.sequence = sequence
        self.me = group.rank()
        self.size = group.size()
        self._sent: list[Any] = []
        self._copied: list[Any] = []  # sends nobody waits for; a failure seen by then is raised
        # Notices: flush waits until they are written (not received), so a rank that returns
        # from its last collective and exits at once has not left its messages unsent.
        self._written: list[Any] = []
        self._loans: list[Loan] = []

    def send(self, to: int, step: int, payload: Any, meta: Any = None, lend: bool = True) -> None:
        """Send to group rank ``to``. A small tensor is copied now, a large one lent to a
        co-located peer is copied into its slot now and an object is pickled now, so nobody
        waits for their receipt (:meth:`flush` raises a failure already known); any other
        large tensor must stay untouched until :meth:`flush` (the receiver has it)."""
        large = (
            isinstance(payload, torch.Tensor) and payload.numel() * payload.element_size() >= RING_MIN_BYTES
        )
        # Small tensors (and a barrier's None) go as notices, which copy what they carry: nothing
        # waits for their receipt (the next step waits for the receiver's own message), so
        # answers would be wasted messages. Objects, of any size once pickled, go as calls.
        notice = payload is None or (isinstance(payload, torch.Tensor) and not large)
        # A lent tensor is copied into its slot right here: the next step need not wait for the
        # receiver to hand the slot back (which costs the ring one hand-off per step).
        copied = not large or (lend and self.group.lends(to, payload))
        future = self.group.send(
            to, ("c", self.sequence, step), (self.name, meta), payload, lend=lend, notice=notice
        )
        if notice:
            self._written.append((to, future))
        elif copied:  # (objects are pickled in-band right here too)
            future.add_done_callback(_log_failure)
            self._copied.append(future)
        else:
            self._sent.append(future)

    async def recv(self, source: int, step: int, expect_meta: Any = None) -> Any:
        """The payload ``source`` sent for ``step``. A lent tensor stays valid until
        :meth:`release`."""
        what = f"{self.name} (collective #{self.sequence} of group {self.group.ranks})"
        _, ((name, meta), payload) = await self.group.receive(source, ("c", self.sequence, step), what)
        if isinstance(payload, Loan):
            self._loans.append(payload)
            payload = payload.tensor
        if name != self.name:
            self.release()
            raise DistributedError(
                f"collective mismatch in call #{self.sequence}: rank {self.group.global_rank(source)} "
                f"called {name}, rank {self.group.global_rank(self.me)} called {self.name}"
            )
        if expect_meta is not None and meta is not None and meta != expect_meta:
            self.release()
            raise DistributedError(
                f"{self.name} #{self.sequence}: rank {self.group.global_rank(source)} passed {_show(meta)}, "
                f"rank {self.group.global_rank(self.me)} passed {_show(expect_meta)}"
            )
        return payload

    def release(self) -> None:
        """Done with every tensor received so far: lent slots go back to their senders."""
        loans, self._loans = self._loans, []
        for loan in loans:
            loan.release()

    async def flush(self) -> None:
        """Release what was received, then wait until every large message sent has been taken
        by its receiver (so its buffer may change) and every notice is written."""
        self.release()
        sent, self._sent = self._sent, []
        for future in sent:
            await future
        written, self._written = self._written, []
        for _, future in written:
            if future.done() and future.exception() is not None:
                raise future.exception()
        pending = [(to, future) for to, future in written if not future.done()]
        if pending:
            timeout = self.group.timeout if self.group.timeout > 0 else None
            try:
                await wait_for(_each(future for _, future in pending), timeout)
            except asyncio.TimeoutError:
                stuck = sorted({self.group.global_rank(to) for to, future in pending if not future.done()})
                raise CollectiveTimeoutError(
                    f"{self.name} (collective #{self.sequence} of group {self.group.ranks}) on rank "
                    f"{self.group.global_rank(self.me)}: its messages to rank(s) {stuck} were not "
                    f"written within {timeout:g} s (the peer reads nothing)"
                ) from None
        copied, self._copied = self._copied, []
        for future in copied:
            if future.done() and future.exception() is not None:
                raise future.exception()
            if not future.done():
                self._copied.append(future)

    def others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.me]


async def _each(futures: Any) -> None:
    for future in futures:
        await future


def _log_failure(future: Any) -> None:
    if future.exception() is not None:
        log.warning("a collective message was not delivered: %s", future.exception())


def _show(meta: Any) -> str:
    if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], str):
        return f"shape {list(meta[0])} dtype {meta[1]}"
    return repr(meta)


def signature(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return (tuple(t.shape), str(t.dtype))


def _copy_into(dest: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dest.shape != src.shape or dest.dtype != src.dtype:
        raise DistributedError(
            f"{what}: received shape {list(src.shape)} dtype {src.dtype}, "
            f"expected shape {list(dest.shape)} dtype {dest.dtype}"
        )
    dest.copy_(src)


# ---------------------------------------------------------------------------------------- reduce
async def all_reduce(ex: Exchange, tensor: torch.Tensor, op: ReduceOp) -> None:
    if ex.size == 1:
        finish(op, tensor, 1)
        return
    nbytes = tensor.numel() * tensor.element_size()
    # Two ranks move the same bytes either way; the direct exchange takes one step, not two.
    direct_limit = DIRECT_MAX_BYTES_PAIR if ex.size == 2 else RING_MIN_BYTES
    if nbytes < direct_limit or tensor.numel() < ex.size:
        await _all_reduce_direct(ex, tensor, op)
    else:
        await _all_reduce_ring(ex, tensor, op)


def _reduce_in_rank_order(
    ex: Exchange, received: dict[int, torch.Tensor], own: torch.Tensor, op: ReduceOp
) -> torch.Tensor:
    """Combine every rank's contribution in rank order (so all ranks get bit-identical
    results) into a fresh tensor; received ones may be lent views, never written."""
    parts = {**received, ex.me: own}
    acc = parts[0].clone()
    for r in range(1, ex.size):
        combine(op, acc, parts[r])
    finish(op, acc, ex.size)
    return acc


async def _all_reduce_direct(ex: Exchange, tensor: torch.Tensor, op: ReduceOp) -> None:
    meta = signature(tensor)
    for r in ex.others():
        ex.send(r, 0, tensor, meta)
    received = {r: await ex.recv(r, 0, meta) for r in ex.others()}
    acc = _reduce_in_rank_order(ex, received, tensor, op)
    await ex.flush()
    tensor.copy_(acc)


async def _all_reduce_ring(ex: Exchange, tensor: torch.Tensor, op: ReduceOp) -> None:
    n, me = ex.size, ex.me
    right, left = (me + 1) % n, (me - 1) % n
    meta = signature(tensor)
    segments = tensor.view(-1).tensor_split(n)
    # Reduce-scatter: after n-1 steps this rank holds the full reduction of segment me+1.
    for step in range(n - 1):
        ex.send(right, step, segments[(me - step) % n], meta)
        incoming = await ex.recv(left, step, meta)
        combine(op, segments[(me - step - 1) % n], incoming)
        await ex.flush()
    finish(op, segments[(me + 1) % n], n)
    # All-gather: pass the finished segments around the ring.
    for step in range(n - 1):
        ex.send(right, n + step, segments[(me + 1 - step) % n], meta)
        incoming = await ex.recv(left, n + step, meta)
        segments[(me - step) % n].copy_(incoming)
        await ex.flush()


async def reduce(ex: Exchange, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
    meta = signature(tensor)
    if ex.me != dst:
        ex.send(dst, 0, tensor, meta)
        await ex.flush()
        return
    received = {r: await ex.recv(r, 0, meta) for r in ex.others()}
    tensor.copy_(_reduce_in_rank_order(ex, received, tensor, op))
    ex.release()


async def reduce_scatter(
    ex: Exchange, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp
) -> None:
    if len(inputs) != ex.size:
        raise DistributedError(f"reduce_scatter needs {ex.size} input tensors, got {len(inputs)}")
    meta = signature(output)
    for r in ex.others():
        if signature(inputs[r]) != meta:
            raise DistributedError(
                f"reduce_scatter: input {r} has {_show(signature(inputs[r]))}, output {_show(meta)}"
            )
        ex.send(r, 0, inputs[r], meta)
    received = {r: await ex.recv(r, 0, meta) for r in ex.others()}
    acc = _reduce_in_rank_order(ex, received, inputs[ex.me], op)
    await ex.flush()
    output.copy_(acc)


# ---------------------------------------------------------------------------- data movement
async def broadcast(ex: Exchange, tensor: torch.Tensor, src: int) -> None:
    meta = signature(tensor)
    if ex.me == src:
        for r in ex.others():
            ex.send(r, 0, tensor, meta)
        await ex.flush()
    else:
        tensor.copy_(await ex.recv(src, 0, meta))
        ex.release()


async def all_gather(ex: Exchange, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
    if len(outputs) != ex.size:
        raise DistributedError(f"all_gather needs a list of {ex.size} output tensors, got {len(outputs)}")
    for r in ex.others():
        ex.send(r, 0, tensor, signature(tensor))
    for r in ex.others():
        _copy_into(outputs[r], await ex.recv(r, 0), f"all_gather from rank {ex.group.global_rank(r)}")
    _copy_into(outputs[ex.me], tensor, "all_gather (own tensor)")
    await ex.flush()


async def gather(
    ex: Exchange, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int
) -> None:
    if ex.me != dst:
        ex.send(dst, 0, tensor)
        await ex.flush()
        return
    if outputs is None or len(outputs) != ex.size:
        raise DistributedError(f"gather on the destination needs a gather_list of {ex.size} tensors")
    for r in ex.others():
        _copy_into(outputs[r], await ex.recv(r, 0), f"gather from rank {ex.group.global_rank(r)}")
        ex.release()
    _copy_into(outputs[ex.me], tensor, "gather (own tensor)")


async def scatter(
    ex: Exchange, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int
) -> None:
    if ex.me == src:
        if inputs is None or len(inputs) != ex.size:
            raise DistributedError(f"scatter on the source needs a scatter_list of {ex.size} tensors")
        for r in ex.others():
            ex.send(r, 0, inputs[r])
        _copy_into(tensor, inputs[ex.me], "scatter (own part)")
        await ex.flush()
    else:
        _copy_into(tensor, await ex.recv(src, 0), f"scatter from rank {ex.group.global_rank(src)}")
        ex.release()


async def all_to_all(ex: Exchange, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    if len(outputs) != ex.size or len(inputs) != ex.size:
        raise DistributedError(f"all_to_all needs {ex.size} input and {ex.size} output tensors")
    for r in ex.others():
        ex.send(r, 0, inputs[r])
    for r in ex.others():
        _copy_into(outputs[r], await ex.recv(r, 0), f"all_to_all from rank {ex.group.global_rank(r)}")
    _copy_into(outputs[ex.me], inputs[ex.me], "all_to_all (own part)")
    await ex.flush()


async def exchange_objects(ex: Exchange, outgoing: dict[int, Any]) -> dict[int, Any]:
    """Send ``outgoing[r]`` to each rank r; returns what each rank sent here (one step)."""
    for r, obj in outgoing.items():
        ex.send(r, 0, obj, lend=False)  # objects are handed to the user: never lent
    received = {r: await ex.recv(r, 0) for r in ex.others()}
    await ex.flush()
    return received


async def barrier(ex: Exchange) -> None:
    for r in ex.others():
        ex.send(r, 0, None)
    for r in ex.others():
        await ex.recv(r, 0)
    await ex.flush()


async def gather_all_objects(ex: Exchange, obj: Any) -> list[Any]:
    received = await exchange_objects(ex, {r: obj for r in ex.others()})
    received[ex.me] = obj
    return [received[r] for r in range(ex.size)]


__all__ = [
    "Exchange",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "broadcast",
    "all_gather",
    "gather",
    "scatter",
    "all_to_all",
    "exchange_objects",
    "barrier",
    "gather_all_objects",
]
