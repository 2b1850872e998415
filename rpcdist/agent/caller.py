"""The caller half of the agent: outgoing calls, from ``submit`` to a completed Future.

``submit`` pickles in the calling thread (errors surface there, before anything is sent),
then hands the call to the loop, which numbers it, queues its frames on the peer's link and
arms its timeout. A reply completes the call's Future with the result or the rebuilt remote
exception; a timeout fails it with RpcTimeoutError and asks the callee to cancel; the loss
of the link fails every call pending on it with WorkerUnavailableError.

A small call that a thread other than the loop's waits for at once (rpc_sync), to a peer whose
socket link is open and idle, is written by that thread itself (see ``FrameWriter.write_now``):
the loop is not woken to send it. Its timeout is then kept by a sweep on the loop (every
``SWEEP_SECONDS`` while such calls are pending, and for ``SWEEP_LINGER_SECONDS`` after the last
one was sent, so that a stream of them does not wake the loop to restart it at each call)
instead of a timer of its own, so only timeouts of at least ``DIRECT_MIN_TIMEOUT`` seconds (or
none) take this path.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rpcdist import metrics, serialization
from rpcdist._runtime import blocking_wait
from rpcdist.agent.codec import rebuild_error
from rpcdist.agent.extensions import run_undo
from rpcdist.agent.markers import is_for_context, runs_on_thread
from rpcdist.agent.options import WorkerInfo
from rpcdist.agent.threads import EmptyWaiter
from rpcdist.errors import (
    RpcError,
    RpcTimeoutError,
    SerializationError,
    WorkerDiedError,
    WorkerUnavailableError,
)
from rpcdist.futures import Future
from rpcdist.transport import Link, LinkHandler, frames, shm
from rpcdist.transport.reply_channel import ChannelClosed, ReplyChannel
from rpcdist.transport.writer import DIRECT_MAX_BYTES

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rpcdist.agent.core import Agent

SWEEP_SECONDS = 0.1
SWEEP_LINGER_SECONDS = 2.0
# Tensors in a notice travel inside the message (nothing answers, so no shared-memory slot
# could be handed back): for small ones, such as a collective's latency-bound messages.
NOTICE_MAX_BUFFER_BYTES = 1 << 20
DIRECT_MIN_TIMEOUT = 1.0
CHANNEL_REQUEST_MAX_BYTES = DIRECT_MAX_BYTES - 4096  # (its arguments; the frame adds a header)
# A callee that says it is busy gets this worker's requests on the link for this long: its loop
# reads many per wake-up and its pool threads take them one after another, where requests on
# channels would each wake a thread of their own, all contending for the interpreter.
BUSY_CALLEE_SECONDS = 0.1


class QueuedNotice:
    """A notice behind calls that wait for a place on their peer (``Caller.waiting``): sent
    when its turn comes, so that it never overtakes them (an RRef's deletion must reach its
    owner after the call that creates it)."""

    __slots__ = ("send", "written")

    def __init__(self, send: Callable[[], None], written: Callable[[bool], None] | None) -> None:
        self.send, self.written = send, written  # send(): to the link, as any notice on the loop

    def dropped(self) -> None:
        if self.written is not None:
            self.written(False)


class OutgoingCall:
    """One call in flight: what to send, and the Future that waits for its reply."""

    __slots__ = (
        "dest",
        "function",
        "payload",
        "buffers",
        "shared",
        "undo",
        "lent",
        "timeout",
        "future",
        "timer",
        "call_id",
        "sent",
        "metric",
        "deadline",
        "channel",
        "asks_value",
        "with_value",
    )

    def __init__(
        self,
        dest: WorkerInfo,
        function: str,
        payload: bytes,
        buffers: list[memoryview],
        timeout: float,
        future: Future[Any],
    ) -> None:
        self.dest = dest
        self.function = function
        self.payload = payload
        self.buffers = buffers
        self.shared: list[str] = []
        self.undo: list[Callable[[], None]] = []  # holds taken by what the arguments carry
        self.lent: list[shm.Slot] = []  # shared-memory slots holding the arguments
        self.timeout = timeout
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.call_id = 0
        self.sent = False  # on the wire (counted in the peer's in-flight calls)
        self.metric: metrics.CallTimer | None = None  # set while metrics are on
        self.deadline = 0.0  # time.monotonic() it times out at, when the sweep keeps its timeout
        self.channel: ReplyChannel | None = None  # where its waiting thread reads the answer
        # Asked once, when the call is first encoded: whether the answer should carry the value
        # the call makes (an RRef's creation, see Caller.submit); the answer is with_value.
        self.asks_value: Callable[[], bool] | None = None
        self.with_value = False


class Caller(LinkHandler):
    """Sends this worker's calls and completes their Futures as replies arrive."""

    def __init__(self, agent: Agent) -> None:
        # A weak back-reference: the agent owns this half, and an agent freed by reference
        # counting at shutdown frees its servers and channels (and grpc's poller thread) at once.
        self._agent: Agent = weakref.proxy(agent)
        self._call_ids = itertools.count(1)
        # Added to on the loop, and by threads that send their calls themselves.
        self.pending: dict[int, OutgoingCall] = {}
        # Backpressure: calls on the wire per peer rank, and the calls waiting for a free place
        # (in order) once a peer has max_inflight_calls_per_peer of them.
        self.in_flight: dict[int, int] = {}
        self.waiting: dict[int, collections.deque[OutgoingCall | QueuedNotice]] = {}
        # Guards in_flight and the sweep's state against threads sending calls themselves.
        self._lock = threading.Lock()
        self._sweeping = False  # the sweep of deadlines runs (or is about to)
        self._last_direct = 0.0  # time.monotonic() a thread last sent a call itself
        # Deferred notices (encoded entries), per peer rank: they go out ahead of the next
        # message to that peer, or with the next sweep (see notify's ``deferred``).
        self._deferred: dict[int, list[list[bytes | memoryview]]] = {}
        # Deferred notices of threads not encoded yet (see notify's ``deferred``): each sends
        # itself (into _deferred, or now) when called; see _settle_later.
        self._later: list[Callable[[], Any]] = []
        self._idle = EmptyWaiter(self.pending)  # wait_idle() waits for the calls in flight

    # ------------------------------------------------------------------ sending
    def submit(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
        timeout: float,
        *,
        function_name: str | None = None,
        waited: bool = False,
        pulled: bool = False,
        asks_value: Callable[[], bool] | None = None,
    ) -> Future[Any]:
        """Send a call from any thread; returns its Future. Raises at once on bad input.

        ``waited``: the calling thread waits for this call next (rpc_sync, to_here(), a
        backward pass), or such calls rarely come in bursts (remote()): a small one to an idle
        peer may be written right here, without waking the loop. Other calls (rpc_async,
        often many at once) go through the loop, whose writer packs many into one write: a
        burst whose first call went alone costs both sides an extra round of wake-ups.

        ``pulled`` (with ``waited``): the calling thread calls the Future's ``wait()`` next
        (or ``futures.wait_all`` with it), and nothing else waits for it: a co-located
        callee may then answer on a reply channel this thread reads itself in ``wait()``
        (see ``rpcdist.transport.reply_channel``). Never for a Future that reaches users.

        ``asks_value``: called once, when the call is encoded (on whichever thread sends it);
        True asks the callee for the function's variant that answers with the value it makes
        (``Envelope.with_value``: an RRef's creation carrying a ``to_here()`` that came first)."""
        agent = self._agent
        if agent.closing:
            raise RpcError(f"worker {agent.info.name} is shut down; call init_rpc first")
        dest = agent.worker(to)
        name = function_name or serialization.check_importable(func)
        state = agent.extension.capture() if agent.extension is not None else None
        if self._later and state is None and not is_for_context(func):  # (ahead of it: see notify)
            self._settle_later()
        call_tuple: tuple[Any, ...] = (func, tuple(args or ()), dict(kwargs or {}))
        if state is not None:  # the callee runs in the caller's extension state
            call_tuple += (state,)
        payload, buffers, undo = agent.pickle(
            call_tuple, f"call to {name} on {dest.name}", dest.id, state, outgoing=True
        )
        if timeout is None or timeout < 0:
            timeout = agent.options.rpc_timeout
        future: Future[Any] = Future(loop=agent.loop)
        call = OutgoingCall(dest, name, payload, buffers, timeout, future)
        call.undo = undo
        call.asks_value = asks_value
        call.shared = agent.transport.share(dest.id, buffers, call.lent)
        if threading.get_ident() == agent.loop_thread_id:
            if agent.inbox.pending:  # behind calls other threads submitted earlier: order holds
                agent.inbox.post(lambda: self._start(call))
            else:
                self._start(call)
        elif not (waited and self._send_from_thread(call, pulled, pulled and runs_on_thread(func))):
            agent.inbox.post(lambda: self._start(call))
        if self._later:  # (made in a context: encoded now, while this thread would wait)
            self._settle_later()
        return future

    def _send_from_thread(self, call: OutgoingCall, pulled: bool = False, plain: bool = False) -> bool:
        """Write ``call`` from this (non-loop) thread if its link is open with nothing queued,
        nothing this process submitted waits for the loop, the peer has room for it, and it is
        small; False: nothing was done. (Only calls their thread waits for next come here:
        bursts go through the loop, whose writer packs many into one write.)

        A ``pulled`` call takes a reply channel (co-located peers); one of a ``plain``
        function (which the callee runs on a thread) carrying no RRef is written on that
        channel itself, naming how many envelopes the link carried before it (see
        ``Envelope.link_envelopes``), so the callee's thread reading the channel runs it."""
        agent = self._agent
        rank = call.dest.id
        timeout = call.timeout
        if call.shared or metrics.current is not None or 0 < timeout < DIRECT_MIN_TIMEOUT:
            return False
        # Room for this call and one more: the loop may be starting one on a count it read
        # before this thread's (the callee refuses calls above the limit).
        room = agent.options.max_inflight_calls_per_peer - 1
        if self.in_flight.get(rank, 0) >= room:
            return False
        link = self._direct_link(rank)
        if link is None:
            return False
        channel = None
        if pulled and not getattr(call.undo, "ordered", False):  # (see decoded_in_order)
            channel = agent.transport.take_reply_channel(rank, agent.info.id)
        link_envelopes = None  # (sent on the channel: what the link carried before)
        if (
            plain
            and channel is not None
            and channel.takes_requests
            and channel.busy_until < time.monotonic()
            and len(call.payload) + sum(len(b) for b in call.buffers)
            <= min(CHANNEL_REQUEST_MAX_BYTES, agent.options.chunk_bytes)  # (one envelope)
        ):
            link_envelopes = link.writer.quiet_envelopes()
        call.call_id = call_id = next(self._call_ids)
        if link_envelopes is None:
            entries = list(self._encode(call, channel.id if channel is not None else 0))
        else:
            entries = list(self._encode(call, channel.id, link.token, link_envelopes))  # type: ignore[union-attr, attr-defined]
        with self._lock:
            if self.waiting.get(rank) or self.in_flight.get(rank, 0) >= room:  # (again, now it counts)
                if channel is not None:
                    agent.transport.give_back_reply_channel(channel)
                return False
            if timeout > 0:
                self._last_direct = now = time.monotonic()
                call.deadline = now + timeout
            call.sent = True
            self.pending[call_id] = call
            self.in_flight[rank] = self.in_flight.get(rank, 0) + 1
            wake_sweep = timeout > 0 and not self._sweeping
            if wake_sweep:
                self._sweeping = True
            if channel is not None:
                call.channel = channel  # (before the answer can come: the loop may see it)
            deferred = self._deferred.pop(rank, None)  # (ahead of it, in the same write)
        both = deferred + entries if deferred else entries
        if link_envelopes is not None:
            written = self._send_on_channel(channel, both, call)  # type: ignore[arg-type]
        else:
            written = link.writer.write_now(both)
        if not written:
            with self._lock:
                del self.pending[call_id]
                self.in_flight[rank] -= 1
                call.sent = False
                call.deadline = 0.0
                call.channel = None
                if deferred:
                    self._deferred[rank] = deferred + self._deferred.get(rank, [])
            if channel is not None:
                agent.transport.give_back_reply_channel(channel)
            if wake_sweep:
                agent.loop.call_soon_threadsafe(self._sweep)  # it stops itself if nothing is left
            return False
        call.payload, call.buffers = b"", []  # on the wire
        if channel is not None:
            call.future._pull = functools.partial(self._pull, call)
            call.future._interrupt = functools.partial(self._interrupt_reader, call)
        if wake_sweep:
            agent.loop.call_soon_threadsafe(self._sweep)
        return True

    @staticmethod
    def _send_on_channel(
        channel: ReplyChannel, entries: list[list[bytes | memoryview]], call: OutgoingCall
    ) -> bool:
        """Write a request on its reply channel; False (the channel closed for good) if it
        cannot be written by the call's deadline."""
        try:
            channel.send(entries, call.deadline or None)
        except OSError as exc:
            log.info("reply channel to %s failed (the call goes on the link): %s", call.dest.name, exc)
            channel.close()
            return False
        return True

    def _sweep(self) -> None:
        """Time out the calls threads sent themselves whose deadline passed; again in
        SWEEP_SECONDS while any such call is pending (loop only)."""
        now = time.monotonic()
        expired = [
            call_id
            for call_id, call in list(self.pending.items())
            if 0 < call.deadline <= now and call.timer is None
        ]
        for call_id in expired:
            self._expire(call_id)
        if self._deferred or self._later:
            self.flush_deferred()
        with self._lock:
            self._sweeping = (
                now - self._last_direct < SWEEP_LINGER_SECONDS
                or bool(self._later or self._deferred)  # (kept by a thread since the flush)
                or any(call.deadline > 0 for call in list(self.pending.values()))
            )
            if not self._sweeping:
                return
        self._agent.loop.call_later(SWEEP_SECONDS, self._sweep)

    def notify(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        function_name: str,
        track: bool = False,
        deferred: bool = False,
        plain: bool = False,
        encode_now: bool = False,
    ) -> Future[None] | None:
        """Send ``func(*args)`` to ``to`` from any thread, expecting no answer (see
        ``Agent.notify``). Raises at once on bad input; a lost link drops it silently.

        ``plain``: ``args`` hold only plain Python values (numbers, strings, tuples of them),
        which the standard pickler writes as rpcdist's would, without its set-up (a third of a
        small notice's cost on the sending thread).

        ``deferred`` (not with ``track``): from a thread other than the loop's, the notice may
        wait to go out ahead of the next message to ``to``, in the same write (within
        ``SWEEP_SECONDS`` at the latest): for a notice nobody waits for, such as a distributed
        autograd context's release, which then costs the peer no wake-up of its own. With
        ``plain``, it is not even encoded yet: that waits until the thread has sent its next
        call made inside a context (the next training step's first) or for one (marked
        ``for_context``: a backward pass), and so goes out with the call after, or ahead of
        its next other call, or any notice, or with the sweep; the thread that leaves a context
        does not pay for it (see ``_settle_later``). ``encode_now``: that delay is over.

        ``track``: return a Future that completes once the notice has been handed to the link's
        carrier (so a process may exit without losing it), or fails with WorkerUnavailableError
        once it never will be."""
        agent = self._agent
        if agent.closing:
            raise RpcError(f"worker {agent.info.name} is shut down; call init_rpc first")
        dest = agent.worker(to)
        on_loop = threading.get_ident() == agent.loop_thread_id
        if deferred and plain and not track and not on_loop and not encode_now:
            send = functools.partial(
                self.notify, dest.id, func, tuple(args), function_name, deferred=True, plain=True,
                encode_now=True,
            )
            self._keep_for_sweep(lambda: self._later.append(send))
            return None
        if self._later and not encode_now:  # (in order: the notices deferred before go first)
            self._settle_later()
        if plain:
            payload, buffers = pickle.dumps((func, tuple(args), {}), protocol=5), []
        else:
            payload, buffers, _ = agent.pickle(
                (func, tuple(args), {}), f"notice {function_name} to {dest.name}", dest.id, outgoing=True
            )
        carried = sum(len(b) for b in buffers)
        if carried > NOTICE_MAX_BUFFER_BYTES:
            raise ValueError(
                f"a notice carries at most {NOTICE_MAX_BUFFER_BYTES} bytes of tensors and arrays, "
                f"not {carried} ({function_name} to {dest.name})"
            )
        # Copied now: the notice carries the values of this moment, whenever the link writes
        # it, and nothing comes back to say when the sender's memory would be free again.
        buffers = [memoryview(bytes(b)) for b in buffers]

        sent: Future[None] | None = Future() if track else None

        def written(ok: bool) -> None:
            if ok:
                sent.set_result(None)
            else:
                sent.set_exception(
                    WorkerUnavailableError(f"notice {function_name} to {dest.name} was not sent: link closed")
                )

        def encode() -> Any:
            return frames.encode_message(
                next(self._call_ids),
                frames.NOTIFY,
                payload,
                buffers,  # (in the message itself: nothing comes back to free a slot)
                chunk_bytes=agent.options.chunk_bytes,
                function=function_name,
                caller_rank=agent.info.id,
            )

        def send() -> None:  # on the loop
            try:
                link = agent.transport.link(dest.id)
            except Exception as exc:  # noqa: BLE001 - a gone peer needs no notice
                log.debug("notice %s to %s dropped: %s", function_name, dest.name, exc)
                if sent is not None:
                    sent.set_exception(WorkerUnavailableError(f"notice {function_name}, {dest.name}: {exc}"))
                return
            if self._deferred:
                self._flush_deferred(link)
            link.send(encode(), None if sent is None else written)

        def start() -> None:
            if agent.closing:
                if sent is not None:
                    sent.set_exception(RpcError(f"{agent.info.name} shut down before notice {function_name}"))
                return
            queue = self.waiting.get(dest.id)
            if queue:  # calls wait for a place on that peer: after them, in order
                queue.append(QueuedNotice(send, None if sent is None else written))
                return
            send()

        if on_loop:
            if agent.inbox.pending:  # after the calls other threads submitted before it
                agent.inbox.post(start)
            else:
                start()
        elif deferred and sent is None and not carried and self._defer(dest.id, encode):
            pass
        elif carried + len(payload) > DIRECT_MAX_BYTES or not self._notify_from_thread(dest.id, encode):
            agent.inbox.post(start)  # after the calls this thread submitted before it
        elif sent is not None:
            sent.set_result(None)
        return sent

    def _notify_from_thread(self, rank: int, encode: Callable[[], Any]) -> bool:
        """Write a notice from this (non-loop) thread if its link is open and nothing is queued
        on it or waits for the loop (as :meth:`_send_from_thread`); False: nothing was done.
        Else the loop would be woken for it, and a call this thread makes next (the next
        step's ``rpc_sync`` after a context's release) would find the inbox busy and have to
        go through the loop too."""
        link = self._direct_link(rank)
        if link is None:
            return False
        entries = list(encode())
        with self._lock:
            deferred = self._deferred.pop(rank, None)
        if link.writer.write_now(deferred + entries if deferred else entries):
            return True
        if deferred:
            with self._lock:
                self._deferred[rank] = deferred + self._deferred.get(rank, [])
        return False

    def _defer(self, rank: int, encode: Callable[[], Any]) -> bool:
        """Keep a notice for ``rank`` to go out ahead of the next message to it (or with the
        next sweep, within ``SWEEP_SECONDS``), if nothing this process sends it could be
        overtaken meanwhile (as :meth:`_direct_link`); False: nothing was done."""
        if self._direct_link(rank) is None:
            return False
        entries = list(encode())
        self._keep_for_sweep(lambda: self._deferred.setdefault(rank, []).extend(entries))
        return True

    def _keep_for_sweep(self, keep: Callable[[], Any]) -> None:
        """Run ``keep`` (it stores a notice the sweep sends if nothing takes it first) under the
        lock, and start the sweep if it is not running."""
        with self._lock:
            keep()
            wake_sweep = not self._sweeping
            self._sweeping = True
        if wake_sweep:
            self._agent.loop.call_soon_threadsafe(self._sweep)

    def _settle_later(self) -> None:
        """Encode the deferred notices threads kept for later (any thread): into ``_deferred``,
        or sent now when that cannot be (as ``notify`` does)."""
        with self._lock:
            later, self._later = self._later, []
        for send in later:
            try:
                send()
            except Exception as exc:  # noqa: BLE001 - a gone worker needs no notice
                log.debug("deferred notice dropped: %s", exc)

    def _flush_deferred(self, link: Link) -> None:
        """Send the notices deferred for ``link``'s peer now, ahead of anything after (loop)."""
        with self._lock:
            deferred = self._deferred.pop(link.peer.rank, None)
        if deferred:
            link.send(iter(deferred))

    def flush_deferred(self) -> None:
        """Send every deferred notice now (loop): each sweep, and before the links close."""
        if self._later:
            self._settle_later()
        with self._lock:
            ranks = list(self._deferred)
        for rank in ranks:
            link = self._agent.transport.existing_link(rank)
            if link is not None:
                self._flush_deferred(link)
            else:  # no link left to that peer: it is gone, with what these were about
                with self._lock:
                    self._deferred.pop(rank, None)

    def _direct_link(self, rank: int) -> Link | None:
        """The open link to ``rank`` if a (non-loop) thread may write to it now: nothing this
        process posted that sends, and no call waiting for a place on that peer, could be
        overtaken; else None."""
        agent = self._agent
        if agent.closing or agent.inbox.sending or self.waiting.get(rank):
            return None
        link = agent.transport.existing_link(rank)
        return link if link is not None and link.writer.direct is not None else None

    def _start(self, call: OutgoingCall) -> None:
        agent = self._agent
        if agent.closing:
            self._abandon(call, RpcError(f"worker {agent.info.name} is shutting down"))
            return
        call.call_id = call_id = next(self._call_ids)
        rank = call.dest.id
        if self.in_flight.get(rank, 0) >= agent.options.max_inflight_calls_per_peer:
            # Wait for a reply from that peer; the timeout already runs.
            self.pending[call_id] = call
            self.waiting.setdefault(rank, collections.deque()).append(call)
            if call.timeout > 0:
                call.timer = agent.loop.call_later(call.timeout, self._expire, call_id)
            return
        try:
            link = agent.transport.link(rank)
        except Exception as exc:
            self._abandon(call, WorkerUnavailableError(f"cannot reach {call.dest.name}: {exc}"))
            return
        self.pending[call_id] = call
        if metrics.current is not None and call.metric is None:
            call.metric = metrics.current.call_started(call.function, call.dest.name)
        if call.timeout > 0 and call.timer is None:
            call.timer = agent.loop.call_later(call.timeout, self._expire, call_id)
        self._send(link, call)

    def _encode(
        self, call: OutgoingCall, reply_channel: int = 0, link_token: int = 0, link_envelopes: int = 0
    ) -> Any:
        agent = self._agent
        if call.asks_value is not None:  # (decided at the first encoding, kept if sent again)
            call.with_value = call.asks_value()
            call.asks_value = None
        return frames.encode_message(
            call.call_id,
            frames.REQUEST,
            call.payload,
            call.buffers,
            chunk_bytes=agent.options.chunk_bytes,
            timeout_seconds=call.timeout,
            function=call.function,
            caller_rank=agent.info.id,
            shared=call.shared,
            reply_channel=reply_channel,
            link_token=link_token,
            link_envelopes=link_envelopes,
            with_value=call.with_value,
        )

    def _send(self, link: Link, call: OutgoingCall) -> None:
        call.sent = True
        with self._lock:
            self.in_flight[call.dest.id] = self.in_flight.get(call.dest.id, 0) + 1
        if self._deferred:
            self._flush_deferred(link)
        link.send(self._encode(call))
        call.payload, call.buffers = b"", []  # the writer holds them now

    def _ended(self, call: OutgoingCall) -> None:
        """``call`` left ``pending``: free its place and send the peer's next waiting call."""
        if not call.sent:
            return
        rank = call.dest.id
        self._free_place(rank)
        self._send_waiting(rank)

    def _free_place(self, rank: int) -> None:
        with self._lock:
            count = self.in_flight.get(rank, 1) - 1
            if count > 0:
                self.in_flight[rank] = count
            else:
                self.in_flight.pop(rank, None)

    def _send_waiting(self, rank: int) -> None:
        """Send the calls (and notices) waiting for a place on ``rank``, as places allow (loop)."""
        queue = self.waiting.get(rank)
        if not queue or self._agent.closing:
            return
        limit = self._agent.options.max_inflight_calls_per_peer
        while queue and self.in_flight.get(rank, 0) < limit:
            queued = queue.popleft()
            if type(queued) is QueuedNotice:
                queued.send()
                continue
            if self.pending.get(queued.call_id) is not queued:
                continue  # timed out or failed while waiting
            try:
                link = self._agent.transport.link(rank)
            except Exception as exc:  # noqa: BLE001 - the peer went away meanwhile
                self.pending.pop(queued.call_id, None)
                if queued.timer is not None:
                    queued.timer.cancel()
                self._abandon(queued, WorkerUnavailableError(f"cannot reach {queued.dest.name}: {exc}"))
                continue
            self._send(link, queued)
        while queue and type(queue[0]) is QueuedNotice:  # (no place needed: not calls)
            queue.popleft().send()
        if not queue:
            self.waiting.pop(rank, None)
        self._idle.wake_if_empty()

    async def wait_idle(self) -> None:
        """Return once no call is pending (loop only)."""
        await self._idle.wait()

    def _abandon(self, call: OutgoingCall, error: BaseException) -> None:
        """The call never left: give back what it took and fail it."""
        self._drop_shared(call)
        run_undo(call.undo)
        call.future._try_complete(None, error)

    # ------------------------------------------------------------------ ending calls
    def _expire(self, call_id: int) -> None:
        call = self.pending.get(call_id)
        if call is None:
            return
        self.fail(
            call_id,
            RpcTimeoutError(
                f"call to {call.function} on worker {call.dest.name} timed out after {call.timeout:g} s "
                "(the callee was asked to cancel it)"
            ),
        )
        link = self._agent.transport.existing_link(call.dest.id)
        if link is not None and call.sent:
            link.send(iter([frames.encode_control(call_id, frames.CANCEL)]))

    def fail(self, call_id: int, error: BaseException) -> None:
        """Complete pending call ``call_id`` with ``error`` (no-op if it already ended)."""
        call = self.pending.pop(call_id, None)
        if call is None:
            return
        if call.channel is not None:
            self._interrupt_reader(call)  # its thread reads no more: the call has failed
        self._drop_shared(call)
        if call.timer is not None:
            call.timer.cancel()
        if not call.sent:
            run_undo(call.undo)  # it never left: give back what it carried
            call.undo, call.payload, call.buffers = [], b"", []
        self._ended(call)
        self._idle.wake_if_empty()
        if call.metric is not None:
            call.metric.failed(error)
        call.future._try_complete(None, error)

    def fail_all(self, error: Callable[[OutgoingCall], BaseException]) -> None:
        """Fail every pending call (at shutdown)."""
        for call_id, call in list(self.pending.items()):
            self.fail(call_id, error(call))

    def _drop_shared(self, call: OutgoingCall) -> None:
        """The call failed: its lent slots are never reused (the callee may still be reading
        them). Given ones come back when the callee is done with them, as ever."""
        self._agent.transport.drop_lent(call.lent)

    # ------------------------------------------------------------------ LinkHandler
    def on_frame(self, link: Link, raw: bytes) -> None:
        """Replies from the peer of ``link``."""
        agent = self._agent
        slots_read = link.slots_read
        if slots_read is None:  # tells the callee when we are done with its results' slots
            slots_read = link.slots_read = frames.SlotsReadNotices(agent.loop, link.writer)
        for env in frames.decode_frame(raw):
            if env.kind == frames.SLOTS_READ:  # the callee is done with our arguments' slots
                agent.transport.slots_read(link.peer.rank, frames.slots_read_names(env))
                continue
            message = frames.collect(link.assemblies, env, agent.options.max_payload_bytes, slots_read)
            if message is None:
                continue
            header, buffers = message
            call = self.pending.pop(header.call_id, None)
            if call is None:
                continue  # timed out or cancelled meanwhile
            if call.channel is not None:
                self._interrupt_reader(call)  # answered here: its thread reads no more
            if call.lent:
                agent.transport.finished_reading(call.dest.id, call.lent)  # the callee read them
            if call.timer is not None:
                call.timer.cancel()
            self._ended(call)
            self._idle.wake_if_empty()
            self._settle(call, header, buffers)

    def _settle(self, call: OutgoingCall, header: Any, buffers: list[memoryview] | Exception) -> None:
        """Complete ``call`` (no longer pending) with its answer."""
        agent = self._agent
        if isinstance(buffers, Exception):
            self._complete(call, None, RpcError(f"cannot receive the result of {call.function}: {buffers}"))
        elif header.kind == frames.RESPONSE:
            try:
                result = agent.decode(header.payload, buffers)
            except Exception as exc:
                self._complete(
                    call, None, SerializationError(f"cannot unpickle the result of {call.function}: {exc}")
                )
                return
            self._complete(call, result, None)
        else:
            error = rebuild_error(header.payload, buffers, call.function, call.dest.name, agent.decode)
            self._complete(call, None, error)

    def _pull(self, call: OutgoingCall, timeout: float | None) -> None:
        """In ``Future.wait()`` of a call answered on its reply channel: read the answer on
        this thread and complete the call (no loop, no second wake-up). Returns early, the
        call still pending, if ``timeout`` (seconds) or the call's deadline passes first: the
        wait and the call's own timeout carry on as for any call. If the call ends another
        way meanwhile (failed, timed out, its peer lost), the channel is interrupted."""
        channel = call.channel
        if channel is None:  # the call ended already (and the loop interrupted the channel)
            return
        agent = self._agent
        deadline = call.deadline or None
        if timeout is not None:
            deadline = min(deadline or float("inf"), time.monotonic() + max(timeout, 0.0))
        max_bytes = agent.options.max_payload_bytes
        try:
            with blocking_wait():  # (a worker-pool thread lends its running place meanwhile)
                while True:
                    raw = channel.read_frame(deadline)
                    if raw is None:
                        channel.close()  # its answer may still come there: never reused
                        return
                    if not raw:
                        continue
                    for env in frames.decode_frame(raw):
                        if env.kind == frames.REPLY_CHANNEL:
                            if env.call_id == call.call_id:  # answered on the link instead
                                self._diverted(call)
                                return
                            if env.call_id == 0:  # the callee is busy: requests go on the link
                                channel.busy_until = time.monotonic() + BUSY_CALLEE_SECONDS
                            continue
                        message = frames.collect(channel.assemblies, env, max_bytes, self._slots_read(call))
                        if message is not None and message[0].call_id == call.call_id:
                            mine = self._answered(call, *message)
                            if mine is not None:
                                agent.transport.give_back_reply_channel(mine)
                            return
        except (ChannelClosed, frames.FrameError) as exc:
            channel.close()
            if call.future.done():  # ended another way, which interrupted the channel
                return
            error = WorkerDiedError(
                f"worker {call.dest.name} is gone: lost the connection while awaiting its answer to "
                f"{call.function} ({exc})"
            )
            agent.on_loop(lambda: self.fail(call.call_id, error), sends=False)

    def _diverted(self, call: OutgoingCall) -> None:
        """The callee answers ``call`` on the link (the answer carries an RRef, which the loop
        must decode in order): the channel goes back; the loop completes the call."""
        channel = self._claim_channel(call)
        if channel is not None:  # (else the loop ended the call and interrupted the channel)
            self._agent.transport.give_back_reply_channel(channel)

    def _claim_channel(self, call: OutgoingCall) -> ReplyChannel | None:
        """Take ``call``'s channel off it (any thread): whoever gets it decides its fate, so the
        loop never interrupts a channel its reader has given back."""
        with self._lock:
            channel, call.channel = call.channel, None
        return channel

    def _slots_read(self, call: OutgoingCall) -> Any:
        """Tells the callee of ``call`` when we are done with its results' slots (on the link)."""
        link = self._agent.transport.existing_link(call.dest.id)
        if link is None:
            return None
        slots_read = link.slots_read
        if slots_read is None:
            slots_read = link.slots_read = frames.SlotsReadNotices(self._agent.loop, link.writer)
        return slots_read

    def _answered(
        self, call: OutgoingCall, header: Any, buffers: list[memoryview] | Exception
    ) -> ReplyChannel | None:
        """``call``'s answer, read by its waiting thread: complete it as ``on_frame`` does.
        Returns its channel to give back (None if the call had ended another way)."""
        if self.pending.pop(call.call_id, None) is None:
            return None  # failed or timed out meanwhile
        channel = self._claim_channel(call)  # (completing the future must not interrupt it)
        self._free_place(call.dest.id)
        if self.waiting.get(call.dest.id):
            self._agent.on_loop(lambda: self._send_waiting(call.dest.id))
        self._idle.wake_if_empty()
        self._settle(call, header, buffers)
        return channel

    def _interrupt_reader(self, call: OutgoingCall) -> None:
        """``call``'s Future was completed another way (a failure, a timeout, a lost peer, or
        whoever else completes it): the thread reading its channel reads no more, and a call
        still pending (its Future completed by someone else) is ended: its answer would come to
        a closed channel."""
        channel = self._claim_channel(call)
        if channel is None:
            return
        channel.interrupt()
        if call.call_id in self.pending:
            error = RpcError(f"call to {call.function} ended by its Future's completion elsewhere")
            self._agent.on_loop(lambda: self.fail(call.call_id, error), sends=False)

    @staticmethod
    def _complete(call: OutgoingCall, result: Any, error: BaseException | None) -> None:
        if call.metric is not None:
            if error is None:
                call.metric.finished()
            else:
                call.metric.failed(error)
        call.future._try_complete(result, error)

    def on_lost(self, link: Link, reason: str) -> None:
        """The link to a peer is gone: every call pending on it fails now, and whoever
        watches the peer (see ``Agent.on_peer_lost``) hears of it."""
        rank = link.peer.rank
        self._agent.peer_lost(rank, reason)
        for queued in self.waiting.pop(rank, ()):  # its waiting calls fail below, never sent
            if type(queued) is QueuedNotice:
                queued.dropped()
        for call_id, call in list(self.pending.items()):
            if call.dest.id == rank:
                run_undo(call.undo)  # the receiver is gone with them
                call.undo = []
                self.fail(
                    call_id,
                    WorkerDiedError(
                        f"worker {link.peer.name} is gone: lost the connection ({link.address}) while "
                        f"calling {call.function}: {reason}"
                    ),
                )
