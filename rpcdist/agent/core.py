"""The per-process agent: calls between workers, on one event loop, over the transport.

An :class:`Agent` joins three parts::

    Transport   (rpcdist.transport)  links to every peer, servers, shared memory
    Caller      (caller.py)          outgoing calls: ids, timeouts, replies, error rebuilding
    Callee      (callee.py)          incoming calls: dispatch to the loop or the thread pool

Layers above use only the methods here: ``submit`` a call, ``start_user_function`` /
``run_user_function`` to run a function the way calls run, ``on_loop`` to run code on the
loop in order, ``worker`` to resolve a name or rank. Distributed autograd rides along
through :attr:`extension` (see :mod:`rpcdist.agent.extensions`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from rpcdist import metrics, serialization
from rpcdist._runtime import wait_for
from rpcdist.agent.callee import Callee, awaitable
from rpcdist.agent.caller import Caller
from rpcdist.agent.codec import pickle_message
from rpcdist.agent.extensions import CallExtension, confirmation_gate
from rpcdist.agent.markers import RunAsCall, inline, is_async_execution, is_inline
from rpcdist.agent.options import RpcBackendOptions, WorkerInfo
from rpcdist.agent.status import SERVICE_NAME as STATUS_SERVICE
from rpcdist.agent.status import StatusServicer
from rpcdist.agent.threads import LoopInbox, WorkerPool
from rpcdist.errors import UnknownWorkerError, WorkerUnavailableError
from rpcdist.futures import Future
from rpcdist.rendezvous import Member, Rendezvous
from rpcdist.transport import Transport

log = logging.getLogger(__name__)

__all__ = ["Agent"]


class Agent:
    """One per process and role (RPC, or a process group's messages): serves calls from
    peers and sends this process's calls to them."""

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
        self.loop_thread_id = threading.get_ident()
        self.workers_by_rank: dict[int, WorkerInfo] = {}
        self.workers_by_name: dict[str, WorkerInfo] = {}
        self.addresses: dict[int, str] = {}
        self.extension: CallExtension | None = None
        self.pool = WorkerPool(options.num_worker_threads, f"rpcdist-{info.name}", loop)
        self.inbox = LoopInbox(loop)
        self.dynamic = False  # a group workers join and leave (rpcdist.rpc.elastic)
        self.closing = False
        self.serves_metrics = False  # whoever started it keeps a share of the metrics endpoint
        self._closed = False
        self._peer_lost_listeners: list[Callable[[WorkerInfo, str], None]] = []
        # Restricted mode: the allowlist is imported now, so a typo fails init, not a call later.
        self.allowed = serialization.resolve_allowlist(options.allowlist) if options.restricted else {}
        # Further counts for status() from the layers above (the RRef table's debug_info).
        self.status_sources: list[Callable[[], dict[str, int]]] = []
        self.caller = Caller(self)
        self.callee = Callee(self)
        self.transport = Transport(
            info.name,
            self.caller,
            self.callee.new_session,
            make_channel_session=self.callee.new_channel_session,
            shm_threshold_bytes=options.shm_threshold_bytes,
            unix_sockets=options.transport != "grpc",
            tcp_links=options.transport == "tcp",
            heartbeat_interval=options.heartbeat_interval,
            heartbeat_misses=options.heartbeat_misses,
            security=rendezvous.security,
        )
        metrics.track(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def shm_probe(self) -> str:
        return self.transport.shm_probe

    @property
    def unix_path(self) -> str:
        return self.transport.unix_path

    async def serve(self, host: str) -> int:
        """Start serving peers on ``host`` (ephemeral port); returns the gRPC port. The same
        server answers ``rpcdist.v1.Status`` (see :meth:`status`), health checks and reflection."""
        return await self.transport.start(host, [(STATUS_SERVICE, StatusServicer(self).add_to)])

    def status(self) -> dict[str, Any]:
        """What this worker is doing now: ``name``, ``rank``, ``counts`` (``calls_in_flight``:
        calls it made that have not ended; ``calls_running``: peers' calls it runs; plus the
        layers' own, e.g. ``rpc.debug_info()``) and ``peers`` (see ``Transport.peer_states``)."""
        counts = {
            "calls_in_flight": len(self.caller.pending),
            "calls_running": sum(len(session.running) for session in list(self.callee.sessions)),
        }
        for source in list(self.status_sources):
            counts.update(source())
        return {
            "name": self.info.name,
            "rank": self.info.id,
            "counts": counts,
            "peers": self.transport.peer_states(),
        }

    def card(self, advertise_host: str) -> dict[str, str]:
        """What this worker publishes at rendezvous so peers can reach it."""
        return self.transport.card(advertise_host)

    def set_members(self, members: list[Member]) -> None:
        """Learn the group; calls that arrived before this (from peers that finished joining
        first) run now, in arrival order."""
        peers = []
        for member in members:
            info = WorkerInfo(member.name, member.rank)
            self.workers_by_rank[member.rank] = info
            self.workers_by_name[member.name] = info
            self.addresses[member.rank] = member.address
            peers.append(Transport.peer_from_card(member.rank, member.name, member.card))
        self.transport.set_peers(peers)
        self.callee.group_known()

    def add_member(self, member: Member) -> None:
        """A worker joined the (dynamic) group: it can be called from now on."""
        info = WorkerInfo(member.name, member.rank)
        self.workers_by_rank[member.rank] = info
        self.workers_by_name[member.name] = info
        self.addresses[member.rank] = member.address
        self.transport.set_peers([Transport.peer_from_card(member.rank, member.name, member.card)])

    def remove_member(self, rank: int) -> None:
        """A worker left the (dynamic) group: calls to it fail as to an unknown worker."""
        info = self.workers_by_rank.pop(rank, None)
        if info is not None and self.workers_by_name.get(info.name) == info:
            del self.workers_by_name[info.name]
        self.addresses.pop(rank, None)
        self.transport.forget_peer(rank)

    async def wait_for_outstanding(self, timeout: float | None) -> None:
        """Wait until every call this worker made has completed (or ``timeout`` passes)."""
        try:
            await wait_for(self.caller.wait_idle(), timeout)
        except asyncio.TimeoutError:
            log.warning(
                "%s: %d calls still outstanding at shutdown", self.info.name, len(self.caller.pending)
            )

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
        """Close links, servers and threads. Outstanding calls fail with WorkerUnavailableError."""
        if self._closed:
            return
        self.closing = True
        self.caller.flush_deferred()  # (notices kept to go out with the next message)
        self.callee.close()
        await self.transport.close(graceful)
        self.caller.fail_all(lambda _: WorkerUnavailableError(f"worker {self.info.name} shut down"))
        self.pool.shutdown(timeout=1.0 if graceful else 0.1)
        self._closed = True

    # ------------------------------------------------------------------ what layers above use
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
                raise UnknownWorkerError(  # torch's wording: "could not find destination"
                    f"could not find destination: no worker named {to!r}; "
                    f"known workers: {sorted(self.workers_by_name)}"
                )
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers_by_rank.get(to)
            if info is None:
                known = sorted(self.workers_by_rank) if self.dynamic else f"0..{self.world_size - 1}"
                raise UnknownWorkerError(f"no worker with rank {to}; ranks are {known}")
            return info
        if isinstance(to, float):  # a ValueError, as in torch (an UnknownWorkerError is one)
            raise UnknownWorkerError(f"no worker with rank {to!r}: a rank is an int")
        raise TypeError(f"`to` must be a worker name, rank or WorkerInfo, not {type(to).__name__}")

    def is_colocated(self, rank: int) -> bool:
        """Whether ``rank`` shares this host's /dev/shm (so shared memory reaches it)."""
        return self.transport.is_colocated(rank)

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
        """Call ``func(*args, **kwargs)`` on ``to`` from any thread; returns its Future.

        ``timeout`` in seconds (negative: the default ``rpc_timeout``, 0: none). Raises at
        once on bad input (unknown worker, unpicklable arguments, too large). ``waited``,
        ``pulled`` and ``asks_value``: see ``Caller.submit``.
        """
        return self.caller.submit(
            to,
            func,
            args,
            kwargs,
            timeout,
            function_name=function_name,
            waited=waited,
            pulled=pulled,
            asks_value=asks_value,
        )

    def notify(
        self,
        to: str | int | WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        function_name: str,
        track: bool = False,
        deferred: bool = False,
        plain: bool = False,
    ) -> Future[None] | None:
        """Have ``to`` run ``func(*args)`` and answer nothing: for rpcdist's own short loop-side
        handlers (``@inline``) whose caller does not wait, such as the release of a
        distributed autograd context. Half the messages of a call; ordered after the calls
        this thread submitted before; a failure is logged on ``to``; a notice to a peer that
        is gone is dropped. Small arguments only: tensors and arrays up to
        ``caller.NOTICE_MAX_BUFFER_BYTES`` in all, carried in the message itself.

        ``track``: return a Future that completes once the notice is written to the link (a
        process that waits for it may exit without losing the notice) or fails once it never
        will be; else None. ``deferred``: it may go out ahead of the next message to ``to``;
        ``plain``: ``args`` are plain Python values (see ``Caller.notify``)."""
        if not is_inline(func):
            raise ValueError(f"only rpcdist's own inline handlers are sent as notices, not {function_name}")
        return self.caller.notify(to, func, args, function_name, track, deferred, plain)

    def on_peer_lost(self, listener: Callable[[WorkerInfo, str], None]) -> None:
        """Call ``listener(peer, reason)`` on the loop whenever the link to a peer is lost
        (it died, left, or the connection broke). Pending calls to it fail on their own; this
        is for waits that are not calls, such as a receive of the peer's next message."""
        self._peer_lost_listeners.append(listener)

    def watch(self, rank: int) -> None:
        """Make sure a link to ``rank`` is open (loop only), so that its loss is noticed even
        when this worker never calls it. Unknown ranks and a closed agent are ignored."""
        if self.closing or rank == self.info.id or rank not in self.workers_by_rank:
            return
        try:
            self.transport.link(rank)
        except Exception as exc:  # noqa: BLE001 - closed or unknown: nothing to watch
            log.debug("%s: cannot watch rank %d: %s", self.info.name, rank, exc)

    def peer_lost(self, rank: int, reason: str) -> None:
        """The transport lost the link to ``rank``: tell the listeners (loop only)."""
        peer = self.workers_by_rank.get(rank)
        if peer is None or self.closing:
            return
        for listener in list(self._peer_lost_listeners):
            try:
                listener(peer, reason)
            except Exception:  # a listener's bug must not keep the others from hearing it
                log.exception("peer-lost listener %r failed", listener)

    def on_loop(self, fn: Callable[[], Any], sends: bool = True) -> None:
        """Run ``fn`` on the loop, after anything posted before it (from any thread).
        ``sends=False``: it sends no call or notice (see ``LoopInbox.post``)."""
        if threading.get_ident() == self.loop_thread_id and not self.inbox.pending:
            fn()
        else:
            self.inbox.post(fn, sends)

    def pickle(
        self, obj: Any, what: str, peer: int, state: Any = None, *, outgoing: bool = False
    ) -> tuple[bytes, list[memoryview], list[Callable[[], None]]]:
        """Pickle a message for ``peer`` within the size limit (see ``codec.pickle_message``).
        ``outgoing``: a call or notice on this worker's own link to ``peer`` (not an answer)."""
        reducer = self.extension.tensor_reducer(state, peer) if self.extension is not None else None
        receiver = peer if peer != self.info.id else None
        ordered_to = receiver if outgoing else None
        return pickle_message(obj, what, self.options.max_payload_bytes, reducer, ordered_to, receiver)

    def decode(self, payload: bytes | memoryview, buffers: Any = ()) -> Any:
        """Unpickle a message from a peer (restricted when the options say so)."""
        return serialization.loads(payload, buffers, self.options.restricted, self.allowed)

    def start_user_function(
        self, func: Callable[..., Any], args: Any, kwargs: Any, made: Callable[[Any], None] | None = None
    ) -> asyncio.Future[Any]:
        """Start a user function the way calls run (``async def`` on the loop, others on the
        pool, in the current contextvars context); returns a future of its result. Loop only.
        ``made``: see ``_on_pool`` (a plain function's, or the one an inline handler runs as
        the call: ``RunAsCall``).

        Inside a call whose arguments await their owners' confirmation (``confirmation_gate``),
        the function starts once they have arrived."""
        waits = confirmation_gate.get() is not None
        if waits or inspect.iscoroutinefunction(func) or is_async_execution(func):
            return self.loop.create_task(self.run_user_function(func, args, kwargs))
        if is_inline(func):  # one of rpcdist's own loop-side handlers
            done = self.loop.create_future()
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001
                done.set_exception(exc)
                return done
            if isinstance(result, RunAsCall):
                return self.start_user_function(*result, made=made)
            if isinstance(result, asyncio.Future):
                return result
            done.set_result(result)
            return done
        return self._on_pool(func, args, kwargs, made)

    async def run_user_function(
        self, func: Callable[..., Any], args: Any, kwargs: Any, made: Callable[[Any], None] | None = None
    ) -> Any:
        """Run a user function the way calls run: ``async def`` on the loop, others on the pool
        (after the confirmations the call waits for, if any: see ``start_user_function``).
        ``made(result)``: run on the pool thread once a plain function has returned a result
        that needs no awaiting, before the loop learns it (see ``_on_pool``)."""
        gate = confirmation_gate.get()
        if gate is not None:
            await gate  # raises the gate's error: the function does not run
            confirmation_gate.set(None)  # (this task's own context: what it starts need not wait)
        if inspect.iscoroutinefunction(func):
            result = await func(*args, **kwargs)
        elif is_inline(func):
            result = await self.start_user_function(func, args, kwargs, made)
        else:
            result = await self._on_pool(func, args, kwargs, None if is_async_execution(func) else made)
        if is_async_execution(func) or inspect.isawaitable(result):
            result = await awaitable(result)
        return result

    def _on_pool(
        self, func: Callable[..., Any], args: Any, kwargs: Any, made: Callable[[Any], None] | None = None
    ) -> asyncio.Future[Any]:
        """Run a blocking function on the worker pool (keeping the current contextvars).
        ``made(result)`` runs on that thread first, if the result needs no awaiting: whoever
        waits there for it (an RRef's fetch) is answered without waking the loop."""
        done = self.loop.create_future()

        def run() -> None:
            try:
                result: Any = func(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001
                self.inbox.post(lambda e=exc: done.done() or done.set_exception(e))
                return
            if made is not None and not inspect.isawaitable(result):
                try:
                    made(result)
                except Exception:  # noqa: BLE001 - the loop still settles the result below
                    log.exception("%s: answering the waiters of a result failed", self.info.name)
            self.inbox.post(lambda: done.done() or done.set_result(result))

        self.pool.submit(functools.partial(contextvars.copy_context().run, run))
        return done


@serialization.trust
@inline
def _ping() -> None:
    """Answered by every worker's loop; used to tell a dead peer from a slow one."""
