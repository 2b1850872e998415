"""rpcdist as a ``torch.distributed`` backend: ``init_process_group("rpcdist", ...)``.

``import rpcdist`` registers the backend ``"rpcdist"`` for CPU tensors. torch's own functions
then run over rpcdist's process groups, algorithms and transport (never gloo)::

    import rpcdist  # noqa: F401 - registers the backend
    torch.distributed.init_process_group("rpcdist", init_method="tcp://10.0.0.1:29500",
                                         rank=rank, world_size=size)
    torch.distributed.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(model)

It works both ways round:

- **torch first**: ``torch.distributed.init_process_group("rpcdist", ...)`` when rpcdist's
  collectives are not initialized builds them from the store torch hands the backend (through
  :class:`~rpcdist.store.torch_store.TorchStore`, so there is only torch's rendezvous);
  ``torch.distributed.destroy_process_group()`` tears them down again.
- **rpcdist first**: ``rpcdist.init_process_group(...)`` also makes torch's default group on
  this backend, reusing rpcdist's group (no second rendezvous), so ``DistributedDataParallel(model)``,
  ``DistributedSampler`` and ``torch.distributed.get_rank()`` work with no further set-up;
  ``rpcdist.destroy_process_group()`` destroys it too. A default group the program made itself
  (``init_process_group("gloo")`` before rpcdist's) is left alone.

How it plugs in: torch lets a backend creator return a Python subclass of
``torch.distributed.ProcessGroup`` (:class:`RpcdistProcessGroup`); torch's Python functions
call its methods, and C++ callers (DDP's reducer, ``_broadcast_coalesced``, parameter checks)
reach the ones torch's pybind trampoline forwards (allreduce, broadcast, allgather, barrier,
send/recv, ...). Each method starts the operation on rpcdist's loop and returns an
:class:`RpcdistWork` (a ``torch.distributed.Work`` subclass) whose ``get_future()`` is a torch
Future of the output tensors, as DDP's gradient buckets need. Every torch group is an rpcdist
:class:`~rpcdist.collectives.group.ProcessGroup` of its own (named after torch's group), so
operations through torch and through ``rpcdist`` never have to be ordered against each other.
The group keeps torch's group name, so functional collectives and ``init_device_mesh("cpu", ...)``
work on it too.

Not available: ``ReduceOp.PREMUL_SUM``, non-CPU tensors, ``monitored_barrier`` (torch allows it
on gloo only) and ``split_group`` (torch splits C++ backends only); ``new_group`` works.
Inside ``rpcdist.autograd.backward`` DDP's allreduce hooks do not run (rpcdist's distributed
autograd uses ``torch.autograd.grad``): run the local part with ``loss.backward()``, as
``examples/ddp_rpc.py`` does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import warnings
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from rpcdist._runtime import acquire_loop, call_blocking, release_loop
from rpcdist.collectives import api
from rpcdist.collectives.group import DistributedError, ProcessGroup, current_state
from rpcdist.collectives.reduce_ops import ReduceOp
from rpcdist.collectives.work import Work
from rpcdist.futures import Future, collect_all
from rpcdist.store import PrefixStore, Store

log = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "RpcdistProcessGroup", "RpcdistWork", "register"]

BACKEND_NAME = "rpcdist"
_EXIT_TIMEOUT = 30.0  # how long the rank hosting torch's store waits for the others to leave it
_TORCH_STORE_PREFIX = "torch-c10d"  # torch's keys in rpcdist's store, when rpcdist made the group

_lock = threading.Lock()
_creating = threading.local()  # set while torch's backend creator initializes rpcdist's world
_made_torch_default: Any = None  # the torch default group rpcdist.init_process_group made
# ... and its store: torch holds only the C++ side, and pybind forgets the Python methods of a
# Python-defined store once nothing in Python refers to it.
_made_torch_store: Any = None


# ------------------------------------------------------------------------------ reduce ops
def _reduce_op(op: Any) -> ReduceOp:
    """torch's ``ReduceOp`` (or ``RedOpType``) as rpcdist's."""
    pairs = (
        (tdist.ReduceOp.SUM, ReduceOp.SUM),
        (tdist.ReduceOp.PRODUCT, ReduceOp.PRODUCT),
        (tdist.ReduceOp.MIN, ReduceOp.MIN),
        (tdist.ReduceOp.MAX, ReduceOp.MAX),
        (tdist.ReduceOp.AVG, ReduceOp.AVG),
        (tdist.ReduceOp.BAND, ReduceOp.BAND),
        (tdist.ReduceOp.BOR, ReduceOp.BOR),
        (tdist.ReduceOp.BXOR, ReduceOp.BXOR),
    )
    for theirs, ours in pairs:
        if op == theirs:
            return ours
    raise ValueError(f"the rpcdist backend does not support {op!r} (PREMUL_SUM is not available)")


# ------------------------------------------------------------------------------ Work
class RpcdistWork(tdist.Work):
    """torch's ``Work`` for an rpcdist operation (or several, completed together).

    ``wait()`` raises the operation's own error (an rpcdist ``DistributedError`` naming the
    rank); ``get_future()`` is a torch Future of ``outputs`` that fails if the operation did,
    so C++ callers such as DDP's reducer see the error too. ``await work`` works in async code.
    """

    def __init__(
        self,
        work: Work,
        outputs: list[torch.Tensor],
        source_rank: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        self._work = work
        self._outputs = outputs
        self._source_rank_of = source_rank
        self._torch_future: torch.futures.Future[Any] | None = None
        self._future_lock = threading.Lock()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done; raises the operation's error. ``timeout`` (torch passes 0 for
        none) defaults to the process group's timeout."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._work.wait(seconds if seconds else None)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A torch Future completed with the list of output tensors (failed if the op did)."""
        with self._future_lock:
            if self._torch_future is None:
                outputs = self._outputs

                def outcome(done: Any) -> list[torch.Tensor]:
                    done.wait()  # raises the operation's error into the torch future
                    return outputs

                # torch's own then: an exception in the callback becomes a C++ error of the
                # chained future, which C++ consumers (DDP) see as a failure, not as a value.
                self._torch_future = torch._C.Future.then(self._work.get_future().torch_future(), outcome)
            return self._torch_future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        """The group rank a ``recv`` from any source received from."""
        if self._source_rank_of is None:
            raise RuntimeError("only a receive knows its source rank")
        return self._source_rank_of(self._work.result())

    def source_rank(self) -> int:
        return self._source_rank()

    def synchronize(self) -> None:
        """CPU only: nothing to synchronize."""

    def __await__(self) -> Generator[Any, None, Any]:
        return self._work.__await__()

    def __repr__(self) -> str:
        return f"<RpcdistWork {self._work!r}>"


def _together(works: Sequence[Work], what: str) -> Work:
    """One rpcdist Work that completes when all of ``works`` have (fails with the first error)."""
    if len(works) == 1:
        return works[0]
    futures = [w.get_future() for w in works]
    combined: Future[Any] = collect_all(futures).then(lambda _: [f.wait() for f in futures])
    timeout = max((w._timeout for w in works), default=0.0)
    return Work(combined, timeout, what)


def _done_work(outputs: list[torch.Tensor], what: str) -> RpcdistWork:
    future: Future[Any] = Future()
    future.set_result(None)
    return RpcdistWork(Work(future, 0.0, what), outputs)


# ------------------------------------------------------------------------------ ProcessGroup
class RpcdistProcessGroup(tdist.ProcessGroup):
    """A torch process group whose operations run on an rpcdist group.

    Ranks in the methods' arguments and options are *group* ranks, as torch passes them.
    """

    def __init__(
        self,
        group: ProcessGroup,
        *,
        owns_world: bool = False,
        exit_store: tdist.Store | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(group.rank(), group.size())
        self._group = group
        self._owns_world = owns_world  # rpcdist's world was made for torch: shut it down with us
        self._exit_store = exit_store
        self._loop = loop  # a use of rpcdist's loop this group holds (released at shutdown)
        self._closed = False

    @property
    def rpcdist_group(self) -> ProcessGroup:
        """The rpcdist process group the operations run on."""
        return self._group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch names every group (``group.group_name``, used by functional collectives and
    # DeviceMesh); a C++ group keeps it in its backends, which a Python group has none of.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._torch_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return getattr(self, "_torch_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        self._torch_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return getattr(self, "_torch_desc", "")

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"RpcdistProcessGroup(rank={self.rank()}, size={self.size()}, ranks={self._group.ranks})"

    # -- helpers --------------------------------------------------------------------------------
    def _global(self, group_rank: int) -> int:
        return self._group.global_rank(group_rank)

    @staticmethod
    def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{what}: the rpcdist backend takes exactly one tensor, got {len(tensors)}")
        return tensors[0]

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RpcdistWork:
        tensor = self._one(tensors, "allreduce")
        op = _reduce_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
        return RpcdistWork(api.all_reduce(tensor, op, group=self._group, async_op=True), list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RpcdistWork:
        op = _reduce_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
        works = [api.all_reduce(t, op, group=self._group, async_op=True) for t in tensors]
        if not works:
            return _done_work([], "allreduce_coalesced")
        return RpcdistWork(_together(works, "allreduce_coalesced"), list(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> RpcdistWork:
        tensor = self._one(tensors, "reduce")
        work = api.reduce(
            tensor, self._global(opts.rootRank), _reduce_op(opts.reduceOp), group=self._group, async_op=True
        )
        return RpcdistWork(work, list(tensors))

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> RpcdistWork:
        output = self._one(output_tensors, "reduce_scatter")
        inputs = self._one(input_tensors, "reduce_scatter")  # type: ignore[arg-type]
        op = _reduce_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
        work = api.reduce_scatter(output, list(inputs), op, group=self._group, async_op=True)
        return RpcdistWork(work, list(output_tensors))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RpcdistWork:
        op = _reduce_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
        work = api.reduce_scatter_tensor(output, input, op, group=self._group, async_op=True)
        return RpcdistWork(work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RpcdistWork:
        op = _reduce_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
        works = [
            api.reduce_scatter_tensor(o, i, op, group=self._group, async_op=True)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        if not works:
            return _done_work([], "reduce_scatter_single_coalesced")
        return RpcdistWork(_together(works, "reduce_scatter_single_coalesced"), list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RpcdistWork:
        tensor = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        work = api.broadcast(tensor, self._global(root), group=self._group, async_op=True)
        return RpcdistWork(work, list(tensors))

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> RpcdistWork:
        outputs = self._one(output_tensors, "allgather")  # type: ignore[arg-type]
        tensor = self._one(input_tensors, "allgather")
        work = api.all_gather(list(outputs), tensor, group=self._group, async_op=True)
        return RpcdistWork(work, list(outputs))

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> RpcdistWork:
        works = [
            api.all_gather(list(outs), t, group=self._group, async_op=True)
            for outs, t in zip(output_lists, input_list, strict=True)
        ]
        flat = [t for outs in output_lists for t in outs]
        if not works:
            return _done_work([], "allgather_coalesced")
        return RpcdistWork(_together(works, "allgather_coalesced"), flat)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RpcdistWork:
        work = api.all_gather_into_tensor(output, input, group=self._group, async_op=True)
        return RpcdistWork(work, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RpcdistWork:
        works = [
            api.all_gather_into_tensor(o, i, group=self._group, async_op=True)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        if not works:
            return _done_work([], "all_gather_single_coalesced")
        return RpcdistWork(_together(works, "all_gather_single_coalesced"), list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> RpcdistWork:
        tensor = self._one(input_tensors, "gather")
        gather_list = list(output_tensors[0]) if output_tensors else None
        work = api.gather(tensor, gather_list, self._global(opts.rootRank), group=self._group, async_op=True)
        return RpcdistWork(work, gather_list or [])

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any
    ) -> RpcdistWork:
        tensor = self._one(output_tensors, "scatter")
        scatter_list = list(input_tensors[0]) if input_tensors else None
        root = self._global(opts.rootRank)
        work = api.scatter(tensor, scatter_list, root, group=self._group, async_op=True)
        return RpcdistWork(work, list(output_tensors))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> RpcdistWork:
        work = api.all_to_all_single(
            output,
            input,
            list(output_split_sizes) if output_split_sizes else None,
            list(input_split_sizes) if input_split_sizes else None,
            group=self._group,
            async_op=True,
        )
        return RpcdistWork(work, [output])

    alltoall_base = all_to_all_single

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> RpcdistWork:
        work = api.all_to_all(list(output_tensors), list(input_tensors), group=self._group, async_op=True)
        return RpcdistWork(work, list(output_tensors))

    def barrier(self, opts: Any = None) -> RpcdistWork:
        return RpcdistWork(api.barrier(group=self._group, async_op=True), [])

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> RpcdistWork:  # noqa: N803
        tensor = self._one(tensors, "send")
        work = api.isend(tensor, self._global(dstRank), group=self._group, tag=tag)
        return RpcdistWork(work, list(tensors))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> RpcdistWork:  # noqa: N803
        tensor = self._one(tensors, "recv")
        work = api.irecv(tensor, self._global(srcRank), group=self._group, tag=tag)
        return RpcdistWork(work, list(tensors), self._group.group_rank_of)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> RpcdistWork:
        tensor = self._one(tensors, "recv_anysource")
        work = api.irecv(tensor, None, group=self._group, tag=tag)
        return RpcdistWork(work, list(tensors), self._group.group_rank_of)

    recvAnysource = recv_anysource  # noqa: N815 - torch's C++ name

    # -- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Called by ``torch.distributed.destroy_process_group``: if rpcdist's world was made
        for this group, leave it (every rank does, as torch's destroy is collective)."""
        if self._closed:
            return
        self._closed = True
        if not self._owns_world:
            return
        try:
            if api.is_initialized():
                api.destroy_process_group()
            self._leave_store()
        finally:
            if self._loop is not None:
                release_loop(self._loop)
                self._loop = None

    def abort(self) -> None:
        self.shutdown()

    def _leave_store(self) -> None:
        """torch's store lives in rank 0's process: rank 0 waits (bounded) until every rank is
        done with it, so its exit cannot pull the store from under a rank still leaving."""
        store = self._exit_store
        if store is None:
            return
        try:
            store.add("rpcdist-left", 1)
            if self.rank() == 0:
                deadline = time.monotonic() + _EXIT_TIMEOUT
                while int(store.add("rpcdist-left", 0)) < self.size():
                    if time.monotonic() > deadline:
                        log.warning("rank 0: not every rank left torch's store within %g s", _EXIT_TIMEOUT)
                        break
                    time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - leaving is best effort
            log.debug("leaving torch's store: %s", exc)


# ------------------------------------------------------------------------------ torch's store
class StoreForTorch(tdist.Store):
    """An rpcdist :class:`~rpcdist.store.Store` as a ``torch.distributed.Store`` (the store of
    the torch default group that ``rpcdist.init_process_group`` makes)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store.compare_set(key, bytes(expected), bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._store.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def append(self, key: str, value: Any) -> None:
        """Append to the bytes at ``key`` (created if absent), atomically (compare-and-set)."""
        extra = value.encode() if isinstance(value, str) else bytes(value)
        while True:
            current = self._store.get(key) if self._store.check([key]) else b""
            if self._store.compare_set(key, current, current + extra) == current + extra:
                return


# ------------------------------------------------------------------------------ the creator
def _create_backend(common: Any, backend_options: Any) -> RpcdistProcessGroup:
    """torch's backend creator (``extended_api``): a process group of ``common.group_size``
    ranks over rpcdist; rpcdist's world is made from torch's store if it does not exist yet."""
    rank, size = int(common.group_rank), int(common.group_size)
    global_ranks = list(common.global_ranks_in_group)
    timeout: timedelta = common.timeout
    owns_world, loop = False, None
    if not api.is_initialized():
        if global_ranks and global_ranks != list(range(size)):
            raise DistributedError(
                "new_group(backend='rpcdist') needs rpcdist's collectives: initialize the default "
                "group with backend 'rpcdist' (or call rpcdist.init_process_group) first"
            )
        # The adapter is made on rpcdist's loop, so it lives on that loop without a use of its
        # own (rpcdist closes it there at destroy); this group holds one use until shutdown.
        loop = acquire_loop()
        _creating.active = True
        try:
            store = call_blocking(loop, _torch_store(common.store, timeout))
            api.init_process_group("grpc", store=store, rank=rank, world_size=size, timeout=timeout)
        except BaseException:
            release_loop(loop)
            raise
        finally:
            _creating.active = False
        owns_world = True
    state = current_state()
    ranks = global_ranks or list(range(size))
    if len(ranks) != size or not 0 <= rank < size or ranks[rank] != state.rank:
        raise DistributedError(
            f"torch's group (rank {rank} of ranks {ranks}) does not match rpcdist's world "
            f"(this process is rank {state.rank} of {state.world_size})"
        )
    group = ProcessGroup(state, f"torch/{common.group_id}", ranks, timeout.total_seconds())
    return RpcdistProcessGroup(
        group, owns_world=owns_world, exit_store=common.store if owns_world else None, loop=loop
    )


async def _torch_store(store: tdist.Store, timeout: timedelta) -> Store:
    """torch's store as an rpcdist Store, made on (and bound to) the running loop."""
    from rpcdist.store.torch_store import TorchStore

    return TorchStore(store, timeout=timeout)


# ------------------------------------------------------------------------------ rpcdist's hooks
def _after_rpcdist_init() -> None:
    """After ``rpcdist.init_process_group``: make torch's default group on this backend, unless
    torch's creator is the one initializing rpcdist or the program made torch's group itself."""
    global _made_torch_default, _made_torch_store
    if getattr(_creating, "active", False) or tdist.is_initialized():
        return
    state = current_state()
    with _lock:
        store = StoreForTorch(PrefixStore(_TORCH_STORE_PREFIX, state.store))
        try:
            tdist.init_process_group(
                BACKEND_NAME,
                store=store,
                rank=state.rank,
                world_size=state.world_size,
                timeout=timedelta(seconds=state.timeout),
            )
        except Exception as exc:  # noqa: BLE001 - rpcdist's own group works regardless
            warnings.warn(f"torch.distributed's default group was not made on rpcdist: {exc}", stacklevel=3)
            return
        _made_torch_default, _made_torch_store = tdist.group.WORLD, store


def _before_rpcdist_destroy() -> None:
    """Before ``rpcdist.destroy_process_group``: destroy torch's default group if rpcdist made it."""
    global _made_torch_default, _made_torch_store
    with _lock:
        made, store = _made_torch_default, _made_torch_store  # alive until torch is done with it
        _made_torch_default = _made_torch_store = None
        if made is None or not tdist.is_initialized() or tdist.group.WORLD is not made:
            return
        try:
            tdist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - rpcdist's own teardown goes on
            log.warning("destroying torch.distributed's default group failed: %s", exc)
        del store


def register() -> None:
    """Register the ``"rpcdist"`` backend with torch (CPU) and hook torch's default group to
    rpcdist's. Idempotent; ``import rpcdist`` calls it."""
    if not tdist.is_available():
        return
    if BACKEND_NAME.upper() not in tdist.Backend._plugins:
        tdist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])
    if _after_rpcdist_init not in api._init_hooks:
        api._init_hooks.append(_after_rpcdist_init)
    if _before_rpcdist_destroy not in api._destroy_hooks:
        api._destroy_hooks.append(_before_rpcdist_destroy)
