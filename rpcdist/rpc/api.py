"""The public RPC functions (``rpcdist.rpc``), with torch.distributed.rpc's signatures.

Blocking forms work from plain threads; ``*_async`` forms and returned Futures are awaitable.
``init_rpc`` runs the agent's event loop in a background thread; ``await init_rpc_async``
runs it on the caller's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rpcdist import metrics
from rpcdist import rendezvous as rdv
from rpcdist._runtime import (
    acquire_loop,
    call_blocking,
    release_loop,
    stray_cancellation,
    wait_for,
    wait_grpc_poller_gone,
    wait_grpc_poller_gone_async,
)
from rpcdist.agent import Agent, current_agent, set_current_agent
from rpcdist.agent.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT,
    BackendType,
    RpcBackendOptions,
    WorkerInfo,
)
from rpcdist.autograd import _contexts as autograd_contexts
from rpcdist.errors import RpcError
from rpcdist.futures import Future, stop_callback_threads, stop_callback_threads_async
from rpcdist.rpc import elastic, profiling
from rpcdist.rpc import rref as rrefs
from rpcdist.rpc.profiling import function_name, profiled, profiling_key
from rpcdist.store import PrefixStore

log = logging.getLogger(__name__)

__all__ = [
    "init_rpc",
    "init_rpc_async",
    "shutdown",
    "shutdown_async",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
    "get_all_worker_infos",
    "is_available",
    "get_rpc_timeout",
    "backend_registered",
    "construct_rpc_backend_options",
]

_agent: Agent | None = None  # also rpcdist.agent.current_agent(), for the layers below
_owns_loop = False
_lock = threading.Lock()
_STORE_PREFIX = "rpc"


def _install(agent: Agent | None) -> None:
    global _agent
    _agent = agent
    set_current_agent(agent)


def _check_init_arguments(backend: Any, options: Any) -> None:
    """TypeErrors for arguments of the wrong kind, in torch's words (which its users match)."""
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType, not {backend!r}")
    if options is not None and not isinstance(options, RpcBackendOptions):
        kind = type(options).__name__
        raise TypeError(f"Argument rpc_backend_options must be an instance of RpcBackendOptions, not {kind}")
    if backend is None and options is not None and type(options) is not RpcBackendOptions:
        # a subclass of someone else's: its backend is not rpcdist's to guess
        raise TypeError(f"Could not infer backend for options {type(options).__name__}: pass backend=")


async def init_rpc_async(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join the group as ``name``; everything runs on the calling event loop."""
    _check_init_arguments(backend, rpc_backend_options)
    if _agent is not None:
        raise RpcError(f"RPC is already initialized in this process (as {_agent.info.name})")
    options = rpc_backend_options or RpcBackendOptions()
    dynamic = elastic.is_dynamic_request(world_size)
    if dynamic:  # a group workers join and leave (see rpcdist.rpc.elastic)
        rank = -1 if rank is None else rank
    else:
        rank, world_size = rdv.resolve_rank_and_size(rank, world_size)
    loop = asyncio.get_running_loop()
    timeout = options.store_timeout
    metrics_port = options.resolved_metrics_port()
    meeting = await rdv.rendezvous(options.init_method, rank, world_size or 1, timeout, options.security())
    listen = options.listen_host or _default_listen_host(meeting.host)
    if metrics_port is not None:
        try:
            metrics.enable(metrics_port, listen)
        except BaseException:
            await meeting.close()
            raise
    if dynamic:
        try:
            rank = await elastic.claim(PrefixStore(_STORE_PREFIX, meeting.store), name, rank)
        except BaseException:
            await meeting.close()
            if metrics_port is not None:
                metrics.release()
            raise
    agent = Agent(WorkerInfo(name, rank), world_size or 0, options, meeting, loop)
    agent.dynamic = dynamic
    agent.extension = autograd_contexts.CALL_EXTENSION  # calls carry the autograd context
    autograd_contexts.set_worker_rank(rank)
    profiling.install()  # calls made under torch's profilers bring the callee's events back
    if hasattr(torch._C, "_distributed_rpc"):  # node_id of this worker's profiler events, as torch
        torch._C._distributed_rpc._set_profiler_node_id(rank)
    # Installed before serving: peers may call (and send RRefs) as soon as all have joined,
    # which can be before join_group returns here.
    rrefs.attach(agent)
    _install(agent)
    agent.serves_metrics = metrics_port is not None
    try:
        port = await agent.serve(listen)
        advertise = options.advertise_host or (
            listen if listen != "0.0.0.0" else rdv.local_address_towards(meeting.host or "8.8.8.8")
        )
        store = PrefixStore(_STORE_PREFIX, meeting.store)
        if dynamic:
            members = await elastic.enter(agent, store, agent.card(advertise), timeout)
        else:
            members = await rdv.join_group(store, name, rank, world_size, agent.card(advertise), timeout)
            agent.set_members(members)
    except BaseException:
        _install(None)
        rrefs.detach()
        await agent.close(graceful=False)
        await meeting.close()
        if metrics_port is not None:
            metrics.release()
        raise
    if dynamic:
        log.info("%s (rank %d) joined a dynamic group, %d present; port %d", name, rank, len(members), port)
    else:
        log.info("%s (rank %d of %d) serving on port %d", name, rank, world_size, port)


def _default_listen_host(store_host: str | None) -> str:
    if store_host is None or rdv.is_loopback(store_host):
        return os.environ.get("RPCDIST_HOST", "127.0.0.1")
    return "0.0.0.0"


def init_rpc(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join the group as ``name`` (blocking; the event loop runs in a background thread).

    Returns once all ``world_size`` workers have joined. With ``world_size=None`` (and no
    WORLD_SIZE in the environment) it joins a *dynamic* group instead: it returns once every
    member present knows it, and ``shutdown()`` leaves the group while the others go on (see
    :mod:`rpcdist.rpc.elastic`; ``rank`` may then be omitted: a free one is drawn).
    """
    global _owns_loop
    with _lock:
        loop = acquire_loop()
        try:
            call_blocking(loop, init_rpc_async(name, backend, rank, world_size, rpc_backend_options))
        except BaseException:
            release_loop(loop)
            raise
        _owns_loop = True


async def shutdown_async(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the group.

    ``graceful`` first waits until every worker has finished its outstanding calls and reached
    shutdown (a store barrier), so no call is cut off. ``timeout`` (seconds) bounds that wait;
    0 waits as long as the missing workers are alive (a worker that died ends the wait with a
    warning, never a hang). ``graceful=False`` closes at once.
    """
    await _shutdown(graceful, timeout, wait_for_threads=True)


async def _shutdown(graceful: bool, timeout: float, wait_for_threads: bool) -> None:
    """``wait_for_threads``: return once rpcdist's threads (``then`` callbacks, grpc's poller)
    have ended; the blocking form waits for them itself, after the loop has stopped."""
    agent = _agent
    if agent is None:
        return
    limit = timeout if timeout and timeout > 0 else None
    deadline = None if limit is None else time.monotonic() + limit

    def remaining() -> float | None:
        return None if deadline is None else max(0.1, deadline - time.monotonic())

    store = PrefixStore(_STORE_PREFIX, agent.rendezvous.store)
    dead: list[int] = []
    try:
        if graceful and agent.dynamic:
            # Leave the group; the others go on (no barrier with them).
            await agent.wait_for_outstanding(remaining())
            rrefs.release_all_users()
            try:
                await elastic.leave(agent, store, remaining())
            except Exception as exc:
                log.warning("%s: leaving the group failed: %s", agent.info.name, exc)
            graceful_exit = False
        else:
            graceful_exit = graceful
        if graceful_exit:
            await agent.wait_for_outstanding(remaining())
            try:
                # Every live worker reaches shutdown before any leaves (a dead one is left out).
                dead = await rdv.barrier(
                    store, "shutdown", agent.info.id, agent.world_size, remaining(), agent.find_dead
                )
            except Exception as exc:  # out of time, or the store is gone: still close below
                log.warning("%s: shutdown barrier failed: %s", agent.info.name, exc)
            except asyncio.CancelledError:
                if not stray_cancellation():
                    raise
                log.warning("%s: shutdown barrier: a store call was cancelled", agent.info.name)
            # Only now, as torch (after its _wait_all_workers): until every worker has reached
            # shutdown, a peer may still fetch a value this worker owns and so fork the user
            # RRefs inside it, which must then still be held. (Not waited for: every owner is
            # leaving too, and frees what it owns as it does.)
            rrefs.release_all_users()
        await agent.close(graceful)
        rrefs.detach()
        if graceful_exit:
            # The worker hosting the store keeps serving it until every live worker has passed
            # the shutdown barrier (they are all on their way out: this takes moments).
            try:
                if agent.rendezvous.server is not None:
                    await rdv.check_in(store, "exit", agent.info.id)
                    live = [r for r in range(agent.world_size) if r not in dead]
                    await rdv.wait_checked_in(store, "exit", live, min(remaining() or 30.0, 30.0))
                else:  # one message; if the store host is gone there is nobody left to tell
                    await wait_for(rdv.check_in(store, "exit", agent.info.id), 10.0)
            except Exception as exc:
                log.warning("%s: exit barrier failed: %s", agent.info.name, exc)
            except asyncio.CancelledError:
                if not stray_cancellation():
                    raise
                log.warning("%s: exit barrier: a store call was cancelled", agent.info.name)
        await agent.rendezvous.close()
    except BaseException:
        # Cancelled or failed half-way: close everything anyway, so nothing stays serving.
        await asyncio.shield(_close_quietly(agent))
        raise
    finally:
        if agent.serves_metrics:
            agent.serves_metrics = False
            metrics.release()
        _install(None)
        elastic.reset()
        rrefs.detach()
        autograd_contexts.clear()
        autograd_contexts.set_worker_rank(-1)
        del agent  # (its servers and channels go with it: grpc's poller thread then ends)
        if wait_for_threads:
            await stop_callback_threads_async(timeout=5.0)  # their callbacks' RPCs have ended
            await wait_grpc_poller_gone_async()
        else:
            stop_callback_threads()  # (waited for by the blocking form, once the loop stopped)


async def _close_quietly(agent: Agent) -> None:
    try:
        await agent.close(graceful=False)
        await agent.rendezvous.close()
    except Exception as exc:
        log.debug("closing after a failed shutdown: %s", exc)


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Blocking form of :func:`shutdown_async`; also stops the background loop thread."""
    global _owns_loop
    with _lock:
        agent = _agent
        if agent is None:
            return
        loop = agent.loop
        try:
            # The caller's references to the agent (and so its grpc objects) go only here, once
            # the loop has stopped: the waits for rpcdist's threads come after that.
            call_blocking(loop, _shutdown(graceful, timeout, wait_for_threads=False))
        finally:
            stop_callback_threads(timeout=5.0)  # their callbacks' RPCs have all ended by now
            if _owns_loop:
                _owns_loop = False
                release_loop(loop)
            del agent, loop  # the last references to its grpc objects, once the loop has stopped
            wait_grpc_poller_gone()


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> Future[Any]:
    """Call ``func(*args, **kwargs)`` on worker ``to``; returns a Future of the result.

    ``timeout`` in seconds: -1 uses the default ``rpc_timeout``, 0 waits without limit.
    """
    future = start_call("async", to, func, args, kwargs, timeout)
    collecting = getattr(_thread_local_var, "future_list", None)
    if collecting is not None:  # inside _wait_all()
        collecting.append(future)
    return future


# torch's private helpers that torch users (and torch's tests) reach for; thin forms of public
# behaviour: the default timeout, and waiting for every rpc_async of a block.
_thread_local_var = threading.local()


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout (seconds; 0: none) of the calls made from now on."""
    current_agent().options.rpc_timeout = float(rpc_timeout)


_wait_all_workers_rounds = itertools.count()


def _wait_all_workers(timeout: float = 0) -> None:
    """Block until every worker has reached this call and this worker's outstanding calls have
    ended (the first half of a graceful shutdown). ``timeout`` in seconds, 0: none."""
    agent = current_agent()
    name = f"wait_all_workers/{next(_wait_all_workers_rounds)}"
    limit = timeout if timeout and timeout > 0 else None

    async def wait() -> None:
        await agent.wait_for_outstanding(limit)
        store = PrefixStore(_STORE_PREFIX, agent.rendezvous.store)
        await rdv.barrier(store, name, agent.info.id, agent.world_size, limit, agent.find_dead)

    call_blocking(agent.loop, wait())


_barrier_rounds: dict[tuple[str, ...], itertools.count[int]] = {}
_barrier_lock = threading.Lock()


def _barrier(worker_names: list[str], timeout: float = -1.0) -> None:
    """Block until every worker of ``worker_names`` has made its matching call (the n-th call
    of each for one set of names meets the others' n-th). ``timeout`` in seconds: -1 the default
    ``rpc_timeout``, 0 none."""
    agent = current_agent()
    names = tuple(sorted(set(worker_names)))
    with _barrier_lock:
        meeting = next(_barrier_rounds.setdefault(names, itertools.count()))
    key = f"barrier/{','.join(names)}/{meeting}"
    seconds = agent.options.rpc_timeout if timeout < 0 else timeout

    async def wait() -> None:
        store = PrefixStore(_STORE_PREFIX, agent.rendezvous.store)
        if await store.add_async(key, 1) == len(names):
            await store.set_async(f"{key}/all", b"1")
        await store.get_async(f"{key}/all", timeout=seconds if seconds > 0 else None)

    call_blocking(agent.loop, wait())


class _AgentView:
    """What torch's private ``_get_current_rpc_agent()`` gives its users: the group's workers
    and debug counters (rpcdist's public ``get_worker_info``/``get_all_worker_infos``/``debug_info``)."""

    def get_worker_info(self, name: str | None = None) -> WorkerInfo:
        return get_worker_info(name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        return get_all_worker_infos()

    def get_debug_info(self) -> dict[str, Any]:
        return {f"rref.{key}": value for key, value in rrefs.debug_info().items()}


def _get_current_rpc_agent() -> _AgentView:
    """torch's private accessor of the running agent (the calls it offers: see _AgentView)."""
    current_agent()  # raises if RPC is not initialized, as torch's
    return _AgentView()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Within: every ``rpc_async`` of this thread is collected; on exit, wait for them all
    (``torch.futures.wait_all``: the first failure is raised)."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def start_call(
    mode: str,
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
    *,
    waited: bool | None = None,
    pulled: bool = False,
) -> Future[Any]:
    """Start a call as ``rpc_sync`` (``mode="sync"``) or ``rpc_async`` (``"async"``) do,
    profiled under that name while a profiler runs. ``waited``: the calling thread waits for
    it next, so it may write the call itself (default: ``mode == "sync"``); ``pulled``: and
    nothing else waits for the Future (see ``Caller.submit``)."""
    agent = current_agent()
    if not torch.autograd._profiler_enabled():
        waits = mode == "sync" if waited is None else waited
        return agent.submit(to, func, args, kwargs, timeout, waited=waits, pulled=pulled)
    return profiling.profiled_call(agent, mode, to, func, args, kwargs, timeout)


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and wait for the result.

    Raises the remote exception (with the remote traceback attached) or RpcTimeoutError.
    """
    return start_call("sync", to, func, args, kwargs, timeout, pulled=True).wait()


def remote(
    to: str | int | WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> Any:
    """Run ``func`` on ``to`` and keep the result there; returns an RRef to it."""
    agent = current_agent()
    if not torch.autograd._profiler_enabled():
        return rrefs.create_remote(agent, to, func, args, kwargs, timeout)
    made: list[Any] = []

    def start() -> Future[Any]:
        made.append(rrefs.create_remote(agent, to, func, args, kwargs, timeout))
        confirmation = made[0]._confirmed
        if confirmation is None:  # already confirmed (a very quick call to ourselves)
            confirmation = Future()
            confirmation.set_result(None)
        return confirmation

    profiled(
        lambda: profiling_key("remote", function_name(func), agent.info.name, agent.worker(to).name), start
    )
    return made[0]


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """This worker's WorkerInfo, or that of ``worker_name``."""
    agent = current_agent()
    if worker_name is None:
        return agent.info
    return agent.worker(worker_name)


def get_all_worker_infos() -> list[WorkerInfo]:
    """Every worker of the group, by rank (in a dynamic group: the members present now)."""
    return elastic.get_worker_infos()


def is_available() -> bool:
    """True: rpcdist's RPC is always built (torch's answer depends on its build)."""
    return True


def get_rpc_timeout() -> float:
    """The default timeout of this worker's calls, in seconds (``rpc_timeout`` of its
    ``RpcBackendOptions``; 0 means none). RpcError if RPC is not initialized."""
    return float(current_agent().options.rpc_timeout)


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` names an RPC backend (``"TENSORPIPE"`` or ``"GRPC"``, both
    rpcdist's gRPC transport)."""
    return backend_name in BackendType.__members__


def construct_rpc_backend_options(
    backend: BackendType,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    init_method: str = DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> RpcBackendOptions:
    """The options ``init_rpc`` takes for ``backend``, built from these arguments (``kwargs``
    are further :class:`RpcBackendOptions` fields, e.g. ``num_worker_threads``)."""
    if not isinstance(backend, BackendType):
        raise TypeError(f"backend must be an rpc.BackendType, not {backend!r}")
    return RpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)
