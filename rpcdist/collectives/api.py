"""torch.distributed's c10d functions, over rpcdist's transport.

``import rpcdist as dist`` and code written for ``import torch.distributed as dist`` runs::

    dist.init_process_group("gloo", rank=rank, world_size=size)   # backend name accepted
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    work = dist.isend(t, dst=1); work.wait()
    await dist.all_reduce(t, async_op=True)                       # inside async code

Every blocking call honours the process group's ``timeout`` and raises a clear error instead of
hanging; ``async_op=True`` returns a :class:`~rpcdist.collectives.work.Work`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import pdb
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NewType
from urllib.parse import urlparse, urlunparse

import torch
from torch.distributed import DebugLevel

from rpcdist import _launch_env, metrics
from rpcdist import rendezvous as rdv
from rpcdist._runtime import acquire_loop, call_blocking, current_loop, release_loop, stray_cancellation
from rpcdist.agent import Agent, RpcBackendOptions, WorkerInfo
from rpcdist.collectives import algorithms as algo
from rpcdist.collectives.group import (
    DEFAULT_TIMEOUT,
    CollectiveTimeoutError,
    DistributedError,
    ProcessGroup,
    _State,
    current_state,
    set_state,
    watch_peers,
)
from rpcdist.collectives.loans import Loan
from rpcdist.collectives.reduce_ops import ReduceOp, check_op, reduce_op
from rpcdist.collectives.work import Work
from rpcdist.errors import BlockingCallError
from rpcdist.futures import Future, stop_callback_threads
from rpcdist.store import PrefixStore, Store

log = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "CollectiveTimeoutError",
    "DistributedError",
    "GroupMember",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "destroy_process_group_async",
    "gather",
    "gather_object",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "init_process_group_async",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]

_init_lock = threading.Lock()
_STORE_PREFIX = "c10d"
# Run after init_process_group and before destroy_process_group (torch_backend keeps torch's
# default group in step with rpcdist's through them).
_init_hooks: list[Callable[[], None]] = []
_destroy_hooks: list[Callable[[], None]] = []


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in list(hooks):
        try:
            hook()
        except Exception:
            log.exception("a process-group hook failed")


class Backend:
    """Backend names. rpcdist has one (gRPC); ``"gloo"`` is accepted so torch code runs as is."""

    GRPC = "grpc"
    GLOO = "gloo"


class GroupMember:
    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = object()


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    """Whether ``init_process_group`` has run in this process."""
    from rpcdist.collectives import group

    return group._state is not None


# ------------------------------------------------------------------------------- lifecycle
def _seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


async def init_process_group_async(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    auth_token: str | None = None,
) -> None:
    """The awaitable form of :func:`init_process_group` (runs on the calling loop)."""
    await _init(
        backend,
        init_method,
        timeout,
        world_size,
        rank,
        store,
        asyncio.get_running_loop(),
        False,
        pg_options,
        auth_token,
    )
    _run_hooks(_init_hooks)


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    auth_token: str | None = None,
) -> None:
    """Join the default process group (blocks until all ``world_size`` ranks have joined).

    ``init_method``: ``env://`` (default; MASTER_ADDR/MASTER_PORT), ``tcp://host:port`` or
    ``file:///path``; or pass a ``store``. ``backend`` may be ``"grpc"`` or ``"gloo"``.
    ``pg_options``: an :class:`~rpcdist.rpc.RpcBackendOptions` whose transport settings
    (``transport``, ``shm_threshold_bytes``, heartbeats, hosts, chunk and payload sizes) the
    group's messages use; its init method and timeouts come from the arguments here.
    ``auth_token``: the job's shared secret (default: ``pg_options.auth_token``, then
    ``RPCDIST_AUTH_TOKEN``/``RPCDIST_AUTH_TOKEN_FILE``; on one host, a generated one).
    """
    with _init_lock:
        loop = acquire_loop()
        try:
            call_blocking(
                loop,
                _init(
                    backend, init_method, timeout, world_size, rank, store, loop, True, pg_options, auth_token
                ),
            )
        except BaseException:
            release_loop(loop)
            raise
    _run_hooks(_init_hooks)


async def _init(
    backend: str | None,
    init_method: str | None,
    timeout: float | timedelta | None,
    world_size: int,
    rank: int,
    store: Store | None,
    loop: asyncio.AbstractEventLoop,
    owns_loop: bool,
    pg_options: Any = None,
    auth_token: str | None = None,
) -> None:
    from rpcdist.collectives import group

    if group._state is not None:
        raise DistributedError("the default process group is already initialized")
    name = (backend or Backend.GRPC).lower()
    if name not in (Backend.GRPC, Backend.GLOO):
        raise DistributedError(f"backend {backend!r} is not available: rpcdist runs 'grpc' (alias 'gloo')")
    if store is None:  # an init_method scheme registered with register_rendezvous_handler
        store, rank, world_size = await _registered_rendezvous(init_method, rank, world_size, timeout)
    rank, world_size = rdv.resolve_rank_and_size(rank, world_size if world_size > 0 else None)
    seconds = _seconds(timeout)
    if pg_options is not None and not isinstance(pg_options, RpcBackendOptions):
        raise DistributedError(
            f"pg_options must be rpcdist's RpcBackendOptions (its transport settings), not "
            f"{type(pg_options).__name__}"
        )
    options = dataclasses.replace(
        pg_options or RpcBackendOptions(),
        init_method=init_method or "env://",
        rpc_timeout=0,
        store_timeout=min(seconds, 300),
    )
    if auth_token is not None:
        options = dataclasses.replace(options, auth_token=auth_token)
    if store is not None:  # the caller's store: only a configured token protects the links
        meeting = rdv.Rendezvous(store, None, None, options.security())
    else:
        meeting = await rdv.rendezvous(
            options.init_method, rank, world_size, options.store_timeout, options.security()
        )
    agent = Agent(WorkerInfo(f"c10d-rank{rank}", rank), world_size, options, meeting, loop)
    metrics_port = options.resolved_metrics_port()
    if metrics_port is not None:  # shared with RPC's when both run in this process
        metrics.enable(metrics_port, options.listen_host or _listen_host(meeting.host))
        agent.serves_metrics = True
    state = _State(rank, world_size, name, seconds, agent, loop, owns_loop, store=meeting.store)
    state.world = ProcessGroup(state, 0, list(range(world_size)), seconds)
    watch_peers(state)
    set_state(state)  # before serving: peers may send as soon as everyone has joined
    try:
        await agent.serve(options.listen_host or _listen_host(meeting.host))
        advertise = options.listen_host or _listen_host(meeting.host)
        if advertise == "0.0.0.0":
            advertise = rdv.local_address_towards(meeting.host or "8.8.8.8")
        card = agent.card(advertise)
        members = await rdv.join_group(
            PrefixStore(_STORE_PREFIX, meeting.store),
            agent.info.name,
            rank,
            world_size,
            card,
            options.store_timeout,
        )
        agent.set_members(members)
        # Everyone has read the membership before anyone goes on (as torch's store barrier at
        # the end of init): rank 0 may otherwise finish and exit, taking the store with it,
        # while a peer is still reading.
        group_store = PrefixStore(_STORE_PREFIX, meeting.store)
        await rdv.barrier(group_store, "joined", rank, world_size, options.store_timeout)
        # ... and the rank hosting the store waits until everyone has seen that (the others
        # just say so), so it cannot exit, store and all, while a peer still waits above.
        await group_store.set_async(f"joined-seen/{rank}", b"1")
        if meeting.server is not None:
            await group_store.wait_async(
                [f"joined-seen/{r}" for r in range(world_size)], options.store_timeout
            )
    except BaseException:
        set_state(None)
        await agent.close(graceful=False)
        if agent.serves_metrics:
            metrics.release()
        if store is None:
            await meeting.close()
        raise
    GroupMember.WORLD = state.world


def _listen_host(store_host: str | None) -> str:
    return "127.0.0.1" if store_host is None or rdv.is_loopback(store_host) else "0.0.0.0"


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Leave the default group (all ranks should call it); frees the transport."""
    from rpcdist.collectives import group as group_module

    state = group_module._state
    if state is None or (group is not None and group is not state.world):
        return
    if current_loop() is state.loop:
        raise BlockingCallError(
            "destroy_process_group() on the event loop: use destroy_process_group_async()"
        )
    _run_hooks(_destroy_hooks)
    call_blocking(state.loop, destroy_process_group_async())
    stop_callback_threads(timeout=5.0)  # then() callbacks of the group's futures (made again on use)
    if state.owns_loop:
        release_loop(state.loop)


async def destroy_process_group_async() -> None:
    """Awaitable form of :func:`destroy_process_group`: a barrier, then close."""
    from rpcdist.collectives import group as group_module

    state = group_module._state
    if state is None:
        return
    _run_hooks(_destroy_hooks)
    try:
        store = PrefixStore(_STORE_PREFIX, state.store)
        dead: list[int] = []
        try:
            dead = await rdv.barrier(
                store, "destroy", state.rank, state.world_size, None, state.agent.find_dead
            )
        except Exception as exc:
            log.warning("rank %d: destroy barrier failed: %s", state.rank, exc)
        except asyncio.CancelledError:
            if not stray_cancellation():
                raise
            log.warning("rank %d: destroy barrier: a store call was cancelled", state.rank)
        await state.agent.wait_for_outstanding(30.0)
        await state.agent.close(graceful=True)
        state.slots.close()
        if state.agent.rendezvous.server is not None:
            try:
                await rdv.check_in(store, "destroy-exit", state.rank)
                live = [r for r in range(state.world_size) if r not in dead]
                await rdv.wait_checked_in(store, "destroy-exit", live, 30.0)
            except Exception as exc:
                log.warning("rank %d: exit barrier failed: %s", state.rank, exc)
            except asyncio.CancelledError:
                if not stray_cancellation():
                    raise
                log.warning("rank %d: exit barrier: a store call was cancelled", state.rank)
        else:
            try:
                await rdv.check_in(store, "destroy-exit", state.rank)
            except Exception as exc:
                log.debug("exit notice failed: %s", exc)
        await state.agent.rendezvous.close()
    finally:
        if state.agent.serves_metrics:
            state.agent.serves_metrics = False
            metrics.release()
        set_state(None)
        GroupMember.WORLD = None
        stop_callback_threads()  # then() callbacks of the group's futures (waited for by the blocking form)


def new_group(ranks: Sequence[int] | None = None, timeout: float | timedelta | None = None, **_: Any) -> Any:
    """A group of ``ranks`` (all ranks must call this, in the same order, as in torch).

    Ranks outside it get ``GroupMember.NON_GROUP_MEMBER``.
    """
    state = current_state()
    members = sorted(set(range(state.world_size) if ranks is None else ranks))
    for r in members:
        if not 0 <= r < state.world_size:
            raise DistributedError(f"new_group: rank {r} is outside the world of size {state.world_size}")
    group = ProcessGroup(
        state, len(state.groups) + 1, members, _seconds(timeout) if timeout else state.timeout
    )
    state.groups.append(group)
    return group if group.is_member else GroupMember.NON_GROUP_MEMBER


def loop_time() -> float:
    return time.monotonic()


class _NotMember(Exception):
    """This rank is not in the group an operation was called on (handled by @_members_only)."""


def _group(group: Any, what: str) -> ProcessGroup:
    state = current_state()
    if group is None:
        assert state.world is not None
        return state.world
    if group is GroupMember.NON_GROUP_MEMBER or (isinstance(group, ProcessGroup) and not group.is_member):
        raise _NotMember(
            f"Running {what} on global rank {state.rank} which does not belong to the given group."
        )
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group(), not {type(group).__name__}")
    return group


def _members_only(func: Callable[..., Any]) -> Callable[..., Any]:
    """As in torch: a rank outside the group gets a warning naming it, and nothing happens
    (its tensors are untouched, the result is None). Programs like the torch tutorial's,
    where every rank calls the collective of a sub-group, run unchanged."""

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except _NotMember as skip:
            warnings.warn(str(skip), stacklevel=2)
            return None

    return guarded


def get_rank(group: Any = None) -> int:
    """This process's rank (in ``group`` if given; -1 if not a member)."""
    state = current_state()
    if group is None:
        return state.rank
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return group.rank()


def get_world_size(group: Any = None) -> int:
    state = current_state()
    if group is None:
        return state.world_size
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return group.size()


def get_backend(group: Any = None) -> str:
    return current_state().backend


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    return group.global_rank(group_rank)


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    return group.group_rank_of(global_rank)


# ------------------------------------------------------------------------------- running
def _launch(
    coro_factory: Callable[[], Coroutine[Any, Any, Any]], async_op: bool, what: str, timeout: float
) -> Any:
    """Start an operation on the loop; returns its Work (async_op) or waits for it."""
    state = current_state()
    loop = state.loop
    future: Future[Any] = Future(loop=loop)

    def settle(task: Any) -> None:
        if task.cancelled():
            future._try_complete(None, DistributedError(f"{what} was cancelled"))
        elif task.exception() is not None:
            future._try_complete(None, task.exception())
        else:
            future._try_complete(task.result(), None)

    if current_loop() is loop:
        if not async_op:
            raise BlockingCallError(
                f"{what} would block the event loop: pass async_op=True and await the Work"
            )
        loop.create_task(coro_factory()).add_done_callback(settle)
    else:
        asyncio.run_coroutine_threadsafe(coro_factory(), loop).add_done_callback(settle)
    work = Work(future, timeout, what)
    if async_op:
        return work
    work.wait()
    return None


def _collective(
    group: Any, name: str, body: Callable[[algo.Exchange], Coroutine[Any, Any, Any]], async_op: bool
) -> Any:
    pg = _group(group, name)
    if not async_op and current_loop() is pg._state.loop:  # refuse before taking a number
        raise BlockingCallError(f"{name} would block the event loop: pass async_op=True and await the Work")
    exchange = algo.Exchange(pg, name, pg.next_sequence())  # numbered now, in call order
    if metrics.current is not None:
        body = _timed(name, body)
    return _launch(lambda: body(exchange), async_op, f"{_comm_label(name)} on rank {get_rank()}", pg.timeout)


def _timed(
    op: str, body: Callable[[algo.Exchange], Coroutine[Any, Any, Any]]
) -> Callable[[algo.Exchange], Coroutine[Any, Any, Any]]:
    """``body`` reporting its duration to the metrics (rpcdist_collective_duration_seconds)."""

    async def timed(exchange: algo.Exchange) -> Any:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await body(exchange)
            outcome = "ok"
            return result
        finally:
            if metrics.current is not None:
                metrics.current.collective_seconds.labels(op, outcome).observe(time.perf_counter() - started)

    return timed


def _tensor(t: Any, name: str, contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise DistributedError(f"{name}: rpcdist handles CPU tensors only, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise DistributedError(f"{name} needs a contiguous tensor (call .contiguous() first)")
    return t


def _group_rank(pg: ProcessGroup, global_rank: int, what: str) -> int:
    if global_rank not in pg.ranks:
        raise DistributedError(f"{what}: rank {global_rank} is not in the group {pg.ranks}")
    return pg.group_rank_of(global_rank)


# ------------------------------------------------------------------------------- collectives
@_members_only
def all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """Reduce ``tensor`` across the group, in place on every rank."""
    _tensor(tensor, "all_reduce")
    check_op(op, tensor.dtype)
    return _collective(group, "all_reduce", lambda ex: algo.all_reduce(ex, tensor, op), async_op)


@_members_only
def reduce(
    tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """Reduce ``tensor`` across the group into rank ``dst``'s tensor."""
    _tensor(tensor, "reduce")
    check_op(op, tensor.dtype)
    pg = _group(group, "reduce")
    d = _group_rank(pg, dst, "reduce")
    return _collective(pg, "reduce", lambda ex: algo.reduce(ex, tensor, d, op), async_op)


@_members_only
def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    _tensor(tensor, "broadcast")
    pg = _group(group, "broadcast")
    s = _group_rank(pg, src, "broadcast")
    return _collective(pg, "broadcast", lambda ex: algo.broadcast(ex, tensor, s), async_op)


@_members_only
def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Every rank's ``tensor`` into ``tensor_list[rank]``, on every rank."""
    _tensor(tensor, "all_gather", contiguous=False)
    return _collective(group, "all_gather", lambda ex: algo.all_gather(ex, tensor_list, tensor), async_op)


@_members_only
def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """All ranks' ``input_tensor`` concatenated (along dim 0) into ``output_tensor``."""
    _tensor(output_tensor, "all_gather_into_tensor")
    _tensor(input_tensor, "all_gather_into_tensor", contiguous=False)
    pg = _group(group, "all_gather_into_tensor")
    n = pg.size()
    if output_tensor.numel() != n * input_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
        raise DistributedError(
            f"all_gather_into_tensor: output must hold {n} x {input_tensor.numel()} elements of "
            f"{input_tensor.dtype}, got {output_tensor.numel()} of {output_tensor.dtype}"
        )
    parts = [p.view(input_tensor.shape) for p in output_tensor.view(-1).chunk(n)]
    return _collective(
        pg, "all_gather_into_tensor", lambda ex: algo.all_gather(ex, parts, input_tensor), async_op
    )


@_members_only
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""
    _tensor(tensor, "gather", contiguous=False)
    pg = _group(group, "gather")
    d = _group_rank(pg, dst, "gather")
    return _collective(pg, "gather", lambda ex: algo.gather(ex, tensor, gather_list, d), async_op)


@_members_only
def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``scatter_list[i]`` of rank ``src`` into rank i's ``tensor``."""
    _tensor(tensor, "scatter")
    pg = _group(group, "scatter")
    s = _group_rank(pg, src, "scatter")
    return _collective(pg, "scatter", lambda ex: algo.scatter(ex, tensor, scatter_list, s), async_op)


@_members_only
def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input_list[i]`` across ranks into rank i's ``output``."""
    _tensor(output, "reduce_scatter")
    check_op(op, output.dtype)
    return _collective(
        group, "reduce_scatter", lambda ex: algo.reduce_scatter(ex, output, input_list, op), async_op
    )


@_members_only
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``input`` split in world-size parts along dim 0; part i reduced into rank i's ``output``."""
    _tensor(output, "reduce_scatter_tensor")
    _tensor(input, "reduce_scatter_tensor")
    check_op(op, output.dtype)
    pg = _group(group, "reduce_scatter_tensor")
    n = pg.size()
    if input.numel() != n * output.numel() or input.dtype != output.dtype:
        raise DistributedError(
            f"reduce_scatter_tensor: input must hold {n} x {output.numel()} elements of {output.dtype}, "
            f"got {input.numel()} of {input.dtype}"
        )
    parts = [p.view(output.shape) for p in input.view(-1).chunk(n)]
    return _collective(
        pg, "reduce_scatter_tensor", lambda ex: algo.reduce_scatter(ex, output, parts, op), async_op
    )


@_members_only
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``input_tensor_list[j]`` of rank i into ``output_tensor_list[i]`` of rank j."""
    return _collective(
        group, "all_to_all", lambda ex: algo.all_to_all(ex, output_tensor_list, input_tensor_list), async_op
    )


@_members_only
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``all_to_all`` on single tensors split along dim 0 (evenly, or by the split sizes)."""
    _tensor(output, "all_to_all_single")
    _tensor(input, "all_to_all_single")
    pg = _group(group, "all_to_all_single")
    n = pg.size()
    inputs = _split(input, input_split_sizes, n, "input")
    outputs = _split(output, output_split_sizes, n, "output")
    return _collective(pg, "all_to_all_single", lambda ex: algo.all_to_all(ex, outputs, inputs), async_op)


def _split(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[torch.Tensor]:
    if sizes is None:
        if t.shape[0] % n:
            raise DistributedError(f"all_to_all_single: {what} dim 0 ({t.shape[0]}) is not divisible by {n}")
        return list(t.split(t.shape[0] // n))
    if len(sizes) != n or sum(sizes) != t.shape[0]:
        raise DistributedError(
            f"all_to_all_single: {what}_split_sizes {list(sizes)} must have {n} entries "
            f"summing to {t.shape[0]}"
        )
    return list(t.split(list(sizes)))


@_members_only
def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    """Block until every rank of the group has reached the barrier."""
    return _collective(group, "barrier", algo.barrier, async_op)


@_members_only
def monitored_barrier(
    group: Any = None, timeout: float | timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier whose error names the ranks that did not arrive within ``timeout``."""
    pg = _group(group, "monitored_barrier")
    state = current_state()
    sequence = pg.next_sequence()
    limit = _seconds(timeout) if timeout is not None else pg.timeout
    key = f"monitored_barrier/{pg.group_id}/{sequence}"
    store = PrefixStore(_STORE_PREFIX, state.store)

    async def run() -> None:
        await store.set_async(f"{key}/{state.rank}", b"1")
        leader = pg.ranks[0]
        if state.rank == leader:
            try:
                await store.wait_async([f"{key}/{r}" for r in pg.ranks], limit)
            except Exception:
                missing = [r for r in pg.ranks if not await store.check_async([f"{key}/{r}"])]
                shown = missing if wait_all_ranks else missing[:1]
                await store.set_async(f"{key}/failed", ",".join(map(str, missing)))
                raise DistributedError(
                    f"monitored_barrier: rank{'s' if len(shown) > 1 else ''} {shown} did not arrive within "
                    f"{limit:g} s"
                ) from None
            await store.set_async(f"{key}/release", b"1")
        else:
            deadline = loop_time() + limit + 5
            while True:  # released, or told which ranks the leader gave up on
                if await store.check_async([f"{key}/release"]):
                    return
                if await store.check_async([f"{key}/failed"]):
                    missing = (await store.get_async(f"{key}/failed")).decode()
                    raise DistributedError(
                        f"monitored_barrier: ranks [{missing}] did not arrive within {limit:g} s"
                    )
                if loop_time() > deadline:
                    raise DistributedError(
                        f"monitored_barrier: rank {state.rank} was not released by rank {leader} "
                        f"within {limit:g} s"
                    )
                try:
                    await store.wait_async([f"{key}/release"], 0.5)
                except Exception:  # noqa: BLE001 - poll the failure key again
                    pass

    _launch(run, False, "monitored_barrier", limit + 10)


# ------------------------------------------------------------------------------- objects
@_members_only
def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, device: Any = None
) -> None:
    """Rank ``src``'s ``object_list`` contents into every rank's list (in place)."""
    pg = _group(group, "broadcast_object_list")
    s = _group_rank(pg, src, "broadcast_object_list")

    async def body(ex: algo.Exchange) -> None:
        if ex.me == s:
            for r in ex.others():
                ex.send(r, 0, list(object_list), lend=False)
            await ex.flush()
        else:
            received = await ex.recv(s, 0)
            if len(received) != len(object_list):
                raise DistributedError(
                    f"broadcast_object_list: source has {len(received)} objects, "
                    f"this rank's list {len(object_list)}"
                )
            object_list[:] = received

    _collective(pg, "broadcast_object_list", body, False)


@_members_only
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Every rank's ``obj`` into ``object_list[rank]``."""
    pg = _group(group, "all_gather_object")
    if len(object_list) != pg.size():
        raise DistributedError(f"all_gather_object needs a list of {pg.size()} slots, got {len(object_list)}")

    async def body(ex: algo.Exchange) -> None:
        object_list[:] = await algo.gather_all_objects(ex, obj)

    _collective(pg, "all_gather_object", body, False)


@_members_only
def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """Every rank's ``obj`` into ``object_gather_list`` on rank ``dst``."""
    pg = _group(group, "gather_object")
    d = _group_rank(pg, dst, "gather_object")

    async def body(ex: algo.Exchange) -> None:
        if ex.me != d:
            ex.send(d, 0, obj, lend=False)
            await ex.flush()
            return
        if object_gather_list is None or len(object_gather_list) != ex.size:
            raise DistributedError(f"gather_object on the destination needs a list of {ex.size} slots")
        for r in ex.others():
            object_gather_list[r] = await ex.recv(r, 0)
        object_gather_list[ex.me] = obj

    _collective(pg, "gather_object", body, False)


@_members_only
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """``scatter_object_input_list[i]`` of rank ``src`` into rank i's output list[0]."""
    pg = _group(group, "scatter_object_list")
    s = _group_rank(pg, src, "scatter_object_list")

    async def body(ex: algo.Exchange) -> None:
        if ex.me == s:
            if scatter_object_input_list is None or len(scatter_object_input_list) != ex.size:
                raise DistributedError(f"scatter_object_list on the source needs {ex.size} input objects")
            for r in ex.others():
                ex.send(r, 0, scatter_object_input_list[r], lend=False)
            await ex.flush()
            mine = scatter_object_input_list[ex.me]
        else:
            mine = await ex.recv(s, 0)
        if scatter_object_output_list:
            scatter_object_output_list[0] = mine
        else:
            scatter_object_output_list.append(mine)

    _collective(pg, "scatter_object_list", body, False)


# ------------------------------------------------------------------------------- point to point
def _p2p_tag(tag: int) -> tuple[str, int]:
    return ("p", int(tag))


@_members_only
def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work:
    """Send ``tensor`` to rank ``dst``; the Work completes when the receiver has it."""
    _tensor(tensor, "isend", contiguous=False)
    pg = _group(group, "isend")
    d = _group_rank(pg, dst, "isend")
    if d == pg.rank():
        raise DistributedError(f"isend: rank {dst} cannot send to itself")

    async def run() -> None:
        await pg.send(d, _p2p_tag(tag), None, tensor)

    return _launch(run, True, f"isend to rank {dst} (tag {tag})", pg.timeout)


@_members_only
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Work:
    """Receive into ``tensor`` from rank ``src`` (any rank if None); the Work's result is
    the sender's rank."""
    _tensor(tensor, "irecv", contiguous=False)
    pg = _group(group, "irecv")
    s = None if src is None else _group_rank(pg, src, "irecv")

    async def run() -> int:
        who, (_, payload) = await pg.receive(s, _p2p_tag(tag), f"recv (tag {tag})")
        sender = pg.global_rank(who)
        loan = payload if isinstance(payload, Loan) else None
        try:
            received = loan.tensor if loan is not None else payload
            _check_received(received, tensor, sender, tag)
            tensor.copy_(received)
        finally:
            if loan is not None:
                loan.release()
        return sender

    return _launch(
        run, True, f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})", pg.timeout
    )


def _check_received(payload: Any, tensor: torch.Tensor, sender: int, tag: int) -> None:
    if not isinstance(payload, torch.Tensor):
        raise DistributedError(f"recv from rank {sender}: expected a tensor, got {type(payload).__name__}")
    if payload.shape != tensor.shape or payload.dtype != tensor.dtype:
        raise DistributedError(
            f"recv from rank {sender} (tag {tag}): got shape {list(payload.shape)} "
            f"dtype {payload.dtype}, the receiving tensor has shape {list(tensor.shape)} "
            f"dtype {tensor.dtype}"
        )


@_members_only
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it has been received."""
    work = isend(tensor, dst, group, tag)
    if work is not None:
        work.wait()


@_members_only
def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
    work = irecv(tensor, src, group, tag)
    if work is None:  # not a member: warned already
        return -1
    work.wait()
    return work.result()


@dataclass
class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``op`` is ``isend`` or ``irecv``."""

    op: Callable[..., Work]
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; returns their Works."""
    for p2p in p2p_op_list:
        if p2p.op not in (isend, irecv):
            raise DistributedError(f"P2POp.op must be isend or irecv, not {p2p.op!r}")
    return [p2p.op(p2p.tensor, p2p.peer, p2p.group, p2p.tag) for p2p in p2p_op_list]


# ------------------------------------------------------------------------------- more of torch's surface
# Group introspection, sub-groups, object point-to-point, coalesced collectives, backend
# availability, debug level, rendezvous handlers: the rest of torch.distributed's c10d names.

GroupName = NewType("GroupName", str)
RankType = int | torch.SymInt
_BACKEND_DEVICES = ("cpu",)  # rpcdist moves CPU tensors only
_RUNNABLE_BACKENDS = (Backend.GRPC, Backend.GLOO)  # what init_process_group accepts
_FOREIGN_BACKENDS = ("nccl", "mpi", "ucc", "xccl")  # torch's, never run by rpcdist
_OBJECT_TAG = ("o", 0)  # send_object_list/recv_object_list, apart from tensor send/recv


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (the default group if None), ordered by group rank."""
    if group is None:
        world = current_state().world
        assert world is not None
        return list(world.ranks)
    if group is GroupMember.NON_GROUP_MEMBER or not isinstance(group, ProcessGroup):
        raise ValueError(f"get_process_group_ranks needs a ProcessGroup, got {group!r}")
    return list(group.ranks)


def get_pg_count() -> int:
    """How many process groups exist: the default group and every ``new_group`` since (0 before
    ``init_process_group``)."""
    from rpcdist.collectives import group as group_module

    state = group_module._state
    return 0 if state is None else 1 + len(state.groups)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """One group per list of global ranks (the lists must not overlap); every rank calls this.

    Returns ``(the subgroup holding this rank or None, every subgroup)``; a rank outside a
    subgroup finds ``GroupMember.NON_GROUP_MEMBER`` in its place, as with ``new_group``.
    """
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    owner: dict[int, list[int]] = {}
    for ranks in ranks_per_subgroup_list:  # checked before any group is made, on every rank alike
        for r in ranks:
            if r in owner:
                raise ValueError(f"Rank {r} has appeared in both subgroup {owner[r]} and {list(ranks)}")
            owner[r] = list(ranks)
    me = get_rank()
    current = None
    subgroups = []
    for ranks in ranks_per_subgroup_list:
        subgroup = new_group(list(ranks), timeout=timeout, backend=backend, pg_options=pg_options)
        subgroups.append(subgroup)
        if me in ranks:
            current = subgroup
            log.info("rank %d is assigned to subgroup %s", me, list(ranks))
    return current, subgroups


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Split ``group`` (default: the world) into consecutive subgroups of ``group_size`` ranks.

    torch's default size is the number of CUDA devices per machine; rpcdist runs on CPUs, so
    ``group_size`` must be given. Returns ``(this rank's subgroup, every subgroup)``.
    """
    if group_size is None:
        raise ValueError(
            "new_subgroups needs group_size: the default (one subgroup per machine's CUDA devices) "
            "only applies to CUDA, and rpcdist runs on CPUs"
        )
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    ranks = get_process_group_ranks(group)
    if len(ranks) < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({len(ranks)})")
    if len(ranks) % group_size:
        raise ValueError(f"The world size ({len(ranks)}) must be divisible by 'group_size={group_size}'")
    chunks = [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout, backend, pg_options, group_desc)


def _peer(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, what: str) -> int | None:
    """The group rank named by ``global_rank`` or ``group_rank`` (at most one; None: neither)."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{what}: can't specify both group_rank and global_rank")
    if group_rank is not None:
        pg.global_rank(group_rank)  # range check
        return group_rank
    if global_rank is None:
        return None
    return _group_rank(pg, global_rank, what)


def _check_cpu_device(device: Any, what: str) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise DistributedError(f"{what}: rpcdist moves objects between CPU processes only, not to {device}")


@_members_only
def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the picklable objects of ``object_list`` to rank ``dst`` (a global rank; or
    ``group_dst``, a rank of ``group``); returns once the receiver has them.

    The receiver calls :func:`recv_object_list` with a list of the same length. ``device`` may
    only be the CPU; ``use_batch`` changes nothing here (accepted for torch's signature).
    Objects are pickled: only exchange them with processes you trust.
    """
    pg = _group(group, "send_object_list")
    d = _peer(pg, dst, group_dst, "send_object_list")
    if d is None:
        raise ValueError("send_object_list: must specify dst or group_dst")
    if d == pg.rank():
        raise ValueError(
            "Invalid destination rank: destination rank should not be the same as the rank of the "
            "current process."
        )
    _check_cpu_device(device, "send_object_list")
    payload = list(object_list)

    async def run() -> None:
        await pg.send(d, _OBJECT_TAG, None, payload, lend=False)

    _launch(run, False, f"send_object_list to rank {pg.global_rank(d)}", pg.timeout)


@_members_only
def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive the objects sent by :func:`send_object_list` into ``object_list`` (in place; its
    length must match the sender's). ``src`` is a global rank, ``group_src`` a rank of
    ``group``; with neither, the first sender is taken. Returns the sender's global rank
    (-1 on a rank outside ``group``)."""
    pg = _group(group, "recv_object_list")
    s = _peer(pg, src, group_src, "recv_object_list")
    if s is not None and s == pg.rank():
        raise ValueError(
            "Invalid source rank: source rank should not be the same as the rank of the current process."
        )
    _check_cpu_device(device, "recv_object_list")

    async def run() -> int:
        who, (_, received) = await pg.receive(s, _OBJECT_TAG, "recv_object_list")
        sender = pg.global_rank(who)
        if len(received) != len(object_list):
            raise DistributedError(
                f"recv_object_list: rank {sender} sent {len(received)} objects, "
                f"the receiving list has {len(object_list)} slots"
            )
        object_list[:] = received
        return sender

    source = "any rank" if s is None else f"rank {pg.global_rank(s)}"
    work = _launch(run, True, f"recv_object_list from {source}", pg.timeout)
    work.wait()
    return int(work.result())


def _same_dtype(tensors: Sequence[torch.Tensor], what: str) -> torch.dtype:
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{what}: all tensors must have the same dtype, got {sorted(map(str, dtypes))}")
    return tensors[0].dtype


@_members_only
def all_reduce_coalesced(
    tensors: list[torch.Tensor] | torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """All-reduce every tensor of ``tensors`` (one dtype) in one exchange, in place."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for t in tensors:
        _tensor(t, "all_reduce_coalesced", contiguous=False)
    check_op(op, _same_dtype(tensors, "all_reduce_coalesced"))
    flat = torch.cat([t.reshape(-1) for t in tensors])

    async def body(ex: algo.Exchange) -> None:
        await algo.all_reduce(ex, flat, op)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view(t.shape))

    return _collective(group, "all_reduce_coalesced", body, async_op)


@_members_only
def all_gather_coalesced(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``output_tensor_lists[i][j]`` receives rank i's ``input_tensor_list[j]`` (one dtype), in
    one exchange."""
    for t in input_tensor_list:
        _tensor(t, "all_gather_coalesced", contiguous=False)
    dtype = _same_dtype(input_tensor_list, "all_gather_coalesced")
    pg = _group(group, "all_gather_coalesced")
    if len(output_tensor_lists) != pg.size() or any(
        len(outputs) != len(input_tensor_list) for outputs in output_tensor_lists
    ):
        raise DistributedError(
            f"all_gather_coalesced needs {pg.size()} output lists of {len(input_tensor_list)} tensors"
        )
    sizes = [t.numel() for t in input_tensor_list]
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = [torch.empty(sum(sizes), dtype=dtype) for _ in range(pg.size())]

    async def body(ex: algo.Exchange) -> None:
        await algo.all_gather(ex, flat_out, flat_in)
        for outputs, flat in zip(output_tensor_lists, flat_out, strict=True):
            for out, part in zip(outputs, flat.split(sizes), strict=True):
                out.copy_(part.view(out.shape))

    return _collective(pg, "all_gather_coalesced", body, async_op)


def all_gather_single(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Every rank's ``input_tensor`` into ``output_tensor``, concatenated or stacked along dim 0
    (torch's newer name for :func:`all_gather_into_tensor`)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``input`` (world size x ``output``, concatenated or stacked) reduced, part i into rank i's
    ``output`` (torch's newer name for :func:`reduce_scatter_tensor`)."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def supports_complex(reduceOp: ReduceOp) -> bool:  # noqa: N803 - torch's parameter name
    """Whether ``reduceOp`` is defined for complex tensors (MAX, MIN, PRODUCT and the bitwise
    ops are not)."""
    return reduceOp not in (
        ReduceOp.MAX,
        ReduceOp.MIN,
        ReduceOp.PRODUCT,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    )


# -- backends ---------------------------------------------------------------------------------
class BackendConfig:
    """Which backend serves which device, parsed from a backend string as torch does:
    ``"gloo"``, ``"grpc"`` or ``"cpu:gloo"`` (``"<device>:<backend>,..."``)."""

    def __init__(self, backend: str | None) -> None:
        self.device_backend_map: dict[str, str] = {}
        name = (str(backend) if backend is not None else "undefined").lower()
        if name == "undefined":
            self.device_backend_map["cpu"] = Backend.GLOO
        elif ":" in name:
            for pair in name.split(","):
                parts = pair.split(":")
                if len(parts) != 2 or not all(parts):
                    raise ValueError(
                        f"Invalid device:backend pairing {pair!r} in {backend!r}: use "
                        "'<device_type1>:<backend1>,<device_type2>:<backend2>', e.g. 'cpu:gloo'"
                    )
                device, device_backend = parts
                if device in self.device_backend_map:
                    raise ValueError(f"Duplicate device type {device} in backend string {backend!r}")
                self.device_backend_map[device] = device_backend
        else:
            self.device_backend_map = dict.fromkeys(_BACKEND_DEVICES, name)

    def get_device_backend_map(self) -> dict[str, str]:
        """Device type to backend name."""
        return self.device_backend_map

    def __repr__(self) -> str:
        return ",".join(f"{device}:{backend}" for device, backend in self.device_backend_map.items())


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """The backend configuration of ``group`` as ``"<device>:<backend>"`` (e.g. ``"cpu:gloo"``)."""
    if group is GroupMember.NON_GROUP_MEMBER or (isinstance(group, ProcessGroup) and not group.is_member):
        raise ValueError("Invalid process group specified")
    return str(BackendConfig(current_state().backend))


def get_default_backend_for_device(device: str | torch.device) -> str:
    """The backend torch programs use for ``device``: ``"gloo"`` for the CPU, which rpcdist
    runs; other devices have none here (ValueError)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if device_type not in _BACKEND_DEVICES:
        raise ValueError(f"Default backend not registered for device : {device}")
    return Backend.GLOO


def is_gloo_available() -> bool:
    """True: ``init_process_group("gloo")`` runs (over rpcdist's transport)."""
    return True


def is_nccl_available() -> bool:
    """False: rpcdist has no NCCL (GPU) backend."""
    return False


def is_mpi_available() -> bool:
    """False: rpcdist has no MPI backend."""
    return False


def is_ucc_available() -> bool:
    """False: rpcdist has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: rpcdist has no XCCL (Intel GPU) backend."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether ``init_process_group(backend)`` can run here (``"grpc"``, ``"gloo"``, or a
    ``"cpu:gloo"``-style string whose backends all can)."""
    names = BackendConfig(backend).get_device_backend_map().values() if ":" in backend else [backend]
    return all(str(name).lower() in _RUNNABLE_BACKENDS for name in names)


def is_torchelastic_launched() -> bool:
    """Whether this process was started by torchelastic/torchrun (``TORCHELASTIC_RUN_ID`` set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` (set by torchrun and rpcdist-run),
    else ``SLURM_LOCALID`` under Slurm's srun, else ``fallback_rank``; RuntimeError if none
    is there."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if (slurm_local := _launch_env.local_rank()) is not None:
        return slurm_local
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Pass fallback_rank to get_node_local_rank to run "
        "outside a launcher that sets it (such as torchrun)."
    )


# -- debugging ----------------------------------------------------------------------------------
_debug_level = DebugLevel.OFF
_debug_logger_level: int | None = None  # what the "rpcdist" logger had before set_debug_level
_DEBUG_LOGGING = {DebugLevel.INFO: logging.INFO, DebugLevel.DETAIL: logging.DEBUG}


def get_debug_level() -> DebugLevel:
    """The current debug level (``TORCH_DISTRIBUTED_DEBUG``: OFF, INFO or DETAIL)."""
    return _debug_level


def set_debug_level(level: DebugLevel) -> None:
    """Set the debug level: INFO logs rpcdist's ``logging`` at INFO, DETAIL at DEBUG, OFF puts
    the ``rpcdist`` logger back as it was. torch's own level follows, for torch code in this
    process (such as DistributedDataParallel over rpcdist's torch backend)."""
    global _debug_level, _debug_logger_level
    level = DebugLevel(level)
    logger = logging.getLogger("rpcdist")
    if level in _DEBUG_LOGGING:
        if _debug_logger_level is None:
            _debug_logger_level = logger.level
        logger.setLevel(_DEBUG_LOGGING[level])
    elif _debug_logger_level is not None:
        logger.setLevel(_debug_logger_level)
        _debug_logger_level = None
    _debug_level = level
    with contextlib.suppress(AttributeError, RuntimeError):
        import torch.distributed as torch_dist

        torch_dist.set_debug_level(level)


def set_debug_level_from_env() -> None:
    """Set the debug level from ``TORCH_DISTRIBUTED_DEBUG`` (OFF when unset); ValueError for
    anything but OFF, INFO or DETAIL."""
    value = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF").strip().upper() or "OFF"
    try:
        level = DebugLevel.__members__[value]
    except KeyError:
        raise ValueError(
            f"TORCH_DISTRIBUTED_DEBUG={value!r}: the debug level must be OFF, INFO or DETAIL"
        ) from None
    set_debug_level(level)


_breakpoint_hits: dict[tuple[str, int], int] = {}


class _TtyPdb(pdb.Pdb):
    """pdb reading the terminal even in a worker whose stdin was closed (multiprocessing)."""

    def interaction(self, *args: Any, **kwargs: Any) -> None:
        saved = sys.stdin
        try:
            with open("/dev/stdin") as sys.stdin:
                super().interaction(*args, **kwargs)
        finally:
            sys.stdin = saved


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:  # noqa: A001
    """Stop in the debugger on rank ``rank`` only; the other ranks wait in a barrier until it
    continues. The first ``skip`` calls from a call site are ignored. ``timeout_s`` becomes
    every group's timeout, so the wait does not time out during the session."""
    caller = sys._getframe(1)
    if skip > 0:
        site = (caller.f_code.co_filename, caller.f_lineno)
        _breakpoint_hits[site] = _breakpoint_hits.get(site, 0) + 1
        if _breakpoint_hits[site] <= skip:
            log.warning("skipping the breakpoint, hit %d of %d skipped", _breakpoint_hits[site], skip)
            return
    state = current_state()
    if timeout_s is not None:
        for pg in [state.world, *state.groups]:
            if pg is not None:
                pg.timeout = float(timeout_s)
    if state.rank == rank:
        debugger = _TtyPdb()
        debugger.message(f"\n!!! rank {rank} stopped in dist.breakpoint(); the other ranks wait !!!\n")
        debugger.set_trace(caller)
    barrier()


_comm_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("rpcdist_comm_name", default=None)


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Name the collectives issued inside the block: the block shows under ``name`` in the
    torch profiler, and the collectives' errors and timeouts say ``name``."""
    token = _comm_name.set(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        _comm_name.reset(token)


def _comm_label(what: str) -> str:
    name = _comm_name.get()
    return what if name is None else f"{name} ({what})"


# -- rendezvous handlers --------------------------------------------------------------------------
RendezvousHandler = Callable[..., Iterator[tuple[Any, int, int]]]
_rendezvous_handlers: dict[str, RendezvousHandler] = {}
_BUILTIN_SCHEMES = ("env", "tcp", "file")


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Let ``init_process_group(init_method="<scheme>://...")`` and :func:`rendezvous` use
    ``handler``: a generator function ``handler(url, **kwargs)`` yielding ``(store, rank,
    world_size)``, as in torch. The store may be rpcdist's or torch's (wrapped in
    :class:`~rpcdist.store.torch_store.TorchStore`). ``env``, ``tcp`` and ``file`` are taken."""
    if scheme in _rendezvous_handlers or scheme in _BUILTIN_SCHEMES:
        raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
    _rendezvous_handlers[scheme] = handler


def _url_with_rank(url: str, rank: int, world_size: int) -> str:
    """torch's convention: rank and world size travel to the handler in the URL's query."""
    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if "=" in pair)
    if ("rank" in query and rank != -1) or ("world_size" in query and world_size != -1):
        raise ValueError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
    if rank != -1:
        query["rank"] = str(rank)
    if world_size != -1:
        query["world_size"] = str(world_size)
    return urlunparse(parsed._replace(query="&".join(f"{k}={v}" for k, v in query.items())))


def _builtin_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """env://, tcp:// and file:// for :func:`rendezvous`: rpcdist's store for the URL (rank 0
    serves it for env:// and tcp://, until the process exits)."""
    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if "=" in pair)
    rank = int(query.get("rank", "-1"))
    world_size = int(query.get("world_size", "-1"))
    rank, world_size = rdv.resolve_rank_and_size(rank, world_size if world_size > 0 else None)
    timeout = _seconds(kwargs.get("timeout"))
    base = urlunparse(parsed._replace(query=""))
    loop = acquire_loop()
    try:
        meeting = call_blocking(loop, rdv.rendezvous(base, rank, world_size, min(timeout, 300)))
    except BaseException:
        release_loop(loop)
        raise
    meeting.store._owns_loop = True  # closing the store releases the loop acquired here
    _rendezvous_kept.append(meeting)  # a served store must outlive this generator
    yield meeting.store, rank, world_size


_rendezvous_kept: list[Any] = []


def rendezvous(
    url: str, rank: int = -1, world_size: int = -1, **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch's ``dist.rendezvous``: an iterator yielding ``(store, rank, world_size)`` for
    ``url``, from the handler of its scheme (``env``, ``tcp``, ``file`` or one registered
    with :func:`register_rendezvous_handler`)."""
    if not isinstance(url, str):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    if not isinstance(rank, int) or not isinstance(world_size, int):
        raise RuntimeError(f"`rank` and `world_size` must be integers, got {rank!r} and {world_size!r}")
    scheme = urlparse(url).scheme
    if scheme in _BUILTIN_SCHEMES:
        if scheme == "env":
            rank = int(os.environ.get("RANK", rank)) if rank == -1 else rank
            world_size = int(os.environ.get("WORLD_SIZE", world_size)) if world_size == -1 else world_size
        return _builtin_rendezvous(_url_with_rank(url, rank, world_size), **kwargs)
    if scheme not in _rendezvous_handlers:
        raise RuntimeError(f"No rendezvous handler for {scheme}://")
    return _rendezvous_handlers[scheme](_url_with_rank(url, rank, world_size), **kwargs)


class _CallableRendezvousModule(types.ModuleType):
    """The class ``rpcdist/__init__`` gives the module ``rpcdist.rendezvous``, so that
    ``dist.rendezvous(url, rank, world_size)`` is torch's function while the module keeps its
    contents (``rpcdist.rendezvous.Rendezvous``, ...)."""

    def __call__(
        self, url: str, rank: int = -1, world_size: int = -1, **kwargs: Any
    ) -> Iterator[tuple[Any, int, int]]:
        return rendezvous(url, rank, world_size, **kwargs)


async def _registered_rendezvous(
    init_method: str | None, rank: int, world_size: int, timeout: float | timedelta | None
) -> tuple[Store | None, int, int]:
    """For ``init_process_group``: run the registered handler of ``init_method``'s scheme (in a
    thread: it may block) and adapt a torch store; ``(None, rank, world_size)`` otherwise."""
    if not init_method or urlparse(init_method).scheme not in _rendezvous_handlers:
        return None, rank, world_size
    handler = _rendezvous_handlers[urlparse(init_method).scheme]
    url = _url_with_rank(init_method, rank, world_size)
    store, rank, world_size = await asyncio.to_thread(
        lambda: next(iter(handler(url, timeout=timedelta(seconds=_seconds(timeout)))))
    )
    if not isinstance(store, Store):
        from rpcdist.store.torch_store import TorchStore

        store = TorchStore(store)
    return store, int(rank), int(world_size)


if os.environ.get("TORCH_DISTRIBUTED_DEBUG"):  # as torch, which reads it at import
    try:
        set_debug_level_from_env()
    except ValueError as exc:
        log.warning("%s", exc)

__all__ += [
    "BackendConfig",
    "DebugLevel",
    "GroupName",
    "RankType",
    "all_gather_coalesced",
    "all_gather_single",
    "all_reduce_coalesced",
    "breakpoint",
    "get_backend_config",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "record_comm",
    "recv_object_list",
    "reduce_scatter_single",
    "register_rendezvous_handler",
    "send_object_list",
    "set_debug_level",
    "set_debug_level_from_env",
    "supports_complex",
]
