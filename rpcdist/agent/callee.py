"""The callee half of the agent: running the calls that peers send, and answering them.

Each incoming connection is an :class:`InboundSession`. A request is unpickled on the loop
and dispatched by the way its function runs (see :mod:`rpcdist.agent.markers`): rpcdist's
inline handlers at once, ``async def`` functions as tasks on the loop, blocking ones on the
:class:`~rpcdist.agent.threads.WorkerPool`. Timeouts travel with the request: an expired
async call's task is cancelled, an expired queued blocking call is skipped, and a CANCEL from
the caller does the same. Results (or error descriptions) go back on the same connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rpcdist import metrics
from rpcdist.agent.codec import describe_error
from rpcdist.agent.extensions import CollectingUnconfirmed, Unconfirmed, confirmation_gate
from rpcdist.agent.markers import (
    RunAsCall,
    ValueAnswer,
    ValueNotSent,
    is_async_execution,
    is_for_context,
    is_inline,
    is_prompt,
    runs_anywhere,
    runs_as_coroutine,
    runs_on_thread,
    with_value_variant,
)
from rpcdist.agent.threads import EmptyWaiter, settle
from rpcdist.errors import RpcError, RpcTimeoutError, SerializationError
from rpcdist.futures import Future
from rpcdist.transport import Entries, frames
from rpcdist.transport.writer import FrameWriter

if TYPE_CHECKING:
    from rpcdist.agent.core import Agent

log = logging.getLogger(__name__)

EncodedAnswer = list[list[bytes | memoryview]]  # a message's envelopes, each a list of pieces

ANSWERS_PER_THREAD_WRITE = 4
"""Answers made on pool threads while other calls of the same caller run: once this many wait
for the loop to write them, the thread that made the last one writes them all itself (see
:meth:`InboundSession.answer_from_thread`)."""


class InboundSession:
    """The callee's end of one caller's connection (a gRPC stream or a Unix socket)."""

    def __init__(self, callee: Callee, writer: FrameWriter) -> None:
        self.callee = callee
        self.writer = writer
        self.assemblies: dict[int, frames.Assembly] = {}
        # call_id -> asyncio.Task, asyncio.Future or _ThreadJob. Added to on the loop; a pool
        # thread that answered its call itself removes it (see untrack).
        self.running: dict[int, Any] = {}
        self._idle = EmptyWaiter(self.running)  # finish() waits for the running calls
        self.caller_rank = -1
        self.peer_name = ""  # the caller's name, once its first request has told its rank
        self.traffic: metrics.Traffic | None = None  # its byte counters, while metrics are on
        self.arrivals: dict[int, float] = {}  # call_id -> arrival time, while metrics are on
        # Tells the caller when we are done with the slots it gave us (large arguments).
        self._slots_read = frames.SlotsReadNotices(callee.agent.loop, writer)
        # The envelopes handled so far, and the link's token (its LINK_OPENING: a Unix-socket
        # link's): requests on the caller's reply channels wait for a count of them.
        self.envelopes = 0
        self.link_token = 0
        # Answers pool threads made while other calls of this caller ran, not written yet:
        # (call_id, function, encoded entries).
        self._answers: list[tuple[int, str, EncodedAnswer]] = []
        self._answers_lock = threading.Lock()
        # Calls whose answers a thread is writing this moment (still in ``running``): the
        # caller may have them already and send its next call before they are untracked.
        self._being_answered = 0
        callee.sessions.add(self)

    def on_frame(self, raw: bytes) -> None:
        """Handle one incoming frame; raises FrameError if it is malformed."""
        callee = self.callee
        max_bytes = callee.agent.options.max_payload_bytes
        for env in frames.decode_frame(raw):
            if env.kind == frames.SLOTS_READ:  # the caller is done with our results' slots
                callee.agent.transport.slots_read(self.caller_rank, frames.slots_read_names(env))
            elif env.kind == frames.LINK_OPENING:
                callee.link_opened(self, env.call_id)
            else:
                message = frames.collect(self.assemblies, env, max_bytes, self._slots_read)
                if message is not None:
                    callee.on_request(self, *message)
            self.envelopes += 1
        if callee.order_waiters:
            callee.link_moved()
        if self.traffic is not None:
            self.traffic.received += len(raw)

    def identify(self, caller_rank: int) -> None:
        """The caller of this connection is ``caller_rank`` (told by each request)."""
        self.caller_rank = caller_rank
        peer = self.callee.agent.workers_by_rank.get(caller_rank)
        self.peer_name = peer.name if peer is not None else f"rank{caller_rank}"
        if metrics.current is not None:
            self.traffic = self.writer.traffic = metrics.current.traffic(self.peer_name)

    async def finish(self) -> None:
        """The caller is done sending: finish its calls, then flush the replies."""
        await self._idle.wait()
        await self.writer.close()

    def cleanup(self) -> None:
        if self.link_token:
            self.callee.link_closed(self)
        for job in list(self.running.values()):
            job.cancel()
        self.writer.abort()
        if self.caller_rank >= 0:  # what the caller still holds of ours is never reused
            self.callee.agent.transport.slots.drop_given(self.caller_rank)
        self.arrivals.clear()
        self.callee.sessions.discard(self)

    def respond(self, entries: Entries) -> None:
        self.writer.send(entries)

    def track(self, call_id: int, job: Any) -> None:
        self.running[call_id] = job

    def untrack(self, call_id: int) -> None:
        """The call ended (any thread)."""
        self.running.pop(call_id, None)
        self._idle.wake_if_empty()

    def calls_running(self) -> int:
        """How many calls of this caller run here, as the caller counts them: an answer a
        thread is writing this moment no longer counts (the caller may have it already)."""
        return len(self.running) - self._being_answered

    def write_answers_now(self, call_ids: list[int], entries: EncodedAnswer) -> bool:
        """Write answers from this thread (any but the loop's) if the link takes them at once,
        and untrack their calls; False (nothing written, the calls still running) if not."""
        return self.write_answers_with(self.writer, call_ids, entries)

    def write_answers_with(self, writer: FrameWriter, call_ids: list[int], entries: EncodedAnswer) -> bool:
        """:meth:`write_answers_now` on ``writer`` (a reply channel's, for its calls)."""
        # Untracked only after the write (the session's end waits for its running calls, then
        # closes the writer), yet not counted against the caller's limit meanwhile: its next
        # call may arrive before this thread untracks (see calls_running).
        if writer.direct is None:  # (a link only the loop writes, gRPC's: no locks for nothing)
            return False
        with self._answers_lock:
            self._being_answered += len(call_ids)
        try:
            written = writer.write_now(entries)
            if written:
                for call_id in call_ids:
                    self.untrack(call_id)
        finally:
            with self._answers_lock:
                self._being_answered -= len(call_ids)
        return written

    def answer_from_thread(self, call_id: int, function: str, entries: EncodedAnswer) -> None:
        """Answer a call with its encoded ``entries`` from a pool thread while other calls of
        this caller run here (any thread but the loop's).

        The answer waits for the loop, which writes every answer waiting by then in one write
        after its turn, unless it is the ``ANSWERS_PER_THREAD_WRITE``-th waiting: this thread
        then writes them all itself, if the link takes them at once. Why not always the loop: a
        pool thread that goes from one queued call to the next keeps the interpreter lock, so
        the loop would write nothing before the whole burst had run, and the caller, which
        gets every answer at once, would send its next burst only then (both workers idle
        half the time, in turn). Why not always the thread: a write per answer costs both
        workers a system call and a wake-up each, which a busy pair of workers feels. A link
        only the loop may write (gRPC's stream) leaves every answer to the loop."""
        batch = None
        thread_writes = self.writer.direct is not None
        with self._answers_lock:
            self._answers.append((call_id, function, entries))
            waiting = len(self._answers)
            if waiting >= ANSWERS_PER_THREAD_WRITE and thread_writes:
                batch, self._answers = self._answers, []
        if batch is not None:
            answered = [call_id for call_id, _, _ in batch]
            if self.write_answers_now(answered, [entry for _, _, answer in batch for entry in answer]):
                if self.arrivals:  # metrics are on: counted on the loop
                    self.callee.agent.inbox.post(lambda: self._served_all(batch), sends=False)
                return
            with self._answers_lock:  # (the link is busy: the loop writes them)
                self._answers[:0] = batch
        if waiting == 1 or batch is not None:
            self.callee.agent.inbox.post(self._write_answers, sends=False)

    def _write_answers(self) -> None:
        """Queue every answer made on a thread that waits (loop only): they go out in one
        write after this turn of the loop."""
        with self._answers_lock:
            batch, self._answers = self._answers, []
        for call_id, function, entries in batch:
            self.callee._finish(self, call_id, function, iter(entries))

    def _served_all(self, batch: list[tuple[int, str, EncodedAnswer]]) -> None:
        for call_id, function, _ in batch:
            self.callee._served(self, call_id, function, True)


class _AnsweredOnChannel:
    """A session as seen by one call whose caller named a reply channel: answers go to the
    channel's writer (see ``rpcdist.transport.reply_channel``); the rest is the session's."""

    __slots__ = ("_session", "writer")

    def __init__(self, session: InboundSession, writer: FrameWriter) -> None:
        self._session = session
        self.writer = writer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def respond(self, entries: Entries) -> None:
        self.writer.send(entries)

    def write_answers_now(self, call_ids: list[int], entries: EncodedAnswer) -> bool:
        return self._session.write_answers_with(self.writer, call_ids, entries)

    def divert(self, call_id: int) -> None:
        """Answer on the caller's link after all (the answer carries an RRef, which the caller
        must decode on its loop, in order: see ``extensions.decoded_in_order``), and tell the
        thread reading the channel to wait for it there (any thread)."""
        channel, self.writer = self.writer, self._session.writer
        marker = [frames.encode_control(call_id, frames.REPLY_CHANNEL)]
        if not channel.write_now(marker):
            self._session.callee.agent.on_loop(lambda: channel.send(iter(marker)), sends=False)


class ChannelCalls:
    """The callee's end of a reply channel that a co-located caller also sends requests on
    (calls of plain functions carrying no RRef, from a thread that waits for them next: see
    ``rpcdist.transport.reply_channel``).

    The channel's own thread hands each request here; once the caller's link has delivered
    everything the caller sent before it, the thread runs the call itself, when the worker
    pool has a running place free, and writes the answer back: the loop never wakes, and no
    pool thread is handed the call. Otherwise the call goes the usual way (the pool's queue;
    the loop, while metrics are on or the group is not known yet), still answered on the
    channel."""

    __slots__ = ("callee", "writer", "caller_rank", "assemblies")

    def __init__(self, callee: Callee, writer: FrameWriter, caller_rank: int) -> None:
        self.callee = callee
        self.writer = writer
        self.caller_rank = caller_rank
        self.assemblies: dict[int, frames.Assembly] = {}

    def on_frame(self, raw: bytes | memoryview) -> None:
        """One frame from the caller (on the channel's thread): a request in one envelope,
        after the notices its caller deferred (see ``Caller.notify``)."""
        try:
            max_bytes = self.callee.agent.options.max_payload_bytes
        except ReferenceError:  # the agent is gone: so is every answer
            raise frames.FrameError("the worker shut down") from None
        envelopes = frames.decode_frame(raw)
        request = envelopes[-1] if envelopes else None
        if (
            request is None
            or request.kind != frames.REQUEST
            or request.caller_rank != self.caller_rank
            or not request.link_token
            or any(env.kind != frames.NOTIFY or env.shared_buffers for env in envelopes[:-1])
            or request.shared_buffers
        ):
            raise frames.FrameError("a reply channel carries one plain request at a time, after notices")
        callee = self.callee
        timeout = request.timeout_seconds
        session = callee.wait_for_link(
            request.link_token, request.link_envelopes, time.monotonic() + timeout if timeout > 0 else None
        )
        if session is None:  # its link ended, or the call timed out: nobody waits for it
            return
        notices = []
        for env in envelopes:
            message = frames.collect(self.assemblies, env, max_bytes)
            if message is None:
                raise frames.FrameError("a message on a reply channel comes whole, in one envelope")
            if env.kind == frames.NOTIFY:
                notices.append(message)
            else:
                self._request(session, *message, notices=notices)

    def _request(
        self,
        session: InboundSession,
        header: Any,
        buffers: list[memoryview] | Exception,
        notices: list[tuple[Any, Any]],
    ) -> None:
        """``notices``: those its caller deferred (contexts' releases), sent ahead of it. They
        run before it, but after its answer when it runs here in its caller's extension state
        (made inside a distributed autograd context) or is marked ``for_context`` (a backward
        pass): a training step's calls then do not wait for the release of the step before
        (nor for its graph to be freed), which nothing they do can depend on; a call made
        outside any context still finds the release done."""
        callee = self.callee
        agent = callee.agent
        timeout = header.timeout_seconds
        if callee.early or metrics.current is not None or isinstance(buffers, Exception) or agent.closing:
            self._notices(session, notices)
            agent.on_loop(lambda: callee.on_request(session, header, buffers), sends=False)
            return
        if header.caller_rank != session.caller_rank:
            session.identify(header.caller_rank)  # (metrics are off: names only)
        answering = _AnsweredOnChannel(session, self.writer)
        call_id, function = header.call_id, header.function
        try:
            func, args, kwargs, state, unconfirmed = _decode_request(agent, header, buffers)
        except Exception as exc:  # noqa: BLE001 - answered (from the loop, as every error)
            self._notices(session, notices)
            error = _loading_error(exc)
            agent.on_loop(
                lambda: callee._respond_error(answering, call_id, function, error, loading=True), sends=False
            )
            return
        if unconfirmed or not runs_on_thread(func):  # (not sent here by rpcdist's callers)
            self._notices(session, notices)
            agent.on_loop(
                lambda: callee.decoded(answering, header, func, args, kwargs, state, unconfirmed),  # type: ignore[arg-type]
                sends=False,
            )
            return
        if not (state or is_for_context(func)):  # (a call outside any context finds them done)
            self._notices(session, notices)
            notices = []
        run_in = None
        if state and agent.extension is not None:  # run (and pickle the result) in the caller's state
            run_in = contextvars.copy_context()
            run_in.run(agent.extension.enter, state[0])
        run = functools.partial(self._run_here, answering, header, func, args, kwargs, run_in)
        if is_prompt(func):  # rpcdist's own, answered at once: no place in the pool needed
            run()
            self._notices(session, notices)
            return
        pool = agent.pool
        if not pool.enter():  # as many calls run as the pool allows: queued there
            self._notices(session, notices)
            # and the caller is told to send its next requests on its link for a while (see
            # caller.BUSY_CALLEE_SECONDS): under load, the loop and the pool serve them better.
            busy = [frames.encode_control(0, frames.REPLY_CHANNEL)]
            if not self.writer.write_now(busy):
                agent.on_loop(lambda: self.writer.send(iter(busy)), sends=False)
            callee._queue_blocking(answering, call_id, function, func, args, kwargs, run_in, timeout)  # type: ignore[arg-type]
            return
        try:
            run()
        finally:
            pool.leave()
        self._notices(session, notices)

    def _notices(self, session: InboundSession, notices: list[tuple[Any, Any]]) -> None:
        for header, buffers in notices:
            self.callee.on_notice_here(session, header, buffers)

    def _run_here(
        self,
        answering: _AnsweredOnChannel,
        header: Any,
        func: Any,
        args: Any,
        kwargs: Any,
        run_in: contextvars.Context | None,
    ) -> None:
        """Run the request on this thread (in the caller's state, if any) and answer it."""
        timeout, call_id = header.timeout_seconds, header.call_id
        deadline = time.monotonic() + timeout if timeout > 0 else None
        job = _ThreadJob()
        answering.track(call_id, job)  # (counted as running; answering untracks it)
        run = functools.partial(
            self.callee._run_blocking, answering, call_id, header.function, func, args, kwargs, job, deadline
        )
        if run_in is None:
            run()
        else:
            run_in.run(run)

    def cleanup(self) -> None:
        self.assemblies.clear()


class _ThreadJob:
    """A blocking user function queued on the worker pool; skipped if cancelled before start."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _AwaitedAnswer:
    """A call whose function has run and whose answer waits for the Future it returned;
    cancelled (by its caller, or the session's end), it is no longer waited for."""

    __slots__ = ("cancelled", "_session", "_call_id")

    def __init__(self, session: InboundSession, call_id: int) -> None:
        self.cancelled = False
        self._session = session
        self._call_id = call_id

    def cancel(self) -> None:  # (loop)
        self.cancelled = True
        self._session.arrivals.pop(self._call_id, None)
        self._session.untrack(self._call_id)


class Callee:
    """Runs the calls that arrive on this worker's incoming connections."""

    def __init__(self, agent: Agent) -> None:
        self.agent: Agent = weakref.proxy(agent)  # the agent owns this half (see Caller)
        self.sessions: set[InboundSession] = set()
        # Requests that arrive before the group is known (None once it is).
        self._early: list[tuple[InboundSession, Any, Any]] | None = []
        # Unix-socket links by token (see InboundSession.link_token), those that ended, and the
        # reply channels' threads waiting for a link to have handled enough envelopes.
        self.links: dict[int, InboundSession] = {}
        self._ended_links: set[int] = set()
        self._order = threading.Condition()
        self.order_waiters = 0

    def new_session(self, writer: FrameWriter) -> InboundSession:
        return InboundSession(self, writer)

    def new_channel_session(self, writer: FrameWriter, caller_rank: int) -> ChannelCalls:
        return ChannelCalls(self, writer, caller_rank)

    @property
    def early(self) -> bool:
        """Whether requests still wait for the group to be known (see :meth:`group_known`)."""
        return self._early is not None

    # ------------------------------------------------------------------ link order
    def link_opened(self, session: InboundSession, token: int) -> None:
        """``session``'s link announced its token (loop)."""
        session.link_token = token
        with self._order:
            self.links[token] = session
            self._order.notify_all()

    def link_closed(self, session: InboundSession) -> None:
        with self._order:
            if self.links.get(session.link_token) is session:
                del self.links[session.link_token]
                self._ended_links.add(session.link_token)
            self._order.notify_all()

    def link_moved(self) -> None:
        """A link handled more envelopes while reply-channel threads wait (loop)."""
        with self._order:
            self._order.notify_all()

    def wait_for_link(self, token: int, count: int, deadline: float | None) -> InboundSession | None:
        """The session of link ``token`` once it has handled ``count`` envelopes (from a reply
        channel's thread: its request comes after them); None if the link ended first, or
        ``deadline`` (``time.monotonic()``) passed."""
        session = self.links.get(token)
        if session is not None and session.envelopes >= count:
            return session
        with self._order:
            self.order_waiters += 1
            try:
                while True:
                    session = self.links.get(token)
                    if session is not None and session.envelopes >= count:
                        return session
                    if token in self._ended_links:
                        return None
                    if deadline is None:
                        self._order.wait()
                    elif not self._order.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                        return None
            finally:
                self.order_waiters -= 1

    def close(self) -> None:
        """The agent shuts down: reply-channel threads stop waiting for links."""
        with self._order:
            self._ended_links.update(self.links)
            self.links.clear()
            self._order.notify_all()

    def group_known(self) -> None:
        """Run the calls that arrived before the group was known, in arrival order."""
        deferred, self._early = self._early, None
        for session, header, buffers in deferred or ():
            self.on_request(session, header, buffers)

    # ------------------------------------------------------------------ dispatch
    def on_request(self, session: InboundSession, header: Any, buffers: list[memoryview] | Exception) -> None:
        if self._early is not None:
            self._early.append((session, header, buffers))
            return
        call_id = header.call_id
        if header.kind == frames.CANCEL:
            job = session.running.get(call_id)
            if job is not None:
                job.cancel()
            return
        if header.kind == frames.NOTIFY:
            self._on_notice(session, header, buffers)
            return
        if header.kind != frames.REQUEST:
            return
        function = header.function
        if header.caller_rank != session.caller_rank:
            session.identify(header.caller_rank)
        if self.agent.closing:
            # A link that is still open (its socket goes with the process) may carry one more
            # request: it is refused, never run by a worker whose calls have all been failed.
            self._respond_error(
                session,
                call_id,
                function,
                RpcError(f"worker {self.agent.info.name} is shutting down: {function} was not run"),
            )
            return
        if metrics.current is not None:
            session.arrivals[call_id] = time.perf_counter()
        if header.reply_channel:
            writer = self.agent.transport.reply_writer(header.caller_rank, header.reply_channel)
            if writer is not None:  # (else closed meanwhile: the caller gave up waiting there)
                session = _AnsweredOnChannel(session, writer)  # type: ignore[assignment]
        try:
            if isinstance(buffers, Exception):
                raise buffers
            limit = self.agent.options.max_inflight_calls_per_peer
            running = session.calls_running()
            if running >= limit:
                raise RpcError(
                    f"worker {self.agent.info.name} refused the call: caller rank {header.caller_rank} "
                    f"already has {running} calls running here "
                    f"(max_inflight_calls_per_peer={limit})"
                )
            func, args, kwargs, state, unconfirmed = _decode_request(self.agent, header, buffers)
        except Exception as exc:
            self._respond_error(session, call_id, function, _loading_error(exc), loading=True)
            return
        self.decoded(session, header, func, args, kwargs, state, unconfirmed)

    def decoded(
        self,
        session: InboundSession,
        header: Any,
        func: Any,
        args: Any,
        kwargs: Any,
        state: list[Any],
        unconfirmed: list[Unconfirmed],
    ) -> None:
        """Run a decoded request (loop): once the objects its arguments carry are confirmed,
        the way its function runs."""
        call_id, function = header.call_id, header.function
        agent = self.agent
        if state and agent.extension is not None:  # run (and pickle the result) in the caller's state
            run_in = contextvars.copy_context()
            run_in.run(agent.extension.enter, state[0])
        else:
            run_in = None
        timeout = header.timeout_seconds
        if unconfirmed:  # (rare: new user RRefs in the arguments) run once their owners confirm
            gate = self._confirmation_gate(function, unconfirmed, timeout)
            if is_inline(func):
                # The handler runs now (its bookkeeping keeps arrival order); the user function
                # it starts waits for the gate (Agent.start_user_function).
                if run_in is None:
                    run_in = contextvars.copy_context()
                run_in.run(confirmation_gate.set, gate)
            else:
                session.track(call_id, gate)  # a CANCEL, or the session's end, cancels the wait
                arrived = time.monotonic()
                gate.add_done_callback(
                    lambda done: self._after_gate(
                        done, session, call_id, function, func, args, kwargs, run_in, timeout, arrived
                    )
                )
                return
        self._dispatch(session, call_id, function, func, args, kwargs, run_in, timeout)

    def _dispatch(
        self,
        session: InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        run_in: contextvars.Context | None,
        timeout: float,
    ) -> None:
        """Run a decoded call the way its function runs (``timeout`` in seconds, 0: none)."""
        agent = self.agent
        if is_inline(func) or is_prompt(func):  # rpcdist's own short, non-blocking handlers
            self._run_inline(session, call_id, function, func, args, kwargs, run_in, timeout)
        elif runs_as_coroutine(func):
            task = agent.loop.create_task(
                self._run_async(session, call_id, function, func, args, kwargs), context=run_in
            )
            session.track(call_id, task)
            if timeout > 0:
                deadline = agent.loop.call_later(timeout, task.cancel)
                task.add_done_callback(lambda _: deadline.cancel())  # don't pin finished calls
        else:
            self._queue_blocking(session, call_id, function, func, args, kwargs, run_in, timeout)

    def _queue_blocking(
        self,
        session: InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        run_in: contextvars.Context | None,
        timeout: float,
    ) -> None:
        """Queue a call of a blocking function on the worker pool (any thread)."""
        job = _ThreadJob()
        session.track(call_id, job)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        blocking = functools.partial(
            self._run_blocking, session, call_id, function, func, args, kwargs, job, deadline
        )
        self.agent.pool.submit(blocking if run_in is None else functools.partial(run_in.run, blocking))

    def _confirmation_gate(
        self, function: str, unconfirmed: list[Unconfirmed], timeout: float
    ) -> asyncio.Future[None]:
        """A loop future that completes once every confirmation in ``unconfirmed`` has arrived,
        and fails with an RpcError naming the first that failed, or after ``timeout`` seconds
        (the call's own; without one, the default ``rpc_timeout``: a registration the owner
        never answers must not hold the call forever)."""
        agent = self.agent
        loop = agent.loop
        gate: asyncio.Future[None] = loop.create_future()
        # An inline handler may never start a function that awaits it: its failure is not news.
        gate.add_done_callback(lambda done: done.cancelled() or done.exception())
        waiting = len(unconfirmed)

        def confirmed(item: Unconfirmed) -> None:  # on the loop
            nonlocal waiting
            if gate.done():
                return
            error = item.future.exception()
            if error is not None:
                failure = RpcError(
                    f"worker {agent.info.name} could not run {function}: {item.what}, passed in its "
                    f"arguments, was not confirmed by its owner: {type(error).__name__}: {error}"
                )
                failure.__cause__ = error
                gate.set_exception(failure)
                return
            waiting -= 1
            if waiting == 0:
                gate.set_result(None)

        for item in unconfirmed:
            # (completed on whichever thread answers it; counted on the loop)
            item.future.add_done_callback(lambda _, item=item: agent.on_loop(lambda: confirmed(item)))
        limit = timeout if timeout > 0 else agent.options.rpc_timeout
        if limit > 0 and not gate.done():

            def expire() -> None:
                if not gate.done():
                    what = ", ".join(item.what for item in unconfirmed if not item.future.done())
                    gate.set_exception(
                        RpcTimeoutError(
                            f"worker {agent.info.name} could not run {function}: the owner did not "
                            f"confirm {what}, passed in its arguments, within {limit:g} s"
                        )
                    )

            expiry = loop.call_later(limit, expire)
            gate.add_done_callback(lambda _: expiry.cancel())
        return gate

    def _after_gate(
        self,
        gate: asyncio.Future[None],
        session: InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        run_in: contextvars.Context | None,
        timeout: float,
        arrived: float,
    ) -> None:
        """The confirmations of a call's arguments arrived (or failed): run it, or fail it."""
        if gate.cancelled():  # cancelled by its caller, or the session ended
            session.untrack(call_id)
            session.arrivals.pop(call_id, None)
            return
        error = gate.exception()
        if error is not None:
            session.untrack(call_id)
            self._respond_error(session, call_id, function, error)
            return
        if timeout > 0:  # what is left of the call's own timeout
            timeout = max(timeout - (time.monotonic() - arrived), 1e-3)
        # Dispatch before untracking the gate: the session must never look idle while the
        # call is still to run (its end waits for no running calls, then closes the connection).
        self._dispatch(session, call_id, function, func, args, kwargs, run_in, timeout)
        if session.running.get(call_id) is gate:
            session.untrack(call_id)

    def _on_notice(self, session: InboundSession, header: Any, buffers: list[memoryview] | Exception) -> None:
        """Run a NOTIFY (one of rpcdist's own inline handlers) now; nothing goes back."""
        if header.caller_rank != session.caller_rank:
            session.identify(header.caller_rank)
        try:
            func, args, kwargs = self._notice_call(header, buffers)
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - its sender does not wait for an answer
            self._notice_failed(session, header, exc)

    def on_notice_here(
        self, session: InboundSession, header: Any, buffers: list[memoryview] | Exception
    ) -> None:
        """:meth:`_on_notice` on a reply channel's thread: a handler that may run on any thread
        runs here, any other on the loop."""
        try:
            func, args, kwargs = self._notice_call(header, buffers)
            if not runs_anywhere(func):
                self.agent.on_loop(lambda: self._run_notice(session, header, func, args, kwargs), sends=False)
                return
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - its sender does not wait for an answer
            self._notice_failed(session, header, exc)

    def _run_notice(self, session: InboundSession, header: Any, func: Any, args: Any, kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - its sender does not wait for an answer
            self._notice_failed(session, header, exc)

    def _notice_call(self, header: Any, buffers: list[memoryview] | Exception) -> tuple[Any, Any, Any]:
        if isinstance(buffers, Exception):
            raise buffers
        func, args, kwargs, *_ = self.agent.decode(header.payload, buffers)
        if not is_inline(func):
            raise RpcError(f"a notice may only run one of rpcdist's own handlers, not {header.function}")
        return func, args, kwargs

    def _notice_failed(self, session: InboundSession, header: Any, exc: Exception) -> None:
        log.warning(
            "%s: notice %s from %s failed: %s: %s",
            self.agent.info.name,
            header.function,
            session.peer_name,
            type(exc).__name__,
            exc,
        )

    def _run_inline(
        self,
        session: InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        run_in: contextvars.Context | None,
        timeout: float,
    ) -> None:
        """Run one of rpcdist's own handlers on the loop (``inline``, or ``prompt`` read on the
        link) and answer it, once the future it returns settles if it returns one."""
        within = run_in.run if run_in is not None else _call
        try:
            result = within(func, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - goes back to the caller
            self._respond_error(session, call_id, function, exc)
            return
        if isinstance(result, RunAsCall):
            gate = run_in.get(confirmation_gate) if run_in is not None else None
            if gate is not None:  # (run_in is not None)
                # It runs as a plain call once the arguments' owners have confirmed them (a pool
                # thread answers it), not through a task that awaits them and hands it over.
                run_in.run(confirmation_gate.set, None)  # type: ignore[union-attr]
                session.track(call_id, gate)  # a CANCEL, or the session's end, cancels the wait
                arrived = time.monotonic()
                gate.add_done_callback(
                    lambda done: self._after_gate(
                        done, session, call_id, function, *result, run_in, timeout, arrived
                    )
                )
                return
            self._dispatch(session, call_id, function, *result, run_in, timeout)
            return
        if isinstance(result, asyncio.Future):  # answer once it settles (e.g. a loan returned)
            session.track(call_id, result)
            result.add_done_callback(lambda f: within(self._settle_inline, session, call_id, function, f))
            return
        if isinstance(result, Future):  # (a prompt handler's: see markers.prompt)
            if not (result.done() and result.exception() is None):
                within(self._answer_on_completion, session, call_id, function, result, True)
                return
            result = result.value()
        within(self._respond, session, call_id, function, result)

    def _settle_inline(self, session: InboundSession, call_id: int, function: str, done: Any) -> None:
        session.untrack(call_id)
        if done.cancelled():
            session.arrivals.pop(call_id, None)
            return
        if done.exception() is not None:
            self._respond_error(session, call_id, function, done.exception())
        else:
            self._respond(session, call_id, function, done.result())

    async def _run_async(
        self, session: InboundSession, call_id: int, function: str, func: Any, args: Any, kwargs: Any
    ) -> None:
        try:
            result = await func(*args, **kwargs)
            if is_async_execution(func):
                result = await awaitable(result)
            self._respond(session, call_id, function, result)
        except asyncio.CancelledError:
            session.arrivals.pop(call_id, None)
            log.debug("%s: call %s to %s cancelled", self.agent.info.name, call_id, function)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._respond_error(session, call_id, function, exc)
        finally:
            session.untrack(call_id)

    def _run_blocking(
        self,
        session: InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        job: _ThreadJob,
        deadline: float | None,
    ) -> None:
        """Runs on a pool thread."""
        inbox = self.agent.inbox
        if job.cancelled or (deadline is not None and time.monotonic() > deadline):
            inbox.post(lambda: self._skip(session, call_id), sends=False)
            return
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            inbox.post(lambda e=exc: self._finish_error(session, call_id, function, e), sends=False)
            return
        if is_async_execution(func):
            if not isinstance(result, Future):  # an awaitable: awaited by a task on the loop
                inbox.post(lambda: self._finish_later(session, call_id, function, result))
                return
            if not (result.done() and result.exception() is None):
                own = is_prompt(func)  # (rpcdist's fetch of an RRef's value: see _answer_on_completion)
                self._answer_on_completion(session, call_id, function, result, from_any_thread=own)
                return
            result = result.value()  # settled already: answered like a plain result
        self._answer_here(session, call_id, function, result)

    def _answer_here(self, session: InboundSession, call_id: int, function: str, result: Any) -> None:
        """Answer a call with ``result`` from this thread (not the loop's): encoded here, and
        written here, the loop not woken, when it is the peer's only call running here (or the
        only one its reply channel carries); otherwise through the loop, whose writer packs many
        answers into one write."""
        inbox = self.agent.inbox
        try:
            entries = list(self._encode_result(session, call_id, function, result))
        except BaseException as exc:  # noqa: BLE001
            inbox.post(lambda e=exc: self._finish_error(session, call_id, function, e), sends=False)
            return
        if type(session) is _AnsweredOnChannel or len(session.running) == 1:
            if session.write_answers_now([call_id], entries):
                if session.arrivals:  # metrics are on: counted on the loop
                    inbox.post(lambda: self._served(session, call_id, function, True), sends=False)
                return
            inbox.post(lambda: self._finish(session, call_id, function, iter(entries)), sends=False)
            return
        session.answer_from_thread(call_id, function, entries)

    def _skip(self, session: InboundSession, call_id: int) -> None:
        session.untrack(call_id)
        session.arrivals.pop(call_id, None)

    def _finish(self, session: InboundSession, call_id: int, function: str, entries: Entries) -> None:
        session.untrack(call_id)
        session.respond(entries)
        self._served(session, call_id, function, True)

    def _finish_error(self, session: InboundSession, call_id: int, function: str, exc: BaseException) -> None:
        session.untrack(call_id)
        self._respond_error(session, call_id, function, exc)

    def _answer_on_completion(
        self,
        session: InboundSession,
        call_id: int,
        function: str,
        result: Future[Any],
        from_any_thread: bool = False,
    ) -> None:
        """Answer an ``async_execution`` call once the rpcdist Future it returned completes,
        from that completion (on the loop: the answer to a call it made, typically) rather than
        a task: no wake-up of the loop to start waiting, no task per call.
        ``from_any_thread`` (rpcdist's own handlers): a value completed on another thread (the
        pool thread that made an RRef's value) is answered right there, without the loop."""
        agent = self.agent
        answer = _AwaitedAnswer(session, call_id)
        session.track(call_id, answer)  # (a CANCEL, or the session's end, drops it)
        # Answered in the call's own contextvars (its extension state), as a result returned
        # at once is, not in whatever context completes the future.
        within = contextvars.copy_context()

        def respond() -> None:  # on the loop
            if answer.cancelled:
                return
            session.untrack(call_id)
            error = result.exception()
            if error is not None:
                self._respond_error(session, call_id, function, error)
            else:
                self._respond(session, call_id, function, result.value())

        def completed(_: Future[Any]) -> None:
            try:
                if threading.get_ident() == agent.loop_thread_id:
                    within.run(respond)
                elif from_any_thread and result.exception() is None:
                    if not answer.cancelled:
                        within.run(self._answer_here, session, call_id, function, result.value())
                else:
                    agent.inbox.post(lambda: within.run(respond), sends=False)
            except Exception:  # noqa: BLE001 - never into whoever completed the future
                log.exception("%s: answering the call to %s failed", agent.info.name, function)

        result._on_done(completed)

    def _finish_later(self, session: InboundSession, call_id: int, function: str, result: Any) -> None:
        async def complete() -> None:
            try:
                value = await awaitable(result)
                self._respond(session, call_id, function, value)
            except asyncio.CancelledError:
                session.arrivals.pop(call_id, None)
            except BaseException as exc:  # noqa: BLE001
                self._respond_error(session, call_id, function, exc)
            finally:
                session.untrack(call_id)

        session.track(call_id, self.agent.loop.create_task(complete()))

    # ------------------------------------------------------------------ answering
    def _encode_result(self, session: InboundSession, call_id: int, function: str, result: Any) -> Entries:
        agent = self.agent
        state = agent.extension.capture() if agent.extension is not None else None
        what = f"the result of {function}"
        payload, buffers, holds = agent.pickle(result, what, session.caller_rank, state)
        if holds.ordered and type(session) is _AnsweredOnChannel:
            session.divert(call_id)
        # Large buffers are given in reusable slots (the caller hands them back with SLOTS_READ
        # once done): a new shared-memory file per response cost its pages on every call (a
        # 16 MB response took 14 ms that way).
        shared = agent.transport.share(session.caller_rank, buffers)
        return frames.encode_message(
            call_id, frames.RESPONSE, payload, buffers, chunk_bytes=agent.options.chunk_bytes, shared=shared
        )

    def _respond(self, session: InboundSession, call_id: int, function: str, result: Any) -> None:
        try:
            if type(result) is ValueAnswer:
                entries = self._encode_value_answer(session, call_id, function, result)
            else:
                entries = self._encode_result(session, call_id, function, result)
            session.respond(entries)
        except BaseException as exc:  # noqa: BLE001
            self._respond_error(session, call_id, function, exc)
            return
        self._served(session, call_id, function, True)

    def _encode_value_answer(
        self, session: InboundSession, call_id: int, function: str, answer: ValueAnswer
    ) -> Entries:
        """The answer of a with-value call: its value, or, if that cannot be pickled, the error
        as a :class:`ValueNotSent` (in the words a separate fetch of the value would have had:
        the call itself succeeded)."""
        try:
            return self._encode_result(session, call_id, function, answer.value)
        except Exception as exc:  # noqa: BLE001 - the caller's fetch raises it
            log.warning("%s: %s failed: %s: %s", self.agent.info.name, answer.fetch, type(exc).__name__, exc)
            payload, buffers = describe_error(self.agent.info.name, answer.fetch, exc)
            not_sent = ValueNotSent(bytes(payload), [bytes(b) for b in buffers])
            return self._encode_result(session, call_id, function, not_sent)

    def _respond_error(
        self, session: InboundSession, call_id: int, function: str, exc: BaseException, loading: bool = False
    ) -> None:
        if not isinstance(exc, asyncio.CancelledError):  # (a cancel is the caller's own doing)
            # As torch's callee, which logs every failed request: the callee's log shows it too.
            log.warning("%s: %s failed: %s: %s", self.agent.info.name, function, type(exc).__name__, exc)
        payload, buffers = describe_error(self.agent.info.name, function, exc, loading)
        session.respond(frames.encode_message(call_id, frames.ERROR, payload, buffers))
        self._served(session, call_id, function, False)

    @staticmethod
    def _served(session: InboundSession, call_id: int, function: str, ok: bool) -> None:
        """Count an answered call (its arrival was noted only while metrics are on)."""
        arrived = session.arrivals.pop(call_id, None)
        if arrived is not None and metrics.current is not None:
            metrics.current.call_served(function, session.peer_name, ok, time.perf_counter() - arrived)


async def awaitable(result: Any) -> Any:
    """Await what an ``async_execution`` function returned: an rpcdist or torch Future, or
    any awaitable."""
    if inspect.isawaitable(result):
        return await result
    wait = getattr(result, "wait", None)
    if callable(wait) and hasattr(result, "add_done_callback"):  # torch.futures.Future
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        result.add_done_callback(lambda f: loop.call_soon_threadsafe(settle, done))
        await done
        return result.wait()
    raise RuntimeError(  # torch's wording, which its users match
        "Functions decorated with @rpc.async_function must return a torch.futures.Future object, "
        f"but got {type(result)} (rpcdist also takes an rpcdist Future or any awaitable)"
    )


def _decode_request(
    agent: Any, header: Any, buffers: list[memoryview]
) -> tuple[Any, Any, Any, list[Any], list[Unconfirmed]]:
    """A request's function (its value-answering variant when the request asks for it, see
    ``Envelope.with_value``), arguments and caller state, and the unconfirmed RRefs the
    arguments carry."""
    with CollectingUnconfirmed() as unconfirmed:
        func, args, kwargs, *state = agent.decode(header.payload, buffers)
    if header.with_value:
        func = with_value_variant(func, header.function)
    return func, args, kwargs, state, unconfirmed


def _loading_error(exc: Exception) -> Exception:
    """The error a caller gets for a call this worker could not unpickle: a function (or class)
    missing here is a SerializationError in torch's words."""
    if not isinstance(exc, (AttributeError, ImportError)):
        return exc
    error = SerializationError(
        "RPC pickler does not serialize function code. Ensure that UDFs are defined on both "
        f"caller and callee modules ({type(exc).__name__}: {exc})"
    )
    error.__cause__ = exc
    return error


def _call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return func(*args, **kwargs)
