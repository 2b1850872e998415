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
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rpcdist import rendezvous as rdv
from rpcdist._runtime import acquire_loop, call_blocking, current_loop, release_loop
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
)
from rpcdist.collectives.loans import Loan
from rpcdist.collectives.reduce_ops import ReduceOp, check_op, reduce_op
from rpcdist.collectives.work import Work
from rpcdist.errors import BlockingCallError
from rpcdist.futures import Future
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
) -> None:
    """The awaitable form of :func:`init_process_group` (runs on the calling loop)."""
    await _init(backend, init_method, timeout, world_size, rank, store, asyncio.get_running_loop(), False)


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
) -> None:
    """Join the default process group (blocks until all ``world_size`` ranks have joined).

    ``init_method``: ``env://`` (default; MASTER_ADDR/MASTER_PORT), ``tcp://host:port`` or
    ``file:///path``; or pass a ``store``. ``backend`` may be ``"grpc"`` or ``"gloo"``.
    """
    with _init_lock:
        loop = acquire_loop()
        try:
            call_blocking(loop, _init(backend, init_method, timeout, world_size, rank, store, loop, True))
        except BaseException:
            release_loop(loop)
            raise


async def _init(
    backend: str | None,
    init_method: str | None,
    timeout: float | timedelta | None,
    world_size: int,
    rank: int,
    store: Store | None,
    loop: asyncio.AbstractEventLoop,
    owns_loop: bool,
) -> None:
    from rpcdist.collectives import group

    if group._state is not None:
        raise DistributedError("the default process group is already initialized")
    name = (backend or Backend.GRPC).lower()
    if name not in (Backend.GRPC, Backend.GLOO):
        raise DistributedError(f"backend {backend!r} is not available: rpcdist runs 'grpc' (alias 'gloo')")
    rank, world_size = rdv.resolve_rank_and_size(rank, world_size if world_size > 0 else None)
    seconds = _seconds(timeout)
    options = RpcBackendOptions(
        init_method=init_method or "env://", rpc_timeout=0, store_timeout=min(seconds, 300)
    )
    if store is not None:
        meeting = rdv.Rendezvous(store, None, None)
    else:
        meeting = await rdv.rendezvous(options.init_method, rank, world_size, options.store_timeout)
    agent = Agent(WorkerInfo(f"c10d-rank{rank}", rank), world_size, options, meeting, loop)
    state = _State(rank, world_size, name, seconds, agent, loop, owns_loop, store=meeting.store)
    state.world = ProcessGroup(state, 0, list(range(world_size)), seconds)
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
    call_blocking(state.loop, destroy_process_group_async())
    if state.owns_loop:
        release_loop(state.loop)


async def destroy_process_group_async() -> None:
    """Awaitable form of :func:`destroy_process_group`: a barrier, then close."""
    from rpcdist.collectives import group as group_module

    state = group_module._state
    if state is None:
        return
    try:
        store = PrefixStore(_STORE_PREFIX, state.store)
        try:
            await rdv.barrier(store, "destroy", state.rank, state.world_size, None, state.agent.find_dead)
        except Exception as exc:
            log.warning("rank %d: destroy barrier failed: %s", state.rank, exc)
        await state.agent.wait_for_outstanding(30.0)
        await state.agent.close(graceful=True)
        state.slots.close()
        if state.agent.rendezvous.server is not None:
            try:
                await rdv.leave_barrier(store, "destroy-exit", state.world_size, 30.0)
            except Exception as exc:
                log.warning("rank %d: exit barrier failed: %s", state.rank, exc)
        else:
            try:
                await rdv.arrive(store, "destroy-exit", state.world_size)
            except Exception as exc:
                log.debug("exit notice failed: %s", exc)
        await state.agent.rendezvous.close()
    finally:
        set_state(None)
        GroupMember.WORLD = None


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
    return _launch(lambda: body(exchange), async_op, f"{name} on rank {get_rank()}", pg.timeout)


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
