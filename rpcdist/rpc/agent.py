"""The per-process RPC agent: a grpc.aio server, one long-lived stream per peer, and the
dispatch of calls, all on one event loop.

Caller side: ``submit`` pickles in the calling thread (errors surface there, before anything
is sent), then hands the call to the loop, which numbers it, queues its frames on the peer's
Exchange stream and arms its timeout. Callee side: each incoming Exchange stream is an
:class:`_InboundSession`; ``async def`` functions run as tasks on the loop, blocking ones on
the :class:`~rpcdist.rpc._threads.WorkerPool`, and results travel back on the same stream.

Timeouts travel with the request: the callee cancels an ``async`` call's task when its time is
up, and the caller also sends CANCEL when it gives up, so abandoned work stops on both sides.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import inspect
import itertools
import logging
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rpcdist import serialization
from rpcdist.autograd import _contexts as autograd_contexts
from rpcdist.errors import (
    PayloadTooLargeError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
    WorkerUnavailableError,
    annotate_remote,
)
from rpcdist.futures import Future
from rpcdist.rendezvous import Member, Rendezvous
from rpcdist.rpc import shm, transport, wire
from rpcdist.rpc._threads import LoopInbox, WorkerPool
from rpcdist.rpc.functions import INLINE_ATTR, inline, is_async_execution
from rpcdist.rpc.options import RpcBackendOptions, WorkerInfo
from rpcdist.rpc.rref import RRefContext, capturing_forks
from rpcdist.rpc.transport import FrameWriter

log = logging.getLogger(__name__)

Entries = Iterator[list[bytes | memoryview]]


class _OutgoingCall:
    __slots__ = (
        "dest",
        "function",
        "payload",
        "buffers",
        "shared",
        "forks",
        "lent",
        "timeout",
        "future",
        "timer",
        "call_id",
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
        self.forks: list[int] = []  # RRef fork holds taken while pickling the arguments
        self.lent: list[shm.Slot] = []  # shared-memory slots holding the arguments
        self.timeout = timeout
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.call_id = 0


class _InboundSession:
    """The callee's end of one caller's connection (a gRPC stream or a Unix socket)."""

    def __init__(self, agent: RpcAgent, write: Callable[[bytes], Any]) -> None:
        self.agent = agent
        self.writer = FrameWriter(write, "inbound")
        self.assemblies: dict[int, wire.Assembly] = {}
        self.running: dict[int, Any] = {}  # call_id -> asyncio.Task or _ThreadJob
        self.idle = asyncio.Event()
        self.idle.set()
        self.caller_rank = -1
        # Shared-memory files of responses, removed when the session ends in case the caller
        # never adopted them (it unlinks the ones it does).
        self.exported: collections.deque[str] = collections.deque()
        agent._sessions.add(self)

    def on_frame(self, raw: bytes) -> None:
        """Handle one incoming frame; raises FrameError if it is malformed."""
        agent = self.agent
        for env in wire.decode_frame(raw):
            message = _collect(self.assemblies, env, agent.options.max_payload_bytes)
            if message is not None:
                agent._on_request(self, *message)

    async def finish(self) -> None:
        """The caller is done sending: finish its calls, then flush the replies."""
        await self.idle.wait()
        await self.writer.close()

    def cleanup(self) -> None:
        for job in self.running.values():
            job.cancel()
        self.writer.abort()
        shm.remove(self.exported)
        self.agent._sessions.discard(self)

    def remember_exported(self, names: list[str]) -> None:
        self.exported.extend(n for n in names if n)
        if len(self.exported) > 4096:  # prune the ones the caller already adopted
            self.exported = collections.deque(n for n in self.exported if shm.sees_probe(n))

    def respond(self, entries: Entries) -> None:
        self.writer.send(entries)

    def track(self, call_id: int, job: Any) -> None:
        self.running[call_id] = job
        self.idle.clear()

    def untrack(self, call_id: int) -> None:
        self.running.pop(call_id, None)
        if not self.running:
            self.idle.set()


class _ThreadJob:
    """A blocking user function queued on the worker pool; skipped if cancelled before start."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class RpcAgent:
    """One per process: serves calls from peers and sends this process's calls to them."""

    def __init__(
        self,
        info: WorkerInfo,
        world_size: int,
        options: RpcBackendOptions,
        rendezvous: Rendezvous,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.info = info
        self.world_size = world_size
        self.options = options
        self.rendezvous = rendezvous
        self.loop = loop
        self.workers_by_rank: dict[int, WorkerInfo] = {}
        self.workers_by_name: dict[str, WorkerInfo] = {}
        self.addresses: dict[int, str] = {}
        self.cards: dict[int, dict[str, str]] = {}
        # Requests that arrive before set_members (None once the group is known).
        self._early_requests: list[tuple[Any, Any, Any]] | None = []
        self._unix_server: asyncio.AbstractServer | None = None
        self.unix_path = ""
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._pool = WorkerPool(options.num_worker_threads, f"rpcdist-{info.name}")
        self._inbox = LoopInbox(loop)
        self._call_ids = itertools.count(1)
        self._pending: dict[int, _OutgoingCall] = {}
        self._peers: dict[int, transport.Link] = {}
        self._sessions: set[_InboundSession] = set()
        self._no_pending = asyncio.Event()
        self._no_pending.set()
        self._closing = False
        self._closed = False
        self._loop_thread_id = threading.get_ident()
        self.shm_probe = shm.create_probe() if options.shm_threshold_bytes > 0 else ""
        self.slots = shm.SlotPool()
        # Whether calls made inside a distributed autograd context carry it (the RPC agent;
        # not the one collectives use).
        self.autograd = False
        self.rrefs = RRefContext(self)
        self._colocated: set[int] = set()

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, host: str) -> int:
        """Start the gRPC server on ``host`` (ephemeral port), and the Unix socket for
        co-located peers; returns the gRPC port."""
        handler = grpc.method_handlers_generic_handler(
            "rpcdist.v1.Agent",
            {
                "Exchange": grpc.stream_stream_rpc_method_handler(
                    self._exchange,
                    request_deserializer=None,
                    response_serializer=None,
                )
            },
        )
        self.server = grpc.aio.server(options=transport.CHANNEL_OPTIONS)
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port(f"{host}:0")
        await self.server.start()
        if self.shm_probe and self.options.transport != "grpc":
            path = shm.socket_path()
            try:
                self._unix_server = await transport.serve_unix(path, self._new_session)
                self.unix_path = path
            except OSError as exc:
                log.info("no Unix-socket transport (%s); co-located peers use gRPC", exc)
        return self.port

    async def _exchange(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await transport.serve_grpc_stream(self._new_session, requests, context)

    def _new_session(self, write: Callable[[bytes], Any]) -> _InboundSession:
        return _InboundSession(self, write)

    def set_members(self, members: list[Member]) -> None:
        """Learn the group; calls that arrived before this (from peers that finished joining
        first) run now, in arrival order."""
        for member in members:
            info = WorkerInfo(member.name, member.rank)
            self.workers_by_rank[member.rank] = info
            self.workers_by_name[member.name] = info
            self.addresses[member.rank] = member.address
            self.cards[member.rank] = member.card
            if self.shm_probe and shm.sees_probe(member.card.get("shm_probe", "")):
                self._colocated.add(member.rank)
        deferred, self._early_requests = self._early_requests, None
        for session, header, buffers in deferred or ():
            self._on_request(session, header, buffers)

    async def wait_for_outstanding(self, timeout: float | None) -> None:
        """Wait until every call this worker made has completed (or ``timeout`` passes)."""
        try:
            await asyncio.wait_for(self._no_pending.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("%s: %d calls still outstanding at shutdown", self.info.name, len(self._pending))

    async def find_dead(self, ranks: list[int]) -> list[int]:
        """Which of ``ranks`` no longer answer (a refused or lost connection, not slowness)."""
        probes = [self.submit(rank, _ping, None, None, 5.0, function_name="rpcdist.ping") for rank in ranks]
        dead = []
        for rank, probe in zip(ranks, probes, strict=True):
            try:
                await probe
            except WorkerUnavailableError:
                dead.append(rank)
            except Exception:  # noqa: BLE001 - busy or slow is alive
                pass
        return dead

    async def close(self, graceful: bool) -> None:
        """Close streams, server and threads. Outstanding calls fail with WorkerUnavailableError."""
        if self._closed:
            return
        self._closing = True
        for peer in list(self._peers.values()):
            await peer.close(graceful)
        self._peers.clear()
        if self._unix_server is not None:
            self._unix_server.close()
            shm.remove_socket(self.unix_path)
        if self.server is not None:
            await self.server.stop(grace=1.0 if graceful else None)
            self.server = None  # its handlers refer back to this agent
        for call_id in list(self._pending):
            self._fail(call_id, WorkerUnavailableError(f"worker {self.info.name} shut down"))
        self._pool.shutdown(timeout=1.0 if graceful else 0.1)
        shm.remove([self.shm_probe])
        self.slots.close()
        self.rrefs.close()
        self._closed = True

    def start_user_function(self, func: Callable[..., Any], args: Any, kwargs: Any) -> asyncio.Future[Any]:
        """Start a user function the way calls run (``async def`` on the loop, others on the
        pool, in the current autograd context); returns a future of its result. Loop only."""
        if inspect.iscoroutinefunction(func) or is_async_execution(func):
            return self.loop.create_task(self.run_user_function(func, args, kwargs))
        if getattr(func, INLINE_ATTR, False):  # one of rpcdist's own loop-side handlers
            done = self.loop.create_future()
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001
                done.set_exception(exc)
                return done
            if isinstance(result, asyncio.Future):
                return result
            done.set_result(result)
            return done
        return self._on_pool(func, args, kwargs)

    def _on_pool(self, func: Callable[..., Any], args: Any, kwargs: Any) -> asyncio.Future[Any]:
        """Run a blocking function on the worker pool (keeping the current contextvars)."""
        done = self.loop.create_future()

        def run() -> None:
            try:
                result: Any = func(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001
                self._inbox.post(lambda e=exc: done.done() or done.set_exception(e))
                return
            self._inbox.post(lambda: done.done() or done.set_result(result))

        self._pool.submit(functools.partial(contextvars.copy_context().run, run))
        return done

    async def run_user_function(self, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Run a user function the way calls run: ``async def`` on the loop, others on the pool."""
        if inspect.iscoroutinefunction(func):
            result = await func(*args, **kwargs)
        elif getattr(func, INLINE_ATTR, False):
            result = await self.start_user_function(func, args, kwargs)
        else:
            result = await self._on_pool(func, args, kwargs)
        if is_async_execution(func) or inspect.isawaitable(result):
            result = await _awaitable(result)
        return result

    # ------------------------------------------------------------------ resolving workers
    def worker(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The WorkerInfo for a name, rank or WorkerInfo; UnknownWorkerError if none matches."""
        if isinstance(to, WorkerInfo):
            info = self.workers_by_rank.get(to.id)
            if info is None or info.name != to.name:
                raise UnknownWorkerError(f"{to!r} is not a worker of this group")
            return info
        if isinstance(to, str):
            info = self.workers_by_name.get(to)
            if info is None:
                raise UnknownWorkerError(
                    f"no worker named {to!r}; known workers: {sorted(self.workers_by_name)}"
                )
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers_by_rank.get(to)
            if info is None:
                raise UnknownWorkerError(f"no worker with rank {to}; ranks are 0..{self.world_size - 1}")
            return info
        raise TypeError(f"`to` must be a worker name, rank or WorkerInfo, not {type(to).__name__}")

    # ------------------------------------------------------------------ caller side
    def submit(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...] | None,
        kwargs: dict[str, Any] | None,
        timeout: float,
        *,
        function_name: str | None = None,
    ) -> Future[Any]:
        """Send a call from any thread; returns its Future. Raises at once on bad input."""
        if self._closing:
            raise RpcError(f"worker {self.info.name} is shut down; call init_rpc first")
        dest = self.worker(to)
        name = function_name or serialization.check_importable(func)
        autograd_id = autograd_contexts.current_id() if self.autograd else None
        call_tuple: tuple[Any, ...] = (func, tuple(args or ()), dict(kwargs or {}))
        if autograd_id is not None:  # the callee joins the distributed autograd context
            call_tuple += (autograd_id,)
        payload, buffers, forks = self._pickle(call_tuple, f"call to {name} on {dest.name}", dest.id)
        if timeout is None or timeout < 0:
            timeout = self.options.rpc_timeout
        future: Future[Any] = Future(loop=self.loop)
        call = _OutgoingCall(dest, name, payload, buffers, timeout, future)
        call.forks = forks
        call.shared = self._share(dest.id, buffers, call.lent)
        if threading.get_ident() == self._loop_thread_id and not self._inbox.pending:
            self._start_call(call)
        else:  # through the inbox, behind calls other threads submitted earlier: order holds
            self._inbox.post(lambda: self._start_call(call))
        return future

    def is_colocated(self, rank: int) -> bool:
        """Whether ``rank`` shares this host's /dev/shm (so shared memory reaches it)."""
        return rank in self._colocated

    def _share(self, rank: int, buffers: list[memoryview], lent: list[shm.Slot] | None = None) -> list[str]:
        """Hand the large buffers for a co-located peer to shared memory; names per buffer.

        With ``lent`` (requests, whose reply tells when the callee is done reading) buffers
        go through this agent's reusable slots, which are appended to it; otherwise each is
        handed over as a new file the receiver keeps.
        """
        threshold = self.options.shm_threshold_bytes
        if rank not in self._colocated or not any(len(b) >= threshold for b in buffers):
            return []
        names: list[str] = []
        try:
            for buffer in buffers:
                if len(buffer) < threshold:
                    names.append("")
                elif lent is not None:
                    slot = self.slots.lend(rank, buffer.cast("B") if buffer.format != "B" else buffer)
                    lent.append(slot)
                    names.append(slot.name)
                else:
                    names.append(shm.export(buffer))
        except OSError as exc:  # /dev/shm full or gone: send inline
            log.warning("shared-memory handoff failed (%s); sending inline", exc)
            shm.remove(n for n in names if not shm.is_slot(n))
            if lent:
                for slot in lent:
                    self.slots.discard(slot)
                lent.clear()
            return []
        return names

    def _drop_shared(self, call: _OutgoingCall) -> None:
        """The call failed: remove its handed-over files; its lent slots are never reused (the
        callee may still be reading them)."""
        shm.remove(n for n in call.shared if not shm.is_slot(n))
        for slot in call.lent:
            self.slots.discard(slot)
        call.lent = []

    def _start_call(self, call: _OutgoingCall) -> None:
        if self._closing:
            self._drop_shared(call)
            self.rrefs.release_children(call.forks)
            call.future._try_complete(None, RpcError(f"worker {self.info.name} is shutting down"))
            return
        call.call_id = call_id = next(self._call_ids)
        try:
            peer = self._connection(call.dest.id)
        except Exception as exc:
            self._drop_shared(call)
            self.rrefs.release_children(call.forks)
            call.future._try_complete(None, WorkerUnavailableError(f"cannot reach {call.dest.name}: {exc}"))
            return
        self._pending[call_id] = call
        self._no_pending.clear()
        if call.timeout > 0:
            call.timer = self.loop.call_later(call.timeout, self._expire, call_id)
        peer.writer.send(
            wire.encode_message(
                call_id,
                wire.REQUEST,
                call.payload,
                call.buffers,
                chunk_bytes=self.options.chunk_bytes,
                timeout_seconds=call.timeout,
                function=call.function,
                caller_rank=self.info.id,
                shared=call.shared,
            )
        )
        call.payload, call.buffers = b"", []  # the writer holds them now

    def _connection(self, rank: int) -> transport.Link:
        link = self._peers.get(rank)
        if link is None:
            unix_path = self.cards[rank].get("unix", "")
            if unix_path and rank in self._colocated and self.options.transport != "grpc":
                link = transport.UnixLink(self, self.workers_by_rank[rank], unix_path)
            else:
                link = transport.GrpcLink(self, self.workers_by_rank[rank], self.addresses[rank])
            self._peers[rank] = link
        return link

    def _expire(self, call_id: int) -> None:
        call = self._pending.get(call_id)
        if call is None:
            return
        self._fail(
            call_id,
            RpcTimeoutError(
                f"call to {call.function} on worker {call.dest.name} timed out after {call.timeout:g} s "
                "(the callee was asked to cancel it)"
            ),
        )
        peer = self._peers.get(call.dest.id)
        if peer is not None:
            peer.writer.send(iter([wire.encode_control(call_id, wire.CANCEL)]))

    def _fail(self, call_id: int, error: BaseException) -> None:
        call = self._pending.pop(call_id, None)
        if call is None:
            return
        self._drop_shared(call)
        if call.timer is not None:
            call.timer.cancel()
        if not self._pending:
            self._no_pending.set()
        call.future._try_complete(None, error)

    def _on_reply_frame(self, peer: transport.Link, raw: bytes) -> None:
        for env in wire.decode_frame(raw):
            message = _collect(peer.assemblies, env, self.options.max_payload_bytes)
            if message is None:
                continue
            header, buffers = message
            call = self._pending.pop(header.call_id, None)
            if call is None:
                continue  # timed out or cancelled meanwhile
            if call.shared:
                shm.remove(n for n in call.shared if not shm.is_slot(n))  # normally adopted already
            for slot in call.lent:  # the callee has read its arguments: slots reusable
                self.slots.give_back(call.dest.id, slot)
            if call.timer is not None:
                call.timer.cancel()
            if not self._pending:
                self._no_pending.set()
            if isinstance(buffers, Exception):
                call.future._try_complete(
                    None, RpcError(f"cannot receive the result of {call.function}: {buffers}")
                )
            elif header.kind == wire.RESPONSE:
                try:
                    result = serialization.loads(header.payload, buffers)
                except Exception as exc:
                    call.future._try_complete(
                        None, SerializationError(f"cannot unpickle the result of {call.function}: {exc}")
                    )
                    continue
                call.future._try_complete(result, None)
            else:
                call.future._try_complete(None, _rebuild_error(header.payload, buffers, call))

    def _on_connection_lost(self, peer: transport.Link, reason: str) -> None:
        if self._peers.get(peer.peer.id) is peer:
            del self._peers[peer.peer.id]
        for call_id, call in list(self._pending.items()):
            if call.dest.id == peer.peer.id:
                self.rrefs.release_children(call.forks)  # the receiver is gone with them
                self._fail(
                    call_id,
                    WorkerUnavailableError(
                        f"lost the connection to worker {peer.peer.name} ({peer.address}) while calling "
                        f"{call.function}: {reason}"
                    ),
                )

    # ------------------------------------------------------------------ callee side
    def _on_request(self, session: _InboundSession, header: Any, buffers: list[memoryview]) -> None:
        if self._early_requests is not None:
            self._early_requests.append((session, header, buffers))
            return
        call_id = header.call_id
        if header.kind == wire.CANCEL:
            job = session.running.get(call_id)
            if job is not None:
                job.cancel()
            return
        if header.kind != wire.REQUEST:
            return
        function = header.function
        session.caller_rank = header.caller_rank
        try:
            if isinstance(buffers, Exception):
                raise buffers
            func, args, kwargs, *autograd_id = serialization.loads(header.payload, buffers)
        except Exception as exc:
            self._respond_error(session, call_id, function, exc, loading=True)
            return
        if autograd_id:  # run (and pickle the result) inside the caller's autograd context
            run_in = contextvars.copy_context()
            run_in.run(autograd_contexts.enter, autograd_id[0])
        else:
            run_in = None
        if getattr(func, INLINE_ATTR, False):  # rpcdist's own short, non-blocking handlers
            within = run_in.run if run_in is not None else _call
            try:
                result = within(func, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - goes back to the caller
                self._respond_error(session, call_id, function, exc)
                return
            if isinstance(result, asyncio.Future):  # answer once it settles (e.g. a loan returned)
                session.track(call_id, result)
                result.add_done_callback(lambda f: within(self._settle_inline, session, call_id, function, f))
                return
            within(self._respond, session, call_id, function, result)
            return
        if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
            getattr(func, "_wrapped_async_rpc_function", None)
        ):
            task = self.loop.create_task(
                self._run_async(session, call_id, function, func, args, kwargs), context=run_in
            )
            session.track(call_id, task)
            if header.timeout_seconds > 0:
                deadline = self.loop.call_later(header.timeout_seconds, task.cancel)
                task.add_done_callback(lambda _: deadline.cancel())  # don't pin finished calls
        else:
            job = _ThreadJob()
            session.track(call_id, job)
            deadline = time.monotonic() + header.timeout_seconds if header.timeout_seconds > 0 else None
            blocking = functools.partial(
                self._run_blocking, session, call_id, function, func, args, kwargs, job, deadline
            )
            self._pool.submit(blocking if run_in is None else functools.partial(run_in.run, blocking))

    def _settle_inline(self, session: _InboundSession, call_id: int, function: str, done: Any) -> None:
        session.untrack(call_id)
        if done.cancelled():
            return
        if done.exception() is not None:
            self._respond_error(session, call_id, function, done.exception())
        else:
            self._respond(session, call_id, function, done.result())

    async def _run_async(
        self, session: _InboundSession, call_id: int, function: str, func: Any, args: Any, kwargs: Any
    ) -> None:
        try:
            result = await func(*args, **kwargs)
            if is_async_execution(func):
                result = await _awaitable(result)
            self._respond(session, call_id, function, result)
        except asyncio.CancelledError:
            log.debug("%s: call %s to %s cancelled", self.info.name, call_id, function)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._respond_error(session, call_id, function, exc)
        finally:
            session.untrack(call_id)

    def _run_blocking(
        self,
        session: _InboundSession,
        call_id: int,
        function: str,
        func: Any,
        args: Any,
        kwargs: Any,
        job: _ThreadJob,
        deadline: float | None,
    ) -> None:
        """Runs on a pool thread."""
        if job.cancelled or (deadline is not None and time.monotonic() > deadline):
            self._inbox.post(lambda: session.untrack(call_id))
            return
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            self._inbox.post(lambda e=exc: self._finish_error(session, call_id, function, e))
            return
        if is_async_execution(func):
            self._inbox.post(lambda: self._finish_later(session, call_id, function, result))
            return
        try:
            entries = self._encode_result(session, call_id, function, result)
        except BaseException as exc:  # noqa: BLE001
            self._inbox.post(lambda e=exc: self._finish_error(session, call_id, function, e))
            return
        self._inbox.post(lambda: self._finish(session, call_id, entries))

    def _finish(self, session: _InboundSession, call_id: int, entries: Entries) -> None:
        session.untrack(call_id)
        session.respond(entries)

    def _finish_error(
        self, session: _InboundSession, call_id: int, function: str, exc: BaseException
    ) -> None:
        session.untrack(call_id)
        self._respond_error(session, call_id, function, exc)

    def _finish_later(self, session: _InboundSession, call_id: int, function: str, result: Any) -> None:
        async def complete() -> None:
            try:
                value = await _awaitable(result)
                self._respond(session, call_id, function, value)
            except asyncio.CancelledError:
                pass
            except BaseException as exc:  # noqa: BLE001
                self._respond_error(session, call_id, function, exc)
            finally:
                session.untrack(call_id)

        session.track(call_id, self.loop.create_task(complete()))

    def _pickle(self, obj: Any, what: str, peer: int) -> tuple[bytes, list[memoryview], list[int]]:
        """Pickle a message for ``peer`` within the size limit; returns it with the fork tokens
        of the RRefs inside, whose holds are given back if it cannot be sent. Inside a
        distributed autograd context, its tensors requiring grad are recorded as sends."""
        autograd_id = autograd_contexts.current_id() if self.autograd else None
        with capturing_forks() as forks, autograd_contexts.pickling_for(autograd_id, peer):
            try:
                payload, buffers = serialization.dumps(obj)
                size = len(payload) + sum(len(b) for b in buffers)
                if size > self.options.max_payload_bytes:
                    raise PayloadTooLargeError(
                        f"{what} carries {size} bytes, "
                        f"above max_payload_bytes={self.options.max_payload_bytes}"
                    )
            except BaseException:
                self.rrefs.release_children(forks)  # the RRefs in it never left
                raise
        return payload, buffers, forks

    def _encode_result(self, session: _InboundSession, call_id: int, function: str, result: Any) -> Entries:
        payload, buffers, _ = self._pickle(result, f"the result of {function}", session.caller_rank)
        shared = self._share(session.caller_rank, buffers)
        if shared:
            session.remember_exported(shared)
        return wire.encode_message(
            call_id, wire.RESPONSE, payload, buffers, chunk_bytes=self.options.chunk_bytes, shared=shared
        )

    def _respond(self, session: _InboundSession, call_id: int, function: str, result: Any) -> None:
        try:
            session.respond(self._encode_result(session, call_id, function, result))
        except BaseException as exc:  # noqa: BLE001
            self._respond_error(session, call_id, function, exc)

    def _respond_error(
        self, session: _InboundSession, call_id: int, function: str, exc: BaseException, loading: bool = False
    ) -> None:
        what = f"loading the call to {function}" if loading else function
        text = "".join(traceback.format_exception(exc))
        description = {
            "worker": self.info.name,
            "function": function,
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": f"{type(exc).__name__}: {exc}" + (f" (while {what})" if loading else ""),
            "traceback": text,
            "exception": b"",
        }
        # The exception travels as nested pickle bytes: if the caller cannot rebuild it (its
        # class exists only here), the description above still arrives intact.
        try:
            description["exception"] = pickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001 - unpicklable exception: the description stands in
            pass
        payload, buffers = serialization.dumps(description)
        session.respond(wire.encode_message(call_id, wire.ERROR, payload, buffers))


def _collect(
    assemblies: dict[int, wire.Assembly], env: Any, max_bytes: int
) -> tuple[Any, list[memoryview] | Exception] | None:
    """Feed one envelope; returns (header, buffers) once its message is complete.

    ``buffers`` is the exception instead when a shared-memory buffer could not be adopted.
    """
    if env.kind == wire.CHUNK:
        assembly = assemblies.get(env.call_id)
        if assembly is None:
            raise wire.FrameError(f"CHUNK for unknown message {env.call_id}")
        assembly.feed(env.data)
        if not assembly.complete:
            return None
        del assemblies[env.call_id]
    elif not env.buffer_sizes:
        return env, []
    else:
        assembly = wire.Assembly(env, max_bytes)
        if not assembly.complete:
            assemblies[env.call_id] = assembly
            return None
    return assembly.header, assembly.error or assembly.buffers


async def _awaitable(result: Any) -> Any:
    """Await what an ``async_execution`` function returned: our Future, torch's, or a coroutine."""
    if isinstance(result, Future) or inspect.isawaitable(result):
        return await result
    wait = getattr(result, "wait", None)
    if callable(wait) and hasattr(result, "add_done_callback"):  # torch.futures.Future
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        result.add_done_callback(lambda f: loop.call_soon_threadsafe(_settle, done))
        await done
        return result.wait()
    raise TypeError(
        f"an @async_execution function must return a Future or awaitable, not {type(result).__name__}"
    )


def _call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return func(*args, **kwargs)


@inline
def _ping() -> None:
    """Answered by every worker's loop; used to tell a dead peer from a slow one."""


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _rebuild_error(
    payload: bytes | memoryview, buffers: list[memoryview], call: _OutgoingCall
) -> BaseException:
    """The exception the caller sees: the remote type when it rebuilds here, else RemoteError."""
    try:
        info = serialization.loads(payload, buffers)
    except Exception as exc:
        return RemoteError(f"{call.function} failed on worker {call.dest.name} (error not readable: {exc})")
    where = f"on worker {info['worker']} in {info['function']}"
    exc: Any = None
    if info.get("exception"):
        try:
            exc = pickle.loads(info["exception"])
        except Exception:  # noqa: BLE001 - the class is not importable here
            exc = None
    if isinstance(exc, BaseException):
        return annotate_remote(exc, info["worker"], info["function"], info["traceback"])
    error = RemoteError(
        f"{info['message']} (raised {where})\nRemote traceback:\n{info['traceback']}",
        remote_type=info["type"],
        remote_traceback=info["traceback"],
    )
    error.remote_worker = info["worker"]  # type: ignore[attr-defined]
    error.remote_function = info["function"]  # type: ignore[attr-defined]
    return error
