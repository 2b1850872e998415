"""Process groups: who is in a group, how its members reach each other, and the
process-wide state ``init_process_group`` sets up.

Members talk through an RPC agent of their own (named ``c10d-rank<N>``), registered in the
same rendezvous store as ``init_rpc`` under the prefix ``c10d``, so RPC and collectives can be
used together in one process. A message is one call of :func:`_deliver` on the receiver,
which files it in the receiver's :class:`~rpcdist.collectives.mailbox.Mailbox`; calls between
two workers run in the order sent, so messages between a pair of ranks arrive in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcdist._runtime import wait_for
from rpcdist.agent.markers import inline
from rpcdist.collectives.loans import LOAN_MIN_BYTES, Loan, borrow_tensor, lend_tensor
from rpcdist.collectives.mailbox import Mailbox
from rpcdist.errors import DistBackendError, RpcdistError, WorkerDiedError
from rpcdist.futures import Future
from rpcdist.serialization import trust
from rpcdist.transport.shm import SlotPool

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1800.0  # torch's default process-group timeout (30 min)


class DistributedError(RpcdistError, DistBackendError):
    """A collective or point-to-point operation failed (mismatch, bad rank, timeout...); also
    torch's ``DistBackendError``."""


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A peer's message did not arrive within the process group's timeout."""


class PeerLostError(DistributedError, WorkerDiedError):
    """A peer an operation was waiting for is gone (its connection closed): raised at once,
    not at the group's timeout. Also a ``WorkerDiedError``."""


# After a peer's link is lost, its last messages may still be on their way on its own
# connection to us: receives waiting for it fail only after this long.
LOST_PEER_GRACE_SECONDS = 0.5


class ProcessGroup:
    """A set of global ranks that run collectives together (``dist.group.WORLD``,
    ``dist.new_group(...)``). ``rank()``/``size()`` are this process's view of it."""

    def __init__(self, state: _State, group_id: int, ranks: list[int], timeout: float) -> None:
        self._state = state
        self.group_id = group_id
        self.ranks = list(ranks)
        self.timeout = timeout
        self._group_rank = {g: i for i, g in enumerate(self.ranks)}
        self._sequence = 0
        self._lock = threading.Lock()

    # -- membership -------------------------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        return self._state.rank in self._group_rank

    def rank(self) -> int:
        """This process's rank in the group (-1 if not a member)."""
        return self._group_rank.get(self._state.rank, -1)

    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < len(self.ranks):
            raise DistributedError(f"rank {group_rank} is outside this group of size {len(self.ranks)}")
        return self.ranks[group_rank]

    def group_rank_of(self, global_rank: int) -> int:
        try:
            return self._group_rank[global_rank]
        except KeyError:
            raise DistributedError(f"global rank {global_rank} is not in group {self.ranks}") from None

    def require_member(self, what: str) -> None:
        if not self.is_member:
            raise DistributedError(
                f"rank {self._state.rank} called {what} on a group it is not in (group ranks {self.ranks})"
            )

    def next_sequence(self) -> int:
        """Collectives are numbered per group in call order, which must match on every rank."""
        with self._lock:
            self._sequence += 1
            return self._sequence

    # -- messages -----------------------------------------------------------------------------------
    def lends(self, to_group_rank: int, payload: Any) -> bool:
        """Whether :meth:`send` would lend ``payload`` to this member through a shared-memory
        slot (a large tensor to a co-located peer): it is copied into the slot at once, so the
        caller's tensor may change as soon as ``send`` returns."""
        return (
            isinstance(payload, torch.Tensor)
            and payload.numel() * payload.element_size() >= LOAN_MIN_BYTES
            and self._state.agent.is_colocated(self.global_rank(to_group_rank))
        )

    def send(
        self,
        to_group_rank: int,
        tag: Any,
        header: Any,
        payload: Any = None,
        lend: bool = True,
        notice: bool = False,
    ) -> Future[Any]:
        """Send ``(header, payload)`` to a member. The Future completes once the receiver has
        filed it, or, for a large tensor lent to a co-located peer (``lend``), once the
        receiving operation has used it.

        ``notice``: nobody waits for the receipt (a collective's small message, whose receiver
        answers with a message of its own anyway): it goes as a one-way notice, half the
        messages, and the Future completes once it is written to the link (not received). A
        lost peer fails the receives waiting for it instead. Not for lent tensors."""
        state = self._state
        dest = self.global_rank(to_group_rank)
        agent = state.agent
        if notice and not (lend and self.lends(to_group_rank, payload)):
            return agent.notify(
                dest,
                _deliver,
                (self.group_id, state.rank, tag, header, payload),
                function_name="rpcdist.collectives.deliver",
                track=True,
            )
        if lend and self.lends(to_group_rank, payload):
            slot, descriptor = lend_tensor(state.slots, dest, payload)
            future = agent.submit(
                dest,
                _deliver_loan,
                (self.group_id, state.rank, tag, header, descriptor),
                None,
                self.timeout,
                function_name="rpcdist.collectives.deliver",
            )
            future.add_done_callback(
                lambda _: state.loop.call_soon_threadsafe(state.slots.give_back, dest, slot)
            )
            return future
        return agent.submit(
            dest,
            _deliver,
            (self.group_id, state.rank, tag, header, payload),
            None,
            self.timeout,
            function_name="rpcdist.collectives.deliver",
        )

    async def receive(self, from_group_rank: int | None, tag: Any, what: str) -> tuple[int, Any]:
        """The next message with ``tag`` from a member (any member if None): (group rank, payload)."""
        src = None if from_group_rank is None else self.global_rank(from_group_rank)
        if src is not None:
            self._state.agent.watch(src)  # so that its death ends this wait
        try:
            sender, payload = await wait_for(
                self._state.mailbox.take((self.group_id, tag), src),
                self.timeout if self.timeout > 0 else None,
            )
        except asyncio.TimeoutError:
            who = "any rank" if src is None else f"rank {src}"
            raise CollectiveTimeoutError(
                f"{what} on rank {self._state.rank}: no message from {who} within {self.timeout:g} s"
            ) from None
        except PeerLostError as exc:
            raise PeerLostError(f"{what} on rank {self._state.rank}: {exc}") from None
        return self._group_rank.get(sender, -1), payload

    def __repr__(self) -> str:
        return f"ProcessGroup(id={self.group_id}, ranks={self.ranks})"


@dataclass
class _State:
    """What ``init_process_group`` set up in this process."""

    rank: int
    world_size: int
    backend: str
    timeout: float
    agent: Any
    loop: asyncio.AbstractEventLoop
    owns_loop: bool
    mailbox: Mailbox = field(default_factory=Mailbox)
    world: ProcessGroup | None = None
    groups: list[ProcessGroup] = field(default_factory=list)
    store: Any = None
    slots: SlotPool = field(default_factory=SlotPool)


_state: _State | None = None


def watch_peers(state: _State) -> None:
    """Fail the receives waiting for a peer as soon as its link is lost (after a short grace
    for its last messages), instead of at the group's timeout."""

    def lost(peer: Any, reason: str) -> None:
        def error() -> BaseException:
            return PeerLostError(f"rank {peer.id} is gone (its connection closed: {reason})")

        state.loop.call_later(LOST_PEER_GRACE_SECONDS, state.mailbox.sender_gone, peer.id, error)

    state.agent.on_peer_lost(lost)


def current_state() -> _State:
    if _state is None:
        raise DistributedError(
            "the default process group is not initialized: call rpcdist.init_process_group(...) first"
        )
    return _state


def set_state(state: _State | None) -> None:
    global _state
    _state = state


@trust
@inline
def _deliver(group_id: int, src: int, tag: Any, header: Any, payload: Any) -> None:
    """Runs on the receiver's loop for every message: file it for the matching receive."""
    state = _state
    if state is None:
        raise DistributedError("message for a process group that is not initialized here")
    state.mailbox.deliver((group_id, tag), src, (header, payload))


@trust
@inline
def _deliver_loan(group_id: int, src: int, tag: Any, header: Any, descriptor: tuple[Any, ...]) -> Any:
    """Like :func:`_deliver` for a tensor lent in a shared-memory slot; the reply (which frees
    the slot) goes out when the receiving operation releases it."""
    state = _state
    if state is None:
        raise DistributedError("message for a process group that is not initialized here")
    released = state.loop.create_future()
    state.mailbox.deliver((group_id, tag), src, (header, Loan(borrow_tensor(descriptor), released)))
    return released
