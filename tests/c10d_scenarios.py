"""Scenarios of the c10d tests (``test_collectives``, ``test_p2p``), run by the multi-process
harness: ``scenario(rank, world_size, init_method, **params)``.

``_harness`` looks scenarios up on ``rpc_scenarios``; importing this module registers the ones
below there too (see :func:`_register`), and the tests make every worker import it (see
``c10d_functions.launch``).

Every rank runs the same list of checks (``with check("name"):``), so the collectives line up:
a check is one collective call (or a few) on every rank, and each rank asserts its own output
against a reference it computes itself from the inputs of every rank, which are deterministic
functions of (rank, case) (see :func:`make`). Ranks that have no part in a check pass through
it. Process groups get a bounded timeout, so a hang becomes a recorded failure; in the big
suite every check ends with a barrier on a group of its own (:func:`step`), so a check that
hangs on some ranks does not put the ranks out of step for the checks after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import time
import warnings
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import rpc_scenarios
import torch
from _harness import check
from c10d_functions import (
    DATA_MOVEMENT,
    DTYPES,
    OBJECT_COLLECTIVES,
    REDUCTIONS,
    RING_CASES,
    TINY,
    ops_for,
)
from rpc_scenarios import assert_same, full_text, raises

import rpcdist as dist
import rpcdist.rpc as rpc
from rpcdist.collectives import api as c10d_api
from rpcdist.errors import BlockingCallError

GROUP_TIMEOUT = 60.0  # a collective that hangs fails its check after this long
SYNC_TIMEOUT = 150.0  # the barrier between two checks of the suite outlasts a hung check
OBJECT_TIMEOUT = 10.0  # the group of the object collectives (a hang there costs 10 s, not 60)
SHORT_TIMEOUT = 10.0  # groups of the error scenarios, where some failures end in a timeout
RING_BYTES = 300 << 10  # above algorithms.RING_MIN_BYTES (256 KiB)
LARGE_NUMEL = 16 << 20  # 64 MiB of float32

TOLERANCE = {  # (rtol, atol) of the reference comparison; integers and bool must be exact
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


# ============================================================================ helpers
def init(
    rank: int, world_size: int, init_method: str, timeout: float = GROUP_TIMEOUT, backend: str = "grpc"
) -> None:
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def make(dtype: torch.dtype, shape: tuple[int, ...], *key: Any, lo: int = -20, hi: int = 21) -> torch.Tensor:
    """Deterministic small-integer values (exact in every dtype, fp16/bf16 included) for ``key``."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(lo, hi, shape, generator=generator, dtype=torch.int64).to(dtype)


def value_range(op: str) -> tuple[int, int]:
    """Input range of a reduction: products stay small, bitwise ops get many bits."""
    if op == "PRODUCT":
        return -3, 4
    if op in ("BAND", "BOR", "BXOR"):
        return -(1 << 20), 1 << 20
    return -20, 21


def reference(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of ``tensors`` computed here, in float64 / int64 / bool logic."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(tensors)
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        if op == "BXOR":
            return stack.sum(0) % 2 == 1
        raise ValueError(op)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in tensors])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.amin(0)
    elif op == "MAX":
        out = stack.amax(0)
    elif op == "AVG":
        out = stack.mean(0)
    else:
        bitwise = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = functools.reduce(bitwise, stack.unbind(0))
    return out.to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype and shape; values equal (integers, bool) or within the dtype's tolerance.

    (Not torch.testing.assert_close: its first call imports for seconds on a loaded machine.)
    """
    if expected.dtype not in TOLERANCE:
        assert_equal(actual, expected, what)
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    rtol, atol = TOLERANCE[expected.dtype]
    a, e = actual.double(), expected.double()
    close = (a - e).abs() <= atol + rtol * e.abs()
    if not bool(close.all()):
        where = (~close).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: {int((~close).sum())} of {close.numel()} values differ beyond rtol={rtol} atol={atol}, "
            f"e.g. at {where}: got {[a[tuple(i)].item() for i in where]}, "
            f"expected {[e[tuple(i)].item() for i in where]}"
        )


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: values differ\n{actual}\n!=\n{expected}"


_sync_group: Any = None  # the suite's barrier group (see :func:`step`)


@contextlib.contextmanager
def step(name: str) -> Iterator[check]:
    """``check(name)``, then a barrier of every rank (on a group of its own, with a long
    timeout): a check that hangs on some ranks until its timeout does not put the ranks out of
    step for the next ones, so one failure stays one failure."""
    try:
        with check(name) as c:
            yield c
    finally:
        if _sync_group is not None:
            dist.barrier(group=_sync_group)


# ============================================================================ full suite
def c10d_collectives(
    rank: int, world_size: int, init_method: str, workdir: str, large: bool = False, **_: Any
) -> dict[str, Any]:
    """Every collective on every dtype and applicable op, tiny and ring-sized tensors, the
    object collectives, barriers, (world >= 3) sub-groups, async ops; 64 MiB with ``large``."""
    global _sync_group
    init(rank, world_size, init_method)
    _sync_group = dist.new_group(timeout=timedelta(seconds=SYNC_TIMEOUT))
    objects = dist.new_group(timeout=timedelta(seconds=OBJECT_TIMEOUT))
    _reductions(rank, world_size)
    _ring(rank, world_size)
    _data_movement(rank, world_size)
    _tiny(rank, world_size)
    _objects(rank, world_size, objects)
    _barriers(rank, world_size, Path(workdir))
    if world_size >= 3:
        _groups(rank, world_size)
    _async_ops(rank, world_size)
    if large:
        _large(rank, world_size)
    _sync_group = None
    dist.destroy_process_group()
    with check("destroyed"):
        assert not dist.is_initialized()
    return {"rank": rank}


def _reductions(rank: int, n: int) -> None:
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for index, op_name in enumerate(ops_for(dtype_name)):
            op = getattr(dist.ReduceOp, op_name)
            lo, hi = value_range(op_name)
            for collective in REDUCTIONS:
                with step(f"{collective}/{dtype_name}/{op_name}"):
                    key = (collective, dtype_name, op_name)
                    if collective == "all_reduce":
                        inputs = [make(dtype, (3, 5), *key, r, lo=lo, hi=hi) for r in range(n)]
                        t = inputs[rank].clone()
                        assert dist.all_reduce(t, op=op) is None
                        assert_close(t, reference(op_name, inputs))
                    elif collective == "reduce":
                        dst = index % n
                        inputs = [make(dtype, (3, 5), *key, r, lo=lo, hi=hi) for r in range(n)]
                        t = inputs[rank].clone()
                        dist.reduce(t, dst=dst, op=op)
                        if rank == dst:
                            assert_close(t, reference(op_name, inputs))
                    else:
                        # inputs[r][i]: what rank r contributes to rank i's output.
                        inputs = [
                            [make(dtype, (2, 3), *key, r, i, lo=lo, hi=hi) for i in range(n)]
                            for r in range(n)
                        ]
                        out = torch.empty((2, 3), dtype=dtype)
                        if collective == "reduce_scatter":
                            dist.reduce_scatter(out, [x.clone() for x in inputs[rank]], op=op)
                        else:
                            dist.reduce_scatter_tensor(out, torch.cat(inputs[rank]), op=op)
                        assert_close(out, reference(op_name, [inputs[r][rank] for r in range(n)]))
    with step("all_reduce/legacy_reduce_op"):
        for legacy, name in ((dist.reduce_op.SUM, "SUM"), (dist.reduce_op.MAX, "MAX")):
            inputs = [make(torch.float32, (4,), "legacy", name, r) for r in range(n)]
            t = inputs[rank].clone()
            dist.all_reduce(t, op=legacy)
            assert_close(t, reference(name, inputs), f"reduce_op.{name}")
    with step("all_reduce/default_op_is_sum"):
        inputs = [make(torch.int64, (4,), "default", r) for r in range(n)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert_equal(t, reference("SUM", inputs))
    with step("all_reduce/contiguous_view"):
        base = torch.full((10,), -1.0)
        view = base[2:6]  # contiguous, storage offset 2: the result must land in ``base``
        view.copy_(torch.arange(4.0) + rank)
        dist.all_reduce(view)
        expected = torch.full((10,), -1.0)
        expected[2:6] = torch.arange(4.0) * n + sum(range(n))
        assert_equal(base, expected)


def _ring(rank: int, n: int) -> None:
    for dtype_name, op_name in RING_CASES:
        with step(f"ring/{dtype_name}/{op_name}"):
            dtype = dtype_of(dtype_name)
            numel = RING_BYTES // torch.empty((), dtype=dtype).element_size() + 7  # uneven segments
            lo, hi = value_range(op_name)
            inputs = [make(dtype, (numel,), "ring", dtype_name, op_name, r, lo=lo, hi=hi) for r in range(n)]
            t = inputs[rank].clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
            assert_close(t, reference(op_name, inputs))


def _data_movement(rank: int, n: int) -> None:  # noqa: C901 - one block per collective
    for index, dtype_name in enumerate(DTYPES):
        dtype = dtype_of(dtype_name)
        root = index % n  # src/dst rotates over the dtypes
        for collective in DATA_MOVEMENT:
            with step(f"{collective}/{dtype_name}"):
                key = (collective, dtype_name)
                if collective == "broadcast":
                    t = make(dtype, (4, 3), *key) if rank == root else torch.zeros((4, 3), dtype=dtype)
                    dist.broadcast(t, src=root)
                    assert_equal(t, make(dtype, (4, 3), *key))
                elif collective == "all_gather":
                    outs = [torch.empty((2, 3), dtype=dtype) for _ in range(n)]
                    dist.all_gather(outs, make(dtype, (2, 3), *key, rank))
                    for r in range(n):
                        assert_equal(outs[r], make(dtype, (2, 3), *key, r), f"from rank {r}")
                elif collective == "all_gather_into_tensor":
                    out = torch.empty((2 * n, 3), dtype=dtype)
                    dist.all_gather_into_tensor(out, make(dtype, (2, 3), *key, rank))
                    assert_equal(out, torch.cat([make(dtype, (2, 3), *key, r) for r in range(n)]))
                elif collective == "gather":
                    outs = [torch.empty((3,), dtype=dtype) for _ in range(n)] if rank == root else None
                    dist.gather(make(dtype, (3,), *key, rank), gather_list=outs, dst=root)
                    if rank == root:
                        for r in range(n):
                            assert_equal(outs[r], make(dtype, (3,), *key, r), f"from rank {r}")
                elif collective == "scatter":
                    parts = [make(dtype, (2, 2), *key, i) for i in range(n)] if rank == root else None
                    out = torch.empty((2, 2), dtype=dtype)
                    dist.scatter(out, scatter_list=parts, src=root)
                    assert_equal(out, make(dtype, (2, 2), *key, rank))
                elif collective == "all_to_all":
                    # Rank i sends rank j a (i + j + 1, 2) tensor: sizes differ per pair.
                    ins = [make(dtype, (rank + j + 1, 2), *key, rank, j) for j in range(n)]
                    outs = [torch.empty((j + rank + 1, 2), dtype=dtype) for j in range(n)]
                    dist.all_to_all(outs, ins)
                    for j in range(n):
                        assert_equal(outs[j], make(dtype, (j + rank + 1, 2), *key, j, rank), f"from rank {j}")
                elif collective == "all_to_all_single/even":
                    src = torch.cat([make(dtype, (2, 3), *key, rank, j) for j in range(n)])
                    out = torch.empty((2 * n, 3), dtype=dtype)
                    dist.all_to_all_single(out, src)
                    assert_equal(out, torch.cat([make(dtype, (2, 3), *key, j, rank) for j in range(n)]))
                elif collective == "all_to_all_single/split_sizes":
                    sends = [rank + j + 1 for j in range(n)]  # rows from this rank to rank j
                    receives = [j + rank + 1 for j in range(n)]
                    src = torch.cat([make(dtype, (sends[j], 2), *key, rank, j) for j in range(n)])
                    out = torch.empty((sum(receives), 2), dtype=dtype)
                    dist.all_to_all_single(out, src, output_split_sizes=receives, input_split_sizes=sends)
                    expected = torch.cat([make(dtype, (receives[j], 2), *key, j, rank) for j in range(n)])
                    assert_equal(out, expected)
                else:
                    raise AssertionError(f"no case for {collective}")
    with step("all_to_all_single/zero_splits"):
        # Rank i sends (i + 2j) % 3 rows to rank j: some pairs exchange nothing.
        sends = [(rank + 2 * j) % 3 for j in range(n)]
        receives = [(j + 2 * rank) % 3 for j in range(n)]
        src = torch.cat([make(torch.float32, (sends[j], 3), "zero", rank, j) for j in range(n)])
        out = torch.full((sum(receives), 3), float("nan"))
        dist.all_to_all_single(out, src, output_split_sizes=receives, input_split_sizes=sends)
        expected = torch.cat([make(torch.float32, (receives[j], 3), "zero", j, rank) for j in range(n)])
        assert_equal(out, expected)


def _tiny(rank: int, n: int) -> None:  # noqa: C901 - one block per collective
    f32 = torch.float32
    for collective in TINY:
        with step(f"tiny/{collective}"):
            if collective == "all_reduce":
                for shape in ((), (1,)):
                    t = torch.full(shape, float(rank + 1))
                    dist.all_reduce(t)
                    assert_equal(t, torch.full(shape, float(n * (n + 1) // 2)), f"shape {shape}")
            elif collective == "reduce":
                t = torch.tensor([float(rank + 2)])
                dist.reduce(t, dst=n - 1, op=dist.ReduceOp.PRODUCT)
                if rank == n - 1:
                    assert_equal(t, torch.tensor([float(torch.arange(2, n + 2).prod())]))
            elif collective == "broadcast":
                for shape in ((), (1,)):
                    t = torch.full(shape, 7.5) if rank == n - 1 else torch.zeros(shape)
                    dist.broadcast(t, src=n - 1)
                    assert_equal(t, torch.full(shape, 7.5), f"shape {shape}")
            elif collective == "all_gather":
                outs = [torch.empty(1) for _ in range(n)]
                dist.all_gather(outs, torch.tensor([float(rank)]))
                assert_equal(torch.cat(outs), torch.arange(n, dtype=f32))
            elif collective == "all_gather_into_tensor":
                out = torch.empty(n)
                dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
                assert_equal(out, torch.arange(n, dtype=f32))
            elif collective == "gather":
                outs = [torch.empty(1) for _ in range(n)] if rank == 0 else None
                dist.gather(torch.tensor([float(rank)]), outs, dst=0)
                if rank == 0:
                    assert_equal(torch.cat(outs), torch.arange(n, dtype=f32))
            elif collective == "scatter":
                parts = [torch.tensor([float(10 + i)]) for i in range(n)] if rank == 0 else None
                out = torch.empty(1)
                dist.scatter(out, parts, src=0)
                assert_equal(out, torch.tensor([float(10 + rank)]))
            elif collective == "reduce_scatter":
                out = torch.empty(1)
                dist.reduce_scatter(out, [torch.tensor([float(rank * i)]) for i in range(n)])
                assert_equal(out, torch.tensor([float(rank * sum(range(n)))]))
            elif collective == "reduce_scatter_tensor":
                out = torch.empty(1)
                dist.reduce_scatter_tensor(out, torch.arange(n, dtype=f32) + rank, op=dist.ReduceOp.MAX)
                assert_equal(out, torch.tensor([float(rank + n - 1)]))
            elif collective == "all_to_all":
                outs = [torch.empty(1) for _ in range(n)]
                dist.all_to_all(outs, [torch.tensor([float(10 * rank + j)]) for j in range(n)])
                assert_equal(torch.cat(outs), torch.tensor([float(10 * j + rank) for j in range(n)]))
            elif collective == "all_to_all_single":
                out = torch.empty(n)
                dist.all_to_all_single(out, torch.tensor([float(10 * rank + j) for j in range(n)]))
                assert_equal(out, torch.tensor([float(10 * j + rank) for j in range(n)]))
            else:
                raise AssertionError(f"no case for {collective}")


def _object(tag: str, rank: int) -> dict[str, Any]:
    return {"tag": tag, "rank": rank, "tensor": torch.arange(rank + 1), "text": "x" * rank, "none": None}


def _objects(rank: int, n: int, group: Any) -> None:
    """On a group of every rank with a short timeout; src/dst are global ranks."""
    for collective in OBJECT_COLLECTIVES:
        with step(collective):
            if collective == "broadcast_object_list":
                src = n - 1
                sent = [_object("b", src), "second", 3, None]
                objs = list(sent) if rank == src else [None] * len(sent)
                dist.broadcast_object_list(objs, src=src, group=group)
                assert_same(sent, objs)
            elif collective == "all_gather_object":
                objs: list[Any] = [None] * n
                dist.all_gather_object(objs, _object("a", rank), group=group)
                assert_same([_object("a", r) for r in range(n)], objs)
            elif collective == "gather_object":
                dst = 1 % n
                objs_or_none = [None] * n if rank == dst else None
                dist.gather_object(_object("g", rank), objs_or_none, dst=dst, group=group)
                if rank == dst:
                    assert_same([_object("g", r) for r in range(n)], objs_or_none)
            elif collective == "scatter_object_list":
                inputs = [_object("s", i) for i in range(n)] if rank == 0 else None
                out: list[Any] = [None]
                dist.scatter_object_list(out, inputs, src=0, group=group)
                assert_same([_object("s", rank)], out)


def _barriers(rank: int, n: int, workdir: Path) -> None:
    """Rank 0 arrives late and leaves a file just before; nobody may pass the barrier before."""
    cases = {
        "barrier": lambda: dist.barrier(),
        "barrier/async_op": lambda: dist.barrier(async_op=True).wait(),
        "monitored_barrier": lambda: dist.monitored_barrier(timeout=timedelta(seconds=30)),
        "monitored_barrier/wait_all_ranks": lambda: dist.monitored_barrier(timeout=30, wait_all_ranks=True),
    }
    for name, call in cases.items():
        with step(name):
            marker = workdir / f"{name.replace('/', '_')}.rank0-arrived"
            if rank == 0:
                time.sleep(0.3)
                marker.touch()
            call()
            assert marker.exists(), f"rank {rank} left the barrier before rank 0 arrived"


def _large(rank: int, n: int) -> None:
    """64 MiB of float32 (the ring path for all_reduce)."""
    base = torch.arange(LARGE_NUMEL, dtype=torch.float32).remainder_(1000.0)
    with step("large/all_reduce"):
        t = base + rank
        dist.all_reduce(t)
        expected = base * n + sum(range(n))
        assert_equal(t, expected)
        del t, expected
    with step("large/broadcast"):
        src = n - 1
        t = base + 0.5 if rank == src else torch.zeros(LARGE_NUMEL)
        dist.broadcast(t, src=src)
        assert_equal(t, base + 0.5)


def _groups(rank: int, n: int) -> None:  # noqa: C901 - a list of independent checks
    """Sub-groups on worlds of 3 and 4: every rank creates every group, in the same order."""
    pair = dist.new_group([0, 1])
    ends = dist.new_group([n - 1, 0])  # not adjacent, given out of order
    first = dist.new_group(list(range(n - 1)))  # [0 .. n-2]
    last = dist.new_group(list(range(1, n)))  # [1 .. n-1]: overlaps ``first`` on 1 .. n-2
    with step("groups/rank_and_size"):
        got = [dist.get_rank(g) for g in (pair, ends, first, last)]
        sizes = [dist.get_world_size(g) for g in (pair, ends, first, last)]
        expected_ranks = [
            rank if rank < 2 else -1,
            {0: 0, n - 1: 1}.get(rank, -1),
            rank if rank < n - 1 else -1,
            rank - 1 if rank >= 1 else -1,
        ]
        expected_sizes = [
            2 if rank < 2 else -1,
            2 if rank in (0, n - 1) else -1,
            n - 1 if rank < n - 1 else -1,
            n - 1 if rank >= 1 else -1,
        ]
        assert got == expected_ranks, f"get_rank(group): {got} != {expected_ranks}"
        assert sizes == expected_sizes, f"get_world_size(group): {sizes} != {expected_sizes}"
        assert dist.get_rank() == rank and dist.get_world_size() == n
    with step("groups/all_reduce"):
        t = torch.tensor([float(rank + 1)])
        if rank < 2:
            dist.all_reduce(t, group=pair)
            assert_equal(t, torch.tensor([3.0]))
    with step("groups/non_member_call_warns_and_skips"):
        # As torch.distributed: a rank outside the group gets a warning naming it and the call
        # does nothing (the tutorial's new_group program relies on it).
        if rank >= 2:
            t = torch.tensor([5.0])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert dist.all_reduce(t, group=pair) is None
                assert dist.broadcast(t, src=0, group=pair) is None
            texts = [str(w.message) for w in caught]
            assert any("all_reduce" in m and f"rank {rank}" in m for m in texts), texts
            assert any("broadcast" in m for m in texts), texts
            assert_equal(t, torch.tensor([5.0]), "the non-member's tensor")
    with step("groups/global_ranks_as_src_dst"):
        if rank in (0, n - 1):
            # src/dst are global ranks, as in torch: n - 1 is group rank 1 of ``ends``.
            t = torch.tensor([float(rank)]) if rank == n - 1 else torch.zeros(1)
            dist.broadcast(t, src=n - 1, group=ends)
            assert_equal(t, torch.tensor([float(n - 1)]), "broadcast")
            outs = [torch.empty(1), torch.empty(1)] if rank == n - 1 else None
            dist.gather(torch.tensor([float(rank * 10)]), outs, dst=n - 1, group=ends)
            if rank == n - 1:
                assert_equal(torch.cat(outs), torch.tensor([0.0, float((n - 1) * 10)]), "gather")
            objs: list[Any] = [None, None]
            dist.all_gather_object(objs, f"r{rank}", group=ends)
            assert objs == ["r0", f"r{n - 1}"], objs
    with step("groups/dst_outside_group_raises"):
        if rank < 2:
            with raises(dist.DistributedError, match=str(n - 1)):
                dist.reduce(torch.ones(1), dst=n - 1, group=pair)
    with step("groups/concurrent_async"):
        # Ranks in both groups start both collectives before waiting, in opposite orders.
        a = torch.tensor([float(rank + 1)])
        b = torch.tensor([float(10 * (rank + 1))])
        works = []
        order = [("first", first, a), ("last", last, b)]
        if rank % 2:
            order.reverse()
        for _, group, t in order:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                works.append(dist.all_reduce(t, group=group, async_op=True))
        for w in works:
            assert w.wait() is True
        if rank < n - 1:
            assert_equal(a, torch.tensor([float(sum(range(1, n)))]), "group first")
        if rank >= 1:
            assert_equal(b, torch.tensor([float(10 * sum(range(2, n + 1)))]), "group last")
    with step("groups/interleaved_with_world"):
        t_pair, t_world = torch.ones(2), torch.ones(2)
        w_pair = dist.all_reduce(t_pair, group=pair, async_op=True) if rank < 2 else None
        w_world = dist.all_reduce(t_world, async_op=True)
        w_world.wait()
        assert_equal(t_world, torch.full((2,), float(n)), "world")
        if w_pair is not None:
            w_pair.wait()
            assert_equal(t_pair, torch.full((2,), 2.0), "pair")
    with step("groups/members_only_barrier"):
        if rank in (0, n - 1):
            dist.barrier(group=ends)
    with step("groups/new_group_bad_rank_raises"):
        with raises(dist.DistributedError, match="7"):
            dist.new_group([0, 7])
    with step("groups/world_still_in_step"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert_equal(t, torch.tensor([float(n - 1)]))


def _async_ops(rank: int, n: int) -> None:
    with step("async/interleaved"):
        a = make(torch.float32, (5,), "async", "a", rank)
        b = make(torch.int64, (4,), "async", "b") if rank == 0 else torch.zeros(4, dtype=torch.int64)
        gathered = [torch.empty(3) for _ in range(n)]
        rs_out = torch.empty(2)
        a2a_out = torch.empty(n)
        works = [
            dist.all_reduce(a, async_op=True),
            dist.broadcast(b, src=0, async_op=True),
            dist.all_gather(gathered, torch.full((3,), float(rank)), async_op=True),
            dist.reduce_scatter_tensor(rs_out, torch.arange(2.0 * n) * (rank + 1), async_op=True),
            dist.barrier(async_op=True),
            dist.all_to_all_single(a2a_out, torch.arange(n, dtype=torch.float32) + 10 * rank, async_op=True),
        ]
        assert all(isinstance(w, dist.Work) for w in works), works
        for w in reversed(works):  # waited for in the opposite order
            assert w.wait() is True
            assert w.is_completed()
        assert_close(a, reference("SUM", [make(torch.float32, (5,), "async", "a", r) for r in range(n)]))
        assert_equal(b, make(torch.int64, (4,), "async", "b"), "broadcast")
        for r in range(n):
            assert_equal(gathered[r], torch.full((3,), float(r)), f"all_gather from {r}")
        factor = float(sum(range(1, n + 1)))
        assert_equal(rs_out, torch.arange(2.0 * rank, 2.0 * rank + 2) * factor, "reduce_scatter_tensor")
        assert_equal(a2a_out, torch.tensor([float(10 * j + rank) for j in range(n)]), "all_to_all_single")
    with step("async/pending_until_peer_joins"):
        # Rank 1 joins the all_reduce only after rank 0 has seen it pending and said so.
        token = torch.zeros(1)
        t = torch.ones(3)
        pending = None
        if rank == 0:
            w = dist.all_reduce(t, async_op=True)
            pending = not w.is_completed()
            dist.send(token, dst=1, tag=77)
            w.wait()
            assert w.is_completed() and w.is_success() and w.exception() is None
            assert pending, "the Work was complete before rank 1 even called all_reduce"
        else:
            if rank == 1:
                dist.recv(token, src=0, tag=77)
            dist.all_reduce(t)
        assert_equal(t, torch.full((3,), float(n)))
    with step("async/get_future"):
        t = torch.tensor([float(rank)])
        w = dist.all_reduce(t, async_op=True)
        future = w.get_future()
        chained = future.then(lambda f: "chained")
        future.wait()
        assert w.is_completed()
        assert chained.wait() == "chained"
        assert_equal(t, torch.tensor([float(sum(range(n)))]))
    with step("async/many_in_flight"):
        tensors = [torch.full((2,), float(i + rank)) for i in range(20)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        for i, t in enumerate(tensors):
            assert_equal(t, torch.full((2,), float(n * i + sum(range(n)))), f"op {i}")


# ============================================================================ errors
def c10d_errors(rank: int, world_size: int, init_method: str, **_: Any) -> None:  # noqa: C901
    """Wrong uses of the API (3 ranks, short group timeout): each must raise a clear error."""
    init(rank, world_size, init_method, timeout=SHORT_TIMEOUT)
    sync = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT))
    n = world_size
    with check("errors/bitwise_on_float"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
                with raises(TypeError, match=op.name):
                    dist.all_reduce(torch.ones(2, dtype=dtype), op=op)
        with raises(TypeError, match="BAND"):
            dist.reduce(torch.ones(2), dst=0, op=dist.ReduceOp.BAND)
        with raises(TypeError, match="BXOR"):
            dist.reduce_scatter_tensor(torch.ones(1), torch.ones(n), op=dist.ReduceOp.BXOR)
    with check("errors/rank_outside_group"):
        with raises(dist.DistributedError, match="7"):
            dist.reduce(torch.ones(2), dst=7)
        with raises(dist.DistributedError, match="7"):
            dist.broadcast(torch.ones(2), src=7)
        with raises(dist.DistributedError, match="7"):
            dist.gather(torch.ones(2), None, dst=7)
        with raises(dist.DistributedError, match="-1"):
            dist.scatter(torch.ones(2), None, src=-1)
        with raises(dist.DistributedError, match="7"):
            dist.broadcast_object_list([None], src=7)
        with raises(dist.DistributedError, match="7"):
            dist.send(torch.ones(2), dst=7)
    with check("errors/non_contiguous"):
        t = torch.arange(12.0).reshape(3, 4).t()
        before = t.clone()
        for call in (
            lambda: dist.all_reduce(t),
            lambda: dist.broadcast(t, src=0),
            lambda: dist.reduce(t, dst=0),
        ):
            with raises(dist.DistributedError, match="contiguous"):
                call()
        assert_equal(t, before, "the rejected tensor")
    with check("errors/in_step_after_local_errors"):
        # None of the rejected calls above may have used up a collective's sequence number.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([float(sum(range(n)))]))
    with check("errors/shape_mismatch") as c:
        t = torch.ones(rank + 2)
        with raises(dist.DistributedError, match="shape") as r:
            dist.all_reduce(t)
        assert_equal(t, torch.ones(rank + 2), "the tensor after the failed all_reduce")
        c.value = full_text(r.value)
    with check("errors/dtype_mismatch"):
        t = torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32)
        with raises(dist.DistributedError, match="float64"):
            dist.all_reduce(t)
    with check("errors/mismatch_in_work"):
        w = dist.all_reduce(torch.ones(3 if rank == 0 else 4), async_op=True)
        with raises(dist.DistributedError, match="shape"):
            w.wait()
        assert w.is_completed() and not w.is_success()
        assert isinstance(w.exception(), dist.DistributedError), w.exception()
    with check("errors/ring_shape_mismatch") as c:
        # Above the ring threshold; rank 0 has one element more. A rank whose neighbours agree
        # may learn it only from the timeout (a TimeoutError), but no rank may end with a result.
        t = torch.ones(100_000 + (rank == 0))
        with raises(dist.DistributedError, TimeoutError) as r:
            dist.all_reduce(t)
        c.value = f"{type(r.value).__name__}: {full_text(r.value)}"
    dist.barrier(group=sync)  # a rank that waited for the timeout catches up here
    with check("errors/collective_mismatch") as c:
        # Rank 1 calls all_reduce while ranks 0 and 2 broadcast from rank 0.
        t = torch.full((4,), float(rank))
        if rank == 1:
            with raises(dist.DistributedError, match="broadcast") as r:
                dist.all_reduce(t)
            assert "all_reduce" in full_text(r.value), full_text(r.value)
            c.value = full_text(r.value)
        else:
            try:  # the source only sends: it may not notice; recorded for the report
                dist.broadcast(t, src=0)
                c.value = "completed"
            except dist.DistributedError as exc:
                c.value = f"{type(exc).__name__}: {exc}"
    with check("errors/collective_mismatch_everyone_receives"):
        # Rank 0 calls all_reduce, ranks 1 and 2 all_gather: every rank receives a wrong message.
        t = torch.ones(2)
        with raises(dist.DistributedError, match="mismatch") as r:
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.all_gather([torch.empty(2) for _ in range(n)], t)
        assert "all_reduce" in full_text(r.value) and "all_gather" in full_text(r.value), full_text(r.value)
    with check("errors/usable_after"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        b = torch.arange(3.0) if rank == 2 else torch.zeros(3)
        dist.broadcast(b, src=2)
        assert_equal(t, torch.tensor([float(torch.arange(1, n + 1).prod())]))
        assert_equal(b, torch.arange(3.0))
    dist.destroy_process_group()


# ============================================================================ timeouts
def ranks_named(message: str) -> set[int]:
    """The integers of an error message, but for durations ("2 s") and sequence numbers ("#3")."""
    return {int(m) for m in re.findall(r"(?<![\d.#])(\d+)(?![\d.]|\s*s\b)", message)}


def c10d_timeouts(rank: int, world_size: int, init_method: str, **_: Any) -> dict[str, Any]:
    """A 3 s process-group timeout that fires (3 ranks); ``sync`` (60 s) keeps ranks in step."""
    dist.init_process_group(
        backend="grpc",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=3),
    )
    sync = dist.new_group(timeout=timedelta(seconds=60))
    g_all_reduce = dist.new_group()  # each check gets its own group: a failed one is out of step
    g_monitored = dist.new_group()
    g_all_missing = dist.new_group()
    g_first_missing = dist.new_group()
    messages: dict[str, str] = {}

    def timed(name: str, call: Any) -> BaseException:
        start = time.monotonic()
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - returned to the check
            messages[name] = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {full_text(exc)}"
            return exc
        raise AssertionError(f"{name}: no error after {time.monotonic() - start:.1f} s")

    with check("timeout/recv"):
        if rank == 0:
            exc = timed("recv", lambda: dist.recv(torch.zeros(2), src=1))
            assert isinstance(exc, TimeoutError), f"{type(exc).__name__}: {exc}"
            assert "rank 1" in full_text(exc), full_text(exc)
    dist.barrier(group=sync)
    with check("timeout/all_reduce"):
        if rank < 2:  # rank 2 never joins
            exc = timed("all_reduce", lambda: dist.all_reduce(torch.ones(2), group=g_all_reduce))
            assert isinstance(exc, TimeoutError), f"{type(exc).__name__}: {exc}"
    dist.barrier(group=sync)
    with check("timeout/monitored_barrier"):
        if rank < 2:  # rank 2 never arrives
            exc = timed(
                "monitored_barrier",
                lambda: dist.monitored_barrier(group=g_monitored, timeout=2, wait_all_ranks=True),
            )
            assert isinstance(exc, (dist.DistributedError, TimeoutError)), f"{type(exc).__name__}: {exc}"
            if rank == 0:
                named = ranks_named(str(exc))
                assert 2 in named and 1 not in named, f"names ranks {sorted(named)}: {exc}"
    dist.barrier(group=sync)
    with check("timeout/monitored_barrier_names_every_missing_rank"):
        if rank == 0:
            exc = timed(
                "monitored_barrier_all",
                lambda: dist.monitored_barrier(group=g_all_missing, timeout=2, wait_all_ranks=True),
            )
            assert isinstance(exc, dist.DistributedError), f"{type(exc).__name__}: {exc}"
            named = ranks_named(str(exc))
            assert {1, 2} <= named, f"names ranks {sorted(named)}: {exc}"
    dist.barrier(group=sync)
    with check("timeout/monitored_barrier_names_first_missing_rank"):
        if rank == 0:
            exc = timed(
                "monitored_barrier_first",
                lambda: dist.monitored_barrier(group=g_first_missing, timeout=2, wait_all_ranks=False),
            )
            assert isinstance(exc, dist.DistributedError), f"{type(exc).__name__}: {exc}"
            named = ranks_named(str(exc))
            assert 1 in named and 2 not in named, f"names ranks {sorted(named)}: {exc}"
    dist.barrier(group=sync)
    with check("timeout/world_usable_after"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([float(sum(range(world_size)))]))
    dist.destroy_process_group()
    return {"messages": messages}


# ============================================================================ asyncio
async def c10d_asyncio(rank: int, world_size: int, init_method: str, **_: Any) -> dict[str, Any]:
    """The process group on this process's own asyncio loop; every op awaited."""
    n = world_size
    await dist.init_process_group_async(
        backend="grpc",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=SHORT_TIMEOUT),
    )
    with check("asyncio/await_all_reduce"):
        t = torch.tensor([float(rank + 1)])
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, dist.Work), work
        await work
        assert_equal(t, torch.tensor([float(n * (n + 1) // 2)]))
    with check("asyncio/several_started_then_awaited"):
        a = torch.full((3,), float(rank))
        b = torch.arange(4.0) if rank == n - 1 else torch.zeros(4)
        gathered = [torch.empty(2) for _ in range(n)]
        rs_out = torch.empty(1)
        works = [
            dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True),
            dist.broadcast(b, src=n - 1, async_op=True),
            dist.all_gather(gathered, torch.full((2,), float(rank)), async_op=True),
            dist.reduce_scatter_tensor(rs_out, torch.arange(float(n)), async_op=True),
            dist.barrier(async_op=True),
        ]
        await asyncio.gather(*(_await(w) for w in reversed(works)))
        assert all(w.is_completed() for w in works)
        assert_equal(a, torch.full((3,), float(n - 1)), "all_reduce")
        assert_equal(b, torch.arange(4.0), "broadcast")
        assert_equal(torch.cat(gathered), torch.arange(float(n)).repeat_interleave(2), "all_gather")
        assert_equal(rs_out, torch.tensor([float(rank * n)]), "reduce_scatter_tensor")
    with check("asyncio/p2p_ring"):
        send = torch.full((2,), float(rank))
        recv = torch.empty(2)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % n),
            dist.P2POp(dist.irecv, recv, (rank - 1) % n),
        ]
        results = [await w for w in dist.batch_isend_irecv(ops)]
        assert results[1] == (rank - 1) % n, f"irecv's result {results[1]} is not the sender"
        assert_equal(recv, torch.full((2,), float((rank - 1) % n)))
    with check("asyncio/loop_runs_while_pending"):
        # Rank 0's all_reduce is pending until rank 1 hears from it: the loop must keep running.
        t = torch.ones(2)
        token = torch.zeros(1)
        if rank == 0:
            work = dist.all_reduce(t, async_op=True)
            for _ in range(5):  # the loop keeps running other work meanwhile
                await asyncio.sleep(0.01)
            assert not work.is_completed(), "complete before rank 1 joined"
            await dist.isend(token, dst=1, tag=5)
            await work
        else:
            if rank == 1:
                await dist.irecv(token, src=0, tag=5)
            await dist.all_reduce(t, async_op=True)
        assert_equal(t, torch.full((2,), float(n)))
    with check("asyncio/blocking_api_from_worker_thread"):
        t = torch.tensor([1.0])
        await asyncio.to_thread(dist.all_reduce, t)
        assert_equal(t, torch.tensor([float(n)]))
    with check("asyncio/blocking_destroy_refused"):
        with raises(BlockingCallError):
            dist.destroy_process_group()
        assert dist.is_initialized()
    with check("asyncio/destroy_async_exported"):
        assert hasattr(dist, "destroy_process_group_async"), (
            "rpcdist has init_process_group_async but no destroy_process_group_async "
            "(destroy_process_group() on the loop tells the user to call it)"
        )
    with check("asyncio/blocking_call_refused"):
        if rank == 0:  # only rank 0 makes the refused call
            with raises(BlockingCallError, match="async_op=True"):
                dist.all_reduce(torch.ones(1))
    with check("asyncio/in_step_after_refused_call"):
        # The refused call must not have used up a collective: the next one lines up.
        t = torch.tensor([float(rank)])
        await dist.all_reduce(t, async_op=True)
        assert_equal(t, torch.tensor([float(sum(range(n)))]))
    await getattr(dist, "destroy_process_group_async", c10d_api.destroy_process_group_async)()
    with check("asyncio/destroyed"):
        assert not dist.is_initialized()
    return {"rank": rank}


async def _await(work: dist.Work) -> Any:
    return await work


# ============================================================================ init methods
def c10d_init(rank: int, world_size: int, init_method: str, from_env: bool = False, **_: Any) -> None:
    """Join with ``init_method`` (or, with ``from_env``, torch's all-from-environment style)."""
    with check("init"):
        if from_env:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
            dist.init_process_group("gloo")
        else:
            dist.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)
    with check("state"):
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
        assert dist.get_backend() == "gloo", dist.get_backend()
    with check("all_reduce"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([3.0]))
    with check("send_recv"):
        t = torch.arange(3.0) if rank == 0 else torch.zeros(3)
        if rank == 0:
            dist.send(t, dst=1)
        else:
            assert dist.recv(t, src=0) == 0
            assert_equal(t, torch.arange(3.0))
    dist.destroy_process_group()
    with check("destroyed"):
        assert not dist.is_initialized()


def _add(a: torch.Tensor, b: float) -> torch.Tensor:
    return a + b


def c10d_with_rpc(rank: int, world_size: int, init_method: str, order: str, **_: Any) -> None:
    """init_process_group and init_rpc in one process (``order``: which is set up first; it is
    also torn down last)."""
    other = 1 - rank

    def start_pg() -> None:
        init(rank, world_size, init_method)

    def start_rpc() -> None:
        rpc_scenarios.init(rank, world_size, init_method)

    with check("init_both"):
        for start in (start_pg, start_rpc) if order == "pg_first" else (start_rpc, start_pg):
            start()
        assert dist.is_initialized()
    with check("rpc_sync"):
        out = rpc.rpc_sync(f"w{other}", _add, (torch.ones(2), float(rank)), timeout=60)
        assert_equal(out, torch.full((2,), 1.0 + rank))
    with check("all_reduce"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([3.0]))
    with check("both_in_flight"):
        t = torch.full((3,), float(rank))
        work = dist.all_reduce(t, async_op=True)
        future = rpc.rpc_async(f"w{other}", torch.mul, (torch.ones(2), 3.0), timeout=60)
        assert_equal(future.wait(), torch.full((2,), 3.0))
        work.wait()
        assert_equal(t, torch.full((3,), 1.0))
    with check("shut_down_both"):
        if order == "pg_first":
            rpc.shutdown()
            dist.destroy_process_group()
        else:
            dist.destroy_process_group()
            rpc.shutdown()
        assert not dist.is_initialized()


# ============================================================================ point to point
def c10d_p2p(rank: int, world_size: int, init_method: str, **_: Any) -> None:  # noqa: C901
    """send/recv and friends on 3 ranks; each check uses tags of its own."""
    init(rank, world_size, init_method)
    n = world_size
    with check("p2p/send_recv"):
        for dtype_name in DTYPES:
            dtype = dtype_of(dtype_name)
            expected = make(dtype, (3, 4), "sendrecv", dtype_name)
            if rank == 0:
                dist.send(expected, dst=1, tag=1)
            elif rank == 1:
                t = torch.zeros((3, 4), dtype=dtype)
                assert dist.recv(t, src=0, tag=1) == 0
                assert_equal(t, expected, dtype_name)
    with check("p2p/isend_irecv"):
        # Ranks 0 and 2 both send to rank 1, which posts both receives before waiting.
        if rank in (0, 2):
            w = dist.isend(torch.full((5,), float(rank)), dst=1, tag=2)
            assert isinstance(w, dist.Work)
            assert w.wait() is True and w.is_completed()
        elif rank == 1:
            bufs = {src: torch.empty(5) for src in (0, 2)}
            works = {src: dist.irecv(bufs[src], src=src, tag=2) for src in (2, 0)}
            for src, w in works.items():
                w.wait()
                assert w.is_completed() and w.result() == src
                assert_equal(bufs[src], torch.full((5,), float(src)), f"from {src}")
    with check("p2p/recv_any_source"):
        if rank == 0:
            senders = []
            for _ in range(n - 1):
                t = torch.empty(2)
                sender = dist.recv(t, src=None, tag=3)
                assert_equal(t, torch.full((2,), float(sender)), f"payload from {sender}")
                senders.append(sender)
            assert sorted(senders) == list(range(1, n)), senders
        else:
            dist.send(torch.full((2,), float(rank)), dst=0, tag=3)
    with check("p2p/irecv_any_source_result"):
        if rank == 2:
            t = torch.empty(1)
            w = dist.irecv(t, tag=4)
            w.wait()
            assert w.result() == 1 and t.item() == 1.0, (w.result(), t)
        elif rank == 1:
            dist.send(torch.ones(1), dst=2, tag=4)
    with check("p2p/tag_matching"):
        # Sent with tags 10, 11, 12 in that order; received by tag as 12, 10, 11.
        if rank == 1:
            works = [dist.isend(torch.full((2,), float(tag)), dst=0, tag=tag) for tag in (10, 11, 12)]
            for w in works:
                w.wait()
        elif rank == 0:
            for tag in (12, 10, 11):
                t = torch.empty(2)
                dist.recv(t, src=1, tag=tag)
                assert_equal(t, torch.full((2,), float(tag)), f"tag {tag}")
    with check("p2p/tag_matching_any_source"):
        if rank in (1, 2):
            dist.isend(torch.full((1,), float(rank)), dst=0, tag=20 + rank).wait()
        elif rank == 0:
            t = torch.empty(1)
            assert dist.recv(t, src=None, tag=22) == 2 and t.item() == 2.0
            assert dist.recv(t, src=None, tag=21) == 1 and t.item() == 1.0
    with check("p2p/ordered_100_isends"):
        if rank == 0:
            works = [dist.isend(torch.tensor([i]), dst=2, tag=30) for i in range(100)]
            for w in works:
                w.wait()
        elif rank == 2:
            got = []
            for _ in range(100):
                t = torch.empty(1, dtype=torch.int64)
                dist.recv(t, src=0, tag=30)
                got.append(int(t))
            assert got == list(range(100)), got
    with check("p2p/ordered_100_irecvs_posted_first"):
        if rank == 2:
            for i in range(100):
                dist.send(torch.tensor([i]), dst=1, tag=31)
        elif rank == 1:
            bufs = [torch.empty(1, dtype=torch.int64) for _ in range(100)]
            works = [dist.irecv(b, src=2, tag=31) for b in bufs]
            for w in works:
                w.wait()
            got = [int(b) for b in bufs]
            assert got == list(range(100)), got
    with check("p2p/ordered_per_sender_any_source"):
        if rank in (1, 2):
            works = [dist.isend(torch.tensor([rank, i]), dst=0, tag=32) for i in range(30)]
            for w in works:
                w.wait()
        elif rank == 0:
            seen: dict[int, list[int]] = {1: [], 2: []}
            for _ in range(60):
                t = torch.empty(2, dtype=torch.int64)
                sender = dist.recv(t, tag=32)
                assert int(t[0]) == sender, (sender, t)
                seen[sender].append(int(t[1]))
            assert seen == {1: list(range(30)), 2: list(range(30))}, seen
    with check("p2p/batch_isend_irecv_ring"):
        send = make(torch.float64, (4,), "ring", rank)
        recv = torch.empty(4, dtype=torch.float64)
        ops = [
            dist.P2POp(dist.irecv, recv, (rank - 1) % n, tag=40),
            dist.P2POp(dist.isend, send, (rank + 1) % n, tag=40),
        ]
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 2
        for w in works:
            w.wait()
        assert_equal(recv, make(torch.float64, (4,), "ring", (rank - 1) % n))
    with check("p2p/batch_isend_irecv_both_ways"):
        # Every rank exchanges with both neighbours at once (two sends, two receives each).
        left, right = (rank - 1) % n, (rank + 1) % n
        from_left, from_right = torch.empty(2), torch.empty(2)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((2,), 10.0 * rank), right, tag=41),
                dist.P2POp(dist.isend, torch.full((2,), 10.0 * rank + 1), left, tag=42),
                dist.P2POp(dist.irecv, from_left, left, tag=41),
                dist.P2POp(dist.irecv, from_right, right, tag=42),
            ]
        )
        for w in works:
            w.wait()
        assert_equal(from_left, torch.full((2,), 10.0 * left), "from left")
        assert_equal(from_right, torch.full((2,), 10.0 * right + 1), "from right")
    with check("p2p/large_tensor"):
        if rank == 0:
            dist.send(torch.arange(1 << 20, dtype=torch.float32), dst=1, tag=50)
        elif rank == 1:
            t = torch.empty(1 << 20)
            dist.recv(t, src=0, tag=50)
            assert_equal(t, torch.arange(1 << 20, dtype=torch.float32))
    with check("p2p/non_contiguous_send"):
        if rank == 0:
            dist.send(torch.arange(12.0).reshape(3, 4).t(), dst=1, tag=51)
        elif rank == 1:
            t = torch.empty(4, 3)
            dist.recv(t, src=0, tag=51)
            assert_equal(t, torch.arange(12.0).reshape(3, 4).t().contiguous())
    with check("p2p/sub_group"):
        pair = dist.new_group([0, 2])
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=2, group=pair, tag=52)  # dst is a global rank
        elif rank == 2:
            t = torch.empty(1)
            assert dist.recv(t, src=0, group=pair, tag=52) == 0
            assert t.item() == 42.0
        else:  # not in the group: warned and skipped, as in torch
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert dist.send(torch.ones(1), dst=0, group=pair) is None
            assert any("isend" in str(w.message) and "rank 1" in str(w.message) for w in caught), caught
    with check("p2p/recv_wrong_shape"):
        if rank == 0:
            dist.send(torch.ones(4), dst=1, tag=60)
            dist.send(torch.ones(4), dst=1, tag=61)
        elif rank == 1:
            t = torch.zeros(3)
            with raises(dist.DistributedError, match="shape") as r:
                dist.recv(t, src=0, tag=60)
            assert "[4]" in str(r.value) and "[3]" in str(r.value), str(r.value)
            assert_equal(t, torch.zeros(3), "the receiving tensor")
            with raises(dist.DistributedError, match="dtype"):
                dist.recv(torch.zeros(4, dtype=torch.int64), src=0, tag=61)
    with check("p2p/bad_peer"):
        with raises(dist.DistributedError, match="itself"):
            dist.send(torch.ones(1), dst=rank)
        with raises(dist.DistributedError, match="7"):
            dist.send(torch.ones(1), dst=7)
        with raises(dist.DistributedError, match="7"):
            dist.recv(torch.ones(1), src=7)
        with raises(dist.DistributedError, match="7"):
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.ones(1), 7)])
    with check("p2p/usable_after"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([float(sum(range(n)))]))
    dist.destroy_process_group()


SCENARIOS = [
    "c10d_collectives",
    "c10d_errors",
    "c10d_timeouts",
    "c10d_asyncio",
    "c10d_init",
    "c10d_with_rpc",
    "c10d_p2p",
]


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for name in SCENARIOS:
        setattr(rpc_scenarios, name, globals()[name])


_register()
