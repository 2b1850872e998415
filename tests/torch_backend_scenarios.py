"""Scenarios of ``test_torch_backend``: rpcdist as a ``torch.distributed`` backend, run by the
multi-process harness as ``scenario(rank, world_size, init_method, **params)``.

Importing this module registers the scenarios on ``rpc_scenarios`` (where ``_harness`` looks them
up); the test makes every worker import it.

The reference is gloo itself: each scenario also makes a gloo group of the same ranks
(``torch.distributed.new_group(backend="gloo")``) and runs every check on both groups with the
same inputs, and the outputs must be equal (exactly, except DDP's float64 training, which must
be ``allclose``). Every rank runs the same checks in the same order, so the collectives line up.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import rpc_scenarios
import torch
import torch.distributed as tdist
from _harness import check
from rpc_scenarios import raises
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import rpcdist
from rpcdist.collectives.group import DistributedError
from rpcdist.collectives.torch_backend import RpcdistProcessGroup, RpcdistWork

GROUP_TIMEOUT = timedelta(seconds=60)  # a collective that hangs fails its check after this long
RING_NUMEL = 100_000  # 400 KiB of float32: rpcdist's ring all_reduce on 3 ranks


# ============================================================================ helpers
def make(dtype: torch.dtype, shape: tuple[int, ...], *key: Any, lo: int = -20, hi: int = 21) -> torch.Tensor:
    """Deterministic small integers (exact in every dtype) for ``key``."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randint(lo, hi, shape, generator=generator, dtype=torch.int64).to(dtype)


def assert_equal(actual: Any, expected: Any, path: str = "output") -> None:
    """Deep equality of (lists/dicts of) tensors and objects, dtypes and shapes included."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
            f"{path}: {actual.dtype} {list(actual.shape)} != {expected.dtype} {list(expected.shape)}"
        )
        assert torch.equal(actual, expected), f"{path}: values differ\nrpcdist: {actual}\ngloo:    {expected}"
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: {len(actual)} items != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_equal(actual[k], expected[k], f"{path}[{k!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def same_as_gloo(name: str, ours: Any, gloo: Any, run: Callable[[Any], Any]) -> None:
    """Check ``name``: ``run(group)`` gives the same outputs on the rpcdist group as on gloo's."""
    with check(name) as c:
        got = run(ours)
        want = run(gloo)
        assert_equal(got, want)
        c.value = _summary(got)


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.flatten()[:4].tolist()
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value[:4]]
    return repr(value)[:80]


def op_named(name: str) -> Any:
    return getattr(tdist.ReduceOp, name)


# ============================================================================ collectives
REDUCE_CASES = (
    ("float32", ("SUM", "PRODUCT", "MIN", "MAX")),
    ("float64", ("SUM", "MAX")),
    ("int64", ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")),
    ("int32", ("SUM", "BXOR")),
)


def _value_range(op: str) -> tuple[int, int]:
    if op == "PRODUCT":
        return -3, 4
    if op in ("BAND", "BOR", "BXOR"):
        return -(1 << 20), 1 << 20
    return -20, 21


def collectives_vs_gloo(rank: int, n: int, ours: Any, gloo: Any) -> None:  # noqa: C901 - a list of checks
    """torch.distributed's tensor collectives on the rpcdist group and on gloo's, same inputs."""
    def all_reduce(dtype: torch.dtype, op: str, group: Any) -> Any:
        lo, hi = _value_range(op)
        t = make(dtype, (7,), "all_reduce", dtype, op, rank, lo=lo, hi=hi)
        tdist.all_reduce(t, op=op_named(op), group=group)
        return t

    for dtype_name, ops in REDUCE_CASES:
        for op in ops:
            run = functools.partial(all_reduce, getattr(torch, dtype_name), op)
            same_as_gloo(f"all_reduce/{dtype_name}/{op}", ours, gloo, run)

    def ring(group: Any) -> Any:
        t = make(torch.float32, (RING_NUMEL,), "ring", rank)
        tdist.all_reduce(t, group=group)
        return t

    same_as_gloo("all_reduce/ring_sized", ours, gloo, ring)

    with check("all_reduce/AVG"):  # gloo has no AVG: the reference is SUM / n
        t = make(torch.float64, (5,), "avg", rank)
        total = sum(make(torch.float64, (5,), "avg", r) for r in range(n))
        tdist.all_reduce(t, op=tdist.ReduceOp.AVG, group=ours)
        assert torch.allclose(t, total / n), (t, total / n)

    with check("all_reduce/async_work_and_future"):
        t = make(torch.float32, (4,), "async", rank)
        work = tdist.all_reduce(t, group=ours, async_op=True)
        assert isinstance(work, RpcdistWork), type(work)
        future = work.get_future()
        gloo_work = tdist.all_reduce(torch.ones(1), group=gloo, async_op=True)
        assert type(future) is type(gloo_work.get_future()), type(future)  # torch's C++ Future, as gloo's
        gloo_work.wait()
        value = future.wait()
        expected = sum(make(torch.float32, (4,), "async", r) for r in range(n))
        assert isinstance(value, list) and len(value) == 1, value
        assert torch.equal(value[0], expected) and value[0].data_ptr() == t.data_ptr()
        assert work.wait() and work.is_completed() and work.is_success()

    for src in range(n):

        def broadcast(group: Any, src: int = src) -> Any:
            t = make(torch.float32, (3, 2), "broadcast", src, rank)
            tdist.broadcast(t, src=src, group=group)
            return t

        same_as_gloo(f"broadcast/src{src}", ours, gloo, broadcast)

    def all_gather(group: Any) -> Any:
        out = [torch.zeros(2, 3, dtype=torch.int64) for _ in range(n)]
        tdist.all_gather(out, make(torch.int64, (2, 3), "all_gather", rank), group=group)
        return out

    same_as_gloo("all_gather", ours, gloo, all_gather)

    def all_gather_into_tensor(group: Any) -> Any:
        out = torch.zeros(n * 4)
        tdist.all_gather_into_tensor(out, make(torch.float32, (4,), "agit", rank), group=group)
        return out

    same_as_gloo("all_gather_into_tensor", ours, gloo, all_gather_into_tensor)

    for dst in range(n):

        def reduce(group: Any, dst: int = dst) -> Any:
            t = make(torch.float32, (5,), "reduce", dst, rank)
            tdist.reduce(t, dst=dst, op=tdist.ReduceOp.MAX, group=group)
            return t if rank == dst else None  # non-destination buffers are unspecified

        same_as_gloo(f"reduce/dst{dst}", ours, gloo, reduce)

    def gather(group: Any) -> Any:
        dst = n - 1
        out = [torch.zeros(3) for _ in range(n)] if rank == dst else None
        tdist.gather(make(torch.float32, (3,), "gather", rank), out, dst=dst, group=group)
        return out

    same_as_gloo("gather", ours, gloo, gather)

    def scatter(group: Any) -> Any:
        src = 1 % n
        parts = [make(torch.float64, (2,), "scatter", r) for r in range(n)] if rank == src else None
        out = torch.zeros(2, dtype=torch.float64)
        tdist.scatter(out, parts, src=src, group=group)
        return out

    same_as_gloo("scatter", ours, gloo, scatter)

    def reduce_scatter(group: Any) -> Any:
        out = torch.zeros(3)
        tdist.reduce_scatter(out, [make(torch.float32, (3,), "rs", rank, r) for r in range(n)], group=group)
        return out

    same_as_gloo("reduce_scatter", ours, gloo, reduce_scatter)

    def reduce_scatter_tensor(group: Any) -> Any:
        out = torch.zeros(2, dtype=torch.int64)
        tdist.reduce_scatter_tensor(out, make(torch.int64, (2 * n,), "rst", rank), group=group)
        return out

    same_as_gloo("reduce_scatter_tensor", ours, gloo, reduce_scatter_tensor)

    def all_to_all_single(group: Any) -> Any:
        out = torch.zeros(2 * n)
        tdist.all_to_all_single(out, make(torch.float32, (2 * n,), "a2a", rank), group=group)
        return out

    same_as_gloo("all_to_all_single/even", ours, gloo, all_to_all_single)

    def all_to_all_splits(group: Any) -> Any:
        # rank r sends j+1 rows to rank j, so it receives r+1 rows from everyone
        inputs = make(torch.float32, (sum(j + 1 for j in range(n)), 2), "a2a-splits", rank)
        out = torch.zeros(n * (rank + 1), 2)
        splits_in, splits_out = [j + 1 for j in range(n)], [rank + 1] * n
        tdist.all_to_all_single(
            out, inputs, output_split_sizes=splits_out, input_split_sizes=splits_in, group=group
        )
        return out

    same_as_gloo("all_to_all_single/split_sizes", ours, gloo, all_to_all_splits)

    with check("all_to_all"):  # gloo has no list all_to_all: the reference is built here
        inputs = [make(torch.float32, (2,), "a2a-list", rank, j) for j in range(n)]
        out = [torch.zeros(2) for _ in range(n)]
        tdist.all_to_all(out, inputs, group=ours)
        assert_equal(out, [make(torch.float32, (2,), "a2a-list", j, rank) for j in range(n)])

    with check("barrier"):
        tdist.barrier(group=ours)
        work = tdist.barrier(group=ours, async_op=True)
        assert work.wait()


def objects_vs_gloo(rank: int, n: int, ours: Any, gloo: Any) -> None:
    """torch's object collectives (pickles through all_gather/broadcast/send/recv)."""

    def obj(r: int) -> dict[str, Any]:
        return {"rank": r, "text": "x" * (r * 7 + 1), "tensor": torch.arange(float(r + 1))}

    def all_gather_object(group: Any) -> Any:
        out: list[Any] = [None] * n
        tdist.all_gather_object(out, obj(rank), group=group)
        return out

    same_as_gloo("all_gather_object", ours, gloo, all_gather_object)

    def broadcast_object_list(group: Any) -> Any:
        items = [obj(0), "second", 3] if rank == 0 else [None, None, None]
        tdist.broadcast_object_list(items, src=0, group=group)
        return items

    same_as_gloo("broadcast_object_list", ours, gloo, broadcast_object_list)

    def gather_object(group: Any) -> Any:
        out = [None] * n if rank == 0 else None
        tdist.gather_object(obj(rank), out, dst=0, group=group)
        return out

    same_as_gloo("gather_object", ours, gloo, gather_object)

    def scatter_object_list(group: Any) -> Any:
        out: list[Any] = [None]
        tdist.scatter_object_list(out, [obj(r) for r in range(n)] if rank == 0 else None, src=0, group=group)
        return out

    same_as_gloo("scatter_object_list", ours, gloo, scatter_object_list)

    def send_recv_object_list(group: Any) -> Any:
        if rank == 0:
            tdist.send_object_list([obj(0), [1, 2]], dst=1, group=group)
            return None
        if rank == 1:
            items: list[Any] = [None, None]
            tdist.recv_object_list(items, src=0, group=group)
            return items
        return None

    same_as_gloo("send_recv_object_list", ours, gloo, send_recv_object_list)


def p2p_vs_gloo(rank: int, n: int, ours: Any, gloo: Any) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n

    def ring(group: Any) -> Any:
        out = torch.zeros(4)
        send = tdist.isend(make(torch.float32, (4,), "ring", rank), dst=right, group=group)
        recv = tdist.irecv(out, src=left, group=group)
        send.wait()
        recv.wait()
        return out

    same_as_gloo("send_recv/ring_isend_irecv", ours, gloo, ring)

    def blocking(group: Any) -> Any:
        if rank == 0:
            tdist.send(make(torch.int64, (3,), "blocking"), dst=n - 1, group=group, tag=7)
            return None
        if rank == n - 1:
            out = torch.zeros(3, dtype=torch.int64)
            tdist.recv(out, src=0, group=group, tag=7)
            return out
        return None

    same_as_gloo("send_recv/blocking_with_tag", ours, gloo, blocking)

    def any_source(group: Any) -> Any:
        if rank == 0:
            got = {}
            for _ in range(n - 1):
                out = torch.zeros(2)
                sender = tdist.recv(out, group=group)  # src=None: from whoever sends
                got[sender] = out
            return got
        tdist.send(torch.full((2,), float(rank)), dst=0, group=group)
        return None

    same_as_gloo("send_recv/any_source", ours, gloo, any_source)

    def batch(group: Any) -> Any:
        out = torch.zeros(3)
        ops = [
            tdist.P2POp(tdist.irecv, out, left, group),
            tdist.P2POp(tdist.isend, make(torch.float32, (3,), "batch", rank), right, group),
        ]
        for work in tdist.batch_isend_irecv(ops):
            work.wait()
        return out

    same_as_gloo("batch_isend_irecv", ours, gloo, batch)


def sub_groups_vs_gloo(rank: int, n: int) -> None:
    """torch's new_group on the rpcdist backend (the default's), against gloo's of the same ranks."""
    members = [0, n - 1]
    ours = tdist.new_group(members)  # backend: the default group's, rpcdist
    gloo = tdist.new_group(members, backend="gloo")
    with check("subgroup/membership"):
        if rank in members:
            assert isinstance(ours, RpcdistProcessGroup), type(ours)
            assert tdist.get_backend(ours) == "rpcdist"
            assert tdist.get_rank(ours) == members.index(rank) and tdist.get_world_size(ours) == 2
        else:
            assert ours is tdist.GroupMember.NON_GROUP_MEMBER, ours
    if rank not in members:
        for name in ("subgroup/all_reduce", "subgroup/broadcast_global_src", "subgroup/all_gather_object"):
            with check(name):
                pass
        return

    def all_reduce(group: Any) -> Any:
        t = make(torch.float32, (3,), "sub", rank)
        tdist.all_reduce(t, group=group)
        return t

    same_as_gloo("subgroup/all_reduce", ours, gloo, all_reduce)

    def broadcast(group: Any) -> Any:
        t = make(torch.int64, (2,), "sub-bcast", rank)
        tdist.broadcast(t, src=n - 1, group=group)  # a global rank, as torch takes it
        return t

    same_as_gloo("subgroup/broadcast_global_src", ours, gloo, broadcast)

    def objects(group: Any) -> Any:
        out: list[Any] = [None, None]
        tdist.all_gather_object(out, ("member", rank), group=group)
        return out

    same_as_gloo("subgroup/all_gather_object", ours, gloo, objects)


def errors(rank: int, n: int, ours: Any) -> None:
    with check("errors/premul_sum_refused"):
        with raises(ValueError, match="PREMUL_SUM"):
            tdist.all_reduce(torch.ones(2), op=tdist._make_nccl_premul_sum(2.0), group=ours)
    with check("errors/shape_mismatch_named"):  # every rank gets the error, nobody hangs
        with raises(DistributedError, match="shape") as caught:
            tdist.all_reduce(torch.ones(2 + (rank == 0)), group=ours)
        assert "rank" in str(caught.value)
    with check("errors/failed_future_raises"):  # the torch Future of a failed op fails too
        work = tdist.all_reduce(torch.ones(3 + (rank == 0)), group=ours, async_op=True)
        with raises(RuntimeError, match="shape"):
            work.get_future().wait()
        with raises(DistributedError, match="shape"):
            work.wait()
        assert work.is_completed() and not work.is_success()
    with check("errors/still_in_step"):
        t = torch.ones(1)
        tdist.all_reduce(t, group=ours)
        assert t.item() == n


# ============================================================================ DDP
class Net(nn.Module):
    """A small MLP (float64); ``unused`` takes no part in forward (find_unused_parameters)."""

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 8)
        self.fc3 = nn.Linear(8, 3)
        if with_unused:
            self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch_of(rank: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 6, generator=generator, dtype=torch.float64)
    return x, x[:, :3].sin() + 0.1 * x[:, 3:].sum(1, keepdim=True)


def train(
    rank: int,
    group: Any,
    steps: int = 4,
    *,
    find_unused: bool = False,
    no_sync_steps: tuple[int, ...] = (),
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, list[list[torch.Tensor]]]:
    """DDP training from the same initial model (ranks perturbed: DDP must broadcast rank 0's);
    the gradients after each synchronized backward and the parameters after each step."""
    torch.manual_seed(0)
    model = Net(with_unused=find_unused).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)
    kwargs: dict[str, Any] = {} if group is None else {"process_group": group}
    ddp = DDP(model, bucket_cap_mb=0.0005, find_unused_parameters=find_unused, **kwargs)  # several buckets
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    trained = [p for name, p in model.named_parameters() if not name.startswith("unused")]
    out: dict[str, list[list[torch.Tensor]]] = {"initial": [[p.detach().clone() for p in trained]]}
    out["grads"], out["params"] = [], []
    batches = batches if batches is not None else [batch_of(rank, s) for s in range(steps)]
    for step, (x, y) in enumerate(batches):
        if step in no_sync_steps:  # accumulate locally, no allreduce
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()
            continue
        nn.functional.mse_loss(ddp(x), y).backward()
        out["grads"].append([p.grad.detach().clone() for p in trained])
        optimizer.step()
        optimizer.zero_grad()
        out["params"].append([p.detach().clone() for p in trained])
    return out


def assert_close_runs(ours: dict[str, Any], gloo: dict[str, Any]) -> None:
    for key in ("initial", "grads", "params"):
        assert len(ours[key]) == len(gloo[key]) and ours[key], (key, len(ours[key]), len(gloo[key]))
        for step, (a, b) in enumerate(zip(ours[key], gloo[key], strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.allclose(x, y, rtol=1e-12, atol=1e-14), f"{key} step {step} #{i}:\n{x}\n{y}"


def assert_same_on_every_rank(run: dict[str, Any], gloo: Any, n: int) -> None:
    """The synchronized parameters are the same on every rank (gathered through gloo)."""
    flat = torch.cat([p.flatten() for p in run["params"][-1]])
    every = [torch.zeros_like(flat) for _ in range(n)]
    tdist.all_gather(every, flat, group=gloo)
    for r in range(1, n):
        assert torch.equal(every[r], every[0]), f"rank {r}'s parameters differ from rank 0's"


def ddp_vs_gloo(rank: int, n: int, ours: Any, gloo: Any) -> None:
    with check("ddp/same_as_gloo") as c:
        mine, theirs = train(rank, ours), train(rank, gloo)
        assert_close_runs(mine, theirs)
        assert_same_on_every_rank(mine, gloo, n)
        assert not torch.equal(mine["grads"][0][0], mine["grads"][1][0])  # it did train
        c.value = float(mine["grads"][-1][0].norm())
    with check("ddp/find_unused_parameters_and_no_sync"):
        options = {"find_unused": True, "no_sync_steps": (1,), "steps": 4}
        mine, theirs = train(rank, ours, **options), train(rank, gloo, **options)
        assert_close_runs(mine, theirs)
        assert_same_on_every_rank(mine, gloo, n)


# ============================================================================ scenarios
def torch_first(rank: int, world_size: int, init_method: str, **_: Any) -> dict[str, Any]:
    """torch.distributed.init_process_group("rpcdist"): rpcdist's world is made from torch's store."""
    with check("init"):
        tdist.init_process_group(
            "rpcdist", init_method=init_method, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        assert tdist.is_initialized() and tdist.get_backend() == "rpcdist"
        assert (tdist.get_rank(), tdist.get_world_size()) == (rank, world_size)
        assert isinstance(tdist.group.WORLD, RpcdistProcessGroup), type(tdist.group.WORLD)
        assert rpcdist.is_initialized() and rpcdist.get_rank() == rank  # made from torch's store
    ours = tdist.group.WORLD
    gloo = tdist.new_group(backend="gloo")
    collectives_vs_gloo(rank, world_size, ours, gloo)
    objects_vs_gloo(rank, world_size, ours, gloo)
    p2p_vs_gloo(rank, world_size, ours, gloo)
    sub_groups_vs_gloo(rank, world_size)
    errors(rank, world_size, ours)
    ddp_vs_gloo(rank, world_size, ours, gloo)
    with check("destroy"):
        tdist.destroy_process_group()
        assert not tdist.is_initialized()
        assert not rpcdist.is_initialized()  # rpcdist's world went with torch's group
    return {"rank": rank}


def rpcdist_first(
    rank: int, world_size: int, init_method: str, second_init: str, third_init: str, **_: Any
) -> dict[str, Any]:
    """rpcdist.init_process_group makes torch's default group; DDP/DistributedSampler need nothing else."""
    with check("init"):
        rpcdist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        assert tdist.is_initialized() and tdist.get_backend() == "rpcdist"
        assert (tdist.get_rank(), tdist.get_world_size()) == (rank, world_size)
        assert isinstance(tdist.group.WORLD, RpcdistProcessGroup)
    with check("torch_store_is_rpcdist_store"):  # the default group's store reaches the other ranks
        store = tdist.distributed_c10d._get_default_store()
        store.set(f"hello/{rank}", f"from {rank}")
        assert store.get(f"hello/{(rank + 1) % world_size}") == f"from {(rank + 1) % world_size}".encode()
        store.add("count", 1)
        store.wait(["count"])
    gloo = tdist.new_group(backend="gloo")  # gloo's rendezvous runs through that store
    with check("torch_collectives"):
        t = torch.tensor([rank + 1.0])
        tdist.all_reduce(t)
        assert t.item() == sum(range(1, world_size + 1))
        objs: list[Any] = [None] * world_size
        tdist.all_gather_object(objs, {"rank": rank})
        assert objs == [{"rank": r} for r in range(world_size)]
        tdist.barrier()
    with check("rpcdist_and_torch_interleaved"):
        a, b = torch.tensor([1.0 + rank]), torch.tensor([10.0 * (rank + 1)])
        work = rpcdist.all_reduce(a, async_op=True)
        tdist.all_reduce(b)
        work.wait()
        assert (a.item(), b.item()) == (3.0, 30.0)
    with check("functional_collectives_and_device_mesh"):
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh

        assert tdist.group.WORLD.group_name  # torch's name for the group, kept by the backend
        summed = funcol.all_reduce(torch.full((2,), rank + 1.0), "sum", tdist.group.WORLD)
        assert torch.equal(summed.wait() if hasattr(summed, "wait") else summed, torch.full((2,), 3.0))
        mesh = init_device_mesh("cpu", (world_size,))
        gathered = funcol.all_gather_tensor(torch.tensor([float(rank)]), 0, mesh)
        assert torch.equal(torch.as_tensor(gathered), torch.arange(float(world_size)))
    with check("ddp_without_process_group_same_as_gloo"):
        mine = train(rank, None, no_sync_steps=(2,), steps=5)
        theirs = train(rank, gloo, no_sync_steps=(2,), steps=5)
        assert_close_runs(mine, theirs)
        assert_same_on_every_rank(mine, gloo, world_size)
    with check("distributed_sampler_ddp") as c:
        data = TensorDataset(*batch_of(99, 0, size=40))
        sampler = DistributedSampler(data, shuffle=True, seed=3)  # rank and size from the default group
        assert (sampler.rank, sampler.num_replicas) == (rank, world_size)
        explicit = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=3)
        assert list(sampler) == list(explicit)
        everyone: list[Any] = [None] * world_size
        tdist.all_gather_object(everyone, list(sampler))
        assert sorted(i for part in everyone for i in part) == list(range(len(data)))
        batches = list(DataLoader(data, batch_size=5, sampler=sampler))
        mine = train(rank, None, batches=batches)
        theirs = train(rank, gloo, batches=batches)
        assert_close_runs(mine, theirs)
        c.value = len(batches)
    with check("destroy"):
        rpcdist.destroy_process_group()
        assert not rpcdist.is_initialized()
        assert not tdist.is_initialized()  # torch's default group went with rpcdist's
    leave_torch_group_alone(rank, world_size, second_init, third_init)
    return {"rank": rank}


def leave_torch_group_alone(rank: int, world_size: int, torch_init: str, rpcdist_init: str) -> None:
    """A default group the program made itself stays as it is; new_group(backend="rpcdist")
    then runs on rpcdist's world."""
    with check("own_torch_group/init_both"):
        tdist.init_process_group(
            "gloo", init_method=torch_init, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        rpcdist.init_process_group(
            "gloo", init_method=rpcdist_init, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        assert tdist.get_backend() == "gloo"
    with check("own_torch_group/new_group_rpcdist"):
        group = tdist.new_group(backend="rpcdist")
        assert isinstance(group, RpcdistProcessGroup)
        t = torch.tensor([rank + 1.0])
        tdist.all_reduce(t, group=group)
        assert t.item() == sum(range(1, world_size + 1))
    with check("own_torch_group/left_alone"):
        rpcdist.destroy_process_group()
        assert tdist.is_initialized() and tdist.get_backend() == "gloo"
        t = torch.tensor([1.0])
        tdist.all_reduce(t)
        assert t.item() == world_size
        tdist.destroy_process_group()
        assert not tdist.is_initialized()


SCENARIOS = ["torch_first", "rpcdist_first"]


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for name in SCENARIOS:
        setattr(rpc_scenarios, name, globals()[name])


_register()
