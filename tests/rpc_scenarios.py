"""Scenarios run by the RPC test workers: ``scenario(rank, world_size, init_method, **params)``.

Each runs in its own process (see ``_harness``): it joins the group, runs its checks
(``with check("name"):``, recorded one by one for the tests to assert), and shuts down. Rank 0
drives most checks; the other ranks serve until rank 0 releases them (see :func:`finish`).
The test modules assert on the recorded checks and return values.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import importlib
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import rpc_functions as rf
import torch
from _harness import check

import rpcdist.rpc as rpc
from rpcdist.errors import (
    BlockingCallError,
    MembershipError,
    PayloadTooLargeError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
    WorkerUnavailableError,
)
from rpcdist.rpc import api as rpc_api
from rpcdist.v1 import agent_pb2

CALL_TIMEOUT = 60.0
SERVE_TIMEOUT = 200.0  # how long a serving rank waits for rank 0 to release it
EXCHANGE_METHOD = "/rpcdist.v1.Agent/Exchange"


# ============================================================================ helpers
def options(init_method: str, **kwargs: Any) -> rpc.RpcBackendOptions:
    kwargs.setdefault("store_timeout", 60.0)
    return rpc.RpcBackendOptions(init_method=init_method, **kwargs)


def init(rank: int, world_size: int, init_method: str, **opts: Any) -> None:
    rpc.init_rpc(
        f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options(init_method, **opts)
    )


def finish(rank: int, world_size: int) -> None:
    """Shut down once every worker is done with its checks and no user function still sleeps.

    Rank 0 waits for the others' "done", lets its own sleeping functions end, releases them;
    each then lets its own sleeping functions end and shuts down (gracefully).
    """
    if rank == 0:
        rf.wait_arrivals("done", world_size - 1, SERVE_TIMEOUT)
        rf.wait_idle(30)
        for other in range(1, world_size):
            rpc.rpc_sync(other, rf.release, timeout=CALL_TIMEOUT)
    else:
        rpc.rpc_sync(0, rf.arrive, ("done",), timeout=CALL_TIMEOUT)
        rf.wait_released(SERVE_TIMEOUT)
        rf.wait_idle(30)
    rpc.shutdown()


async def finish_async(rank: int, world_size: int) -> None:
    if rank == 0:
        await rf.wait_arrivals_async("done", world_size - 1, SERVE_TIMEOUT)
        await rf.wait_idle_async(30)
        for other in range(1, world_size):
            await rpc.rpc_async(other, rf.release, timeout=CALL_TIMEOUT)
    else:
        await rpc.rpc_async(0, rf.arrive, ("done",), timeout=CALL_TIMEOUT)
        await rf.wait_released_async(SERVE_TIMEOUT)
        await rf.wait_idle_async(30)
    await rpc.shutdown_async()


def full_text(exc: BaseException) -> str:
    """An exception's message and notes."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


class raises:  # noqa: N801 - used as ``with raises(ValueError) as r:``
    """Assert the block raises one of ``types`` (optionally with ``match`` in message/notes)."""

    def __init__(self, *types: type[BaseException], match: str | None = None) -> None:
        self.types = types
        self.match = match
        self.value: Any = None

    def __enter__(self) -> raises:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        names = " or ".join(t.__name__ for t in self.types)
        if exc is None:
            raise AssertionError(f"expected {names}, nothing was raised")
        if not isinstance(exc, self.types):
            raise AssertionError(f"expected {names}, got {type(exc).__name__}: {exc}") from exc
        self.value = exc
        if self.match is not None and self.match not in full_text(exc):
            raise AssertionError(f"{type(exc).__name__} does not mention {self.match!r}: {full_text(exc)}")
        return True


def assert_same(expected: Any, actual: Any, path: str = "value") -> None:
    """Deep equality with exact types, dtypes and shapes."""
    assert type(actual) is type(expected), (
        f"{path}: got {type(actual).__name__}, sent {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(actual, expected.resolve_conj()), f"{path}: values differ:\n{actual}\n{expected}"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert np.array_equal(actual, expected), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def each_way(to: Any, func: Any, *args: Any, timeout: float = CALL_TIMEOUT) -> list[tuple[str, Any]]:
    """Thunks calling ``func(*args)`` on ``to`` by rpc_sync, rpc_async and remote()+to_here()."""
    return [
        ("rpc_sync", lambda: rpc.rpc_sync(to, func, args, timeout=timeout)),
        ("rpc_async", lambda: rpc.rpc_async(to, func, args, timeout=timeout).wait()),
        ("remote", lambda: rpc.remote(to, func, args, timeout=timeout).to_here(timeout)),
    ]


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def python_threads() -> list[str]:
    return [t.name for t in threading.enumerate()]


def write_module(directory: Path, name: str, source: str) -> None:
    """Create module ``name`` in ``directory`` and put the directory on *this* process's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(source)
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()


# ============================================================================ rendezvous
def rendezvous(rank: int, world_size: int, init_method: str, workdir: str) -> dict[str, Any]:
    """Join, look every worker up, call every worker by name, rank and WorkerInfo, shut down."""
    init(rank, world_size, init_method)
    # First thing after init_rpc returns: calls whose callee must already know the group.
    firsts = [rpc.rpc_async(r, rf.peer_names, (world_size,), timeout=CALL_TIMEOUT) for r in range(world_size)]
    first_calls = []
    for fut in firsts:
        try:
            first_calls.append(fut.wait())
        except Exception as exc:  # noqa: BLE001 - reported in the result
            first_calls.append(f"{type(exc).__name__}: {exc}")
    me = rpc.get_worker_info()
    seen = [[info.name, info.id] for info in (rpc.get_worker_info(f"w{r}") for r in range(world_size))]
    everyone = [[info.name, info.id] for info in rpc.get_all_worker_infos()]
    calls = {}
    for r in range(world_size):
        info = rpc.get_worker_info(f"w{r}")
        calls[f"w{r}"] = [
            rpc.rpc_sync(f"w{r}", rf.whoami, timeout=CALL_TIMEOUT),
            rpc.rpc_sync(r, rf.whoami, timeout=CALL_TIMEOUT),
            rpc.rpc_sync(info, rf.whoami, timeout=CALL_TIMEOUT),
            rpc.rpc_async(info, rf.whoami, timeout=CALL_TIMEOUT).wait(),
            rpc.remote(info, rf.whoami, timeout=CALL_TIMEOUT).to_here(CALL_TIMEOUT),
        ]
    rpc.shutdown()
    return {"me": [me.name, me.id], "seen": seen, "all": everyone, "calls": calls, "first_calls": first_calls}


# ============================================================================ membership errors
def membership_member(rank: int, world_size: int, init_method: str, workdir: str) -> dict[str, Any]:
    """A legitimate member of the group the intruders try to join."""
    init(rank, world_size, init_method)
    everyone = [[info.name, info.id] for info in rpc.get_all_worker_infos()]
    ring = rpc.rpc_sync((rank + 1) % world_size, rf.whoami, timeout=CALL_TIMEOUT)
    rpc.shutdown()
    return {"all": everyone, "ring": ring}


def membership_intruder(
    rank: int, world_size: int, init_method: str, workdir: str, name: str
) -> dict[str, Any]:
    """Try to join as ``name`` with ``rank``/``world_size`` (the test starts it once the
    group's first members are registered)."""
    start = time.monotonic()
    try:
        opts = options(init_method, store_timeout=30)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return {
            "joined": False,
            "type": type(exc).__name__,
            "is_membership_error": isinstance(exc, MembershipError),
            "is_value_error": isinstance(exc, ValueError),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    rpc.shutdown(graceful=False)  # it should not have got in; leave without a trace
    return {"joined": True, "seconds": time.monotonic() - start}


# ============================================================================ data: tensors, RRefs, futures
DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
TARGETS = ("w0", "w1")  # to self and to the other worker
RREF_VIEW_TIMEOUT = 20.0  # rref_view takes milliseconds; a stuck one should not cost a minute


def sample(dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(24).reshape(4, 6)
    if dtype == torch.bool:
        return base % 3 == 0
    if dtype.is_complex:
        return torch.complex(base.float(), -base.float() / 2).to(dtype)
    if dtype == torch.uint8:
        return (base * 10).to(dtype)
    return (base - 7).to(dtype)


def non_contiguous_cases() -> dict[str, tuple[torch.Tensor, bool]]:
    """name -> (tensor, whether its strides are expected to survive the trip)."""
    complex_base = torch.complex(torch.arange(6.0), torch.arange(6.0) + 1)
    return {
        "transposed": (torch.arange(24, dtype=torch.float32).reshape(4, 6).T, True),
        "step_slice": (torch.arange(60, dtype=torch.int64).reshape(6, 10)[::2, 1::3], True),
        "expanded": (torch.tensor([1.5, -2.0, 3.25]).expand(4, 3), False),
        "channels_last": (
            torch.arange(120, dtype=torch.float64)
            .reshape(2, 3, 4, 5)
            .contiguous(memory_format=torch.channels_last),
            True,
        ),
        "offset_view": (torch.arange(30, dtype=torch.int32)[7:19], True),
        "conj_view": (complex_base.conj(), False),
    }


def data(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    """Everything about what travels and the calling API (rank 0 drives)."""
    init(rank, world_size, init_method, **opts)
    if rank == 0:
        _transport_checks()
        _api_checks()
        _slot_checks()
    finish(rank, world_size)


def _slot_checks() -> None:
    with check("slots/reused_by_calls_and_results"):
        # 1 MB arguments and results go through shared-memory slots: a few, reused, however
        # many calls; a result's slot goes back to the callee once the caller read it.
        before = rpc.rpc_sync("w1", rf.shared_slots)
        for round_ in range(10):
            xs = [torch.full((1 << 18,), float(round_ * 4 + i)) for i in range(4)]
            futures = [rpc.rpc_async("w1", rf.echo, (x,)) for x in xs]
            for x, fut in zip(xs, futures, strict=True):
                y = fut.wait()
                assert torch.equal(x, y), f"round {round_}: a 1 MB result came back different"
                y += 1  # the caller's copy is its own
        wait_until(
            lambda: rpc.rpc_sync("w1", rf.shared_slots)["given_out"] == 0,
            10,
            "the callee to get its result slots back",
        )
        after = rpc.rpc_sync("w1", rf.shared_slots)
        lends, made = after["lends"] - before["lends"], after["made"] - before["made"]
        assert lends >= 40, f"only {lends} of 40 results of 1 MB went through the callee's slots"
        assert made <= 8, f"the callee made {made} new slots for 40 results of 1 MB"

    with check("slots/large_argument_kept_without_copy"):
        # An 8 MB argument becomes the callee's tensor in the caller's slot (no copy): the slot
        # stays the callee's while it keeps the tensor, later calls never write into it, and it
        # comes back once the callee drops the tensor.
        from rpcdist.agent import current_agent

        mine = current_agent().transport.slots
        n = (8 << 20) // 4
        first, second = torch.ones(n), torch.full((n,), 2.0)
        assert rpc.rpc_sync("w1", rf.keep_tensor, ("first", first)) == n - 2.0  # t[0] = -1
        assert first[0].item() == 1.0, "the callee's write reached the caller's tensor"
        assert mine.given >= 1, "the kept argument's slot came back while the callee keeps it"
        for _ in range(3):  # each needs a slot of its own: the first one is taken
            assert torch.equal(rpc.rpc_sync("w1", rf.echo, (second,)), second)
        assert rpc.rpc_sync("w1", rf.kept_tensor_sum, ("first",)) == n - 2.0, "a kept tensor changed"
        rpc.rpc_sync("w1", rf.drop_kept_tensor, ("first",))
        wait_until(lambda: mine.given == 0, 10, "the caller to get its kept slot back")


def data_transport(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    """Only the transport checks (the test runs it with shared memory turned off)."""
    init(rank, world_size, init_method, **opts)
    if rank == 0:
        _transport_checks()
        with check("transport/link_kind") as c:  # what carried them (links are internal)
            from rpcdist.agent import current_agent

            c.value = type(current_agent().transport.existing_link(1)).__name__
    finish(rank, world_size)


def _transport_checks() -> None:  # noqa: C901 - a list of independent checks
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        with check(f"dtype/{name}"):
            x = sample(dtype)
            pristine = x.clone()
            for to in TARGETS:
                for how, call in each_way(to, rf.echo, x):
                    y = call()
                    assert_same(x, y, f"{how} to {to}")
                    assert y.stride() == x.stride(), f"{how} to {to}: strides {y.stride()} != {x.stride()}"
                seen = rpc.rpc_sync(to, rf.describe_tensor, (x,), timeout=CALL_TIMEOUT)
                want = {
                    "dtype": str(dtype),
                    "shape": [4, 6],
                    "stride": [6, 1],
                    "contiguous": True,
                    "type": "Tensor",
                }
                assert seen == want, f"callee {to} saw {seen}"
                # The callee writes into what it received; so does the caller into the result.
                mutated = rpc.rpc_sync(to, rf.mutate_and_return, (x,), timeout=CALL_TIMEOUT)
                assert_same(rf.mutate_and_return(x.clone()), mutated, f"mutated by {to}")
                rf.mutate_and_return(mutated)
                assert_same(rf.mutate_and_return(rf.mutate_and_return(x.clone())), mutated, "mutated here")
            assert_same(pristine, x, "the caller's own tensor after the calls")

    for name, (x, keeps_strides) in non_contiguous_cases().items():
        with check(f"noncontig/{name}"):
            for to in TARGETS:
                for how, call in each_way(to, rf.echo, x):
                    y = call()
                    assert_same(x, y, f"{how} to {to}")
                    if keeps_strides:
                        assert y.stride() == x.stride(), (
                            f"{how} to {to}: strides {y.stride()} != {x.stride()}"
                        )
                    y.add_(1)  # the received tensor owns writable, non-overlapping memory
                    assert torch.equal(y, x.resolve_conj() + 1), f"{how} to {to}: in-place add went wrong"
                seen = rpc.rpc_sync(to, rf.describe_tensor, (x,), timeout=CALL_TIMEOUT)
                assert seen["shape"] == list(x.shape), seen
                if keeps_strides:
                    assert seen["stride"] == list(x.stride()), seen

    with check("nested"):
        x = {
            "pairs": [
                (
                    torch.arange(6, dtype=torch.float32).reshape(2, 3),
                    np.arange(6, dtype=np.int64).reshape(2, 3),
                ),
                (
                    torch.ones(2, 2, dtype=torch.bfloat16) * 3,
                    np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4).T,
                ),
            ],
            "deep": {
                "more": [(np.arange(30, dtype=np.int16)[::4], torch.arange(10)[::3]), ()],
                "flag": (torch.tensor(True), np.array([1 + 2j], dtype=np.complex64)),
            },
            "meta": ("text", 3, 2.5, None),
        }
        for to in TARGETS:
            for how, call in each_way(to, rf.echo, x):
                y = call()
                assert_same(x, y, f"{how} to {to}")
                y["pairs"][0][1][0, 0] = 99  # received arrays are writable
                y["pairs"][0][0].mul_(2)
            assert rpc.rpc_sync(to, rf.structure, (x,), timeout=CALL_TIMEOUT) == rf.structure(x)

    with check("zero_bytes/tensors"):
        x = [
            torch.empty(0),
            torch.zeros(0, 3, dtype=torch.int64),
            torch.ones(3),
            torch.empty(2, 0, dtype=torch.bool),
            torch.arange(5),
            torch.empty(0, dtype=torch.complex64),
        ]
        for to in TARGETS:
            for how, call in each_way(to, rf.echo, x):
                y = call()
                assert_same(x, y, f"{how} to {to}")
                y[0].add_(1)
                y[1].add_(1)
            alone = rpc.rpc_sync(to, rf.echo, (torch.empty(0, dtype=torch.float64),), timeout=CALL_TIMEOUT)
            assert_same(torch.empty(0, dtype=torch.float64), alone, f"a lone 0-byte tensor to {to}")
            assert rpc.rpc_sync(to, rf.payload_size, (torch.empty(0),), timeout=CALL_TIMEOUT) == 0

    with check("zero_bytes/numpy"):
        x = [np.zeros((0, 3)), np.arange(4.0), np.zeros(0, dtype=np.int8)]
        for to in TARGETS:
            y = rpc.rpc_sync(to, rf.echo, (x,), timeout=CALL_TIMEOUT)
            assert_same(x, y, f"to {to}")
            for i, arr in enumerate(y):
                assert arr.flags.writeable, f"received array {i} {arr!r} is read-only"
                arr += 1

    with check("chunked_buffers"):
        # Several buffers, some empty, crossing 1 MiB chunk boundaries at odd offsets.
        x = [
            torch.empty(0),
            torch.arange(3 << 18, dtype=torch.int32),
            torch.empty(0, dtype=torch.uint8),
            torch.arange(10, dtype=torch.float64),
            np.arange((1 << 18) + 3, dtype=np.int64),
            torch.arange(5, dtype=torch.int16),
        ]
        for to in TARGETS:
            for how, call in each_way(to, rf.echo, x):
                assert_same(x, call(), f"{how} to {to}")

    with check("large_buffers_reuse_kept_memory") as c:
        # Received buffers of 32 MiB or more come from memory kept since the last such message
        # was freed (over streams; shared memory does this its own way): every message still
        # arrives with its own bytes, none of the previous one's.
        reuses = []
        for fill in (1.0, 2.0, 3.0):
            x = torch.full(((40 << 20) // 4,), fill)
            low, high, reused = rpc.rpc_sync("w1", rf.fill_value_and_warm_reuses, (x,), timeout=120)
            assert low == high == fill, f"message filled with {fill} arrived with {low}..{high}"
            reuses.append(reused)
            y = rpc.rpc_sync("w1", rf.echo, (x,), timeout=120)  # and back: received here too
            assert torch.equal(x, y), f"the tensor filled with {fill} came back different"
            del x, y
        c.value = reuses[-1] - reuses[0]  # kept blocks the callee used for the 2nd and 3rd

    with check("large_256mib"):
        n = (256 << 20) // 4
        x = torch.arange(n, dtype=torch.int32)
        ok, y = rpc.rpc_sync("w1", rf.verify_arange_and_echo, (x,), timeout=180)
        assert ok, "the callee did not receive exactly the 256 MiB that were sent"
        assert y.dtype == torch.int32 and y.shape == x.shape, (y.dtype, y.shape)
        assert torch.equal(x, y), "the 256 MiB tensor came back different"
        del x, y

    with check("large_1gib"):
        x = torch.arange(1 << 28, dtype=torch.float32)  # 1 GiB
        y = rpc.rpc_sync("w1", rf.echo, (x,), timeout=300)
        assert torch.equal(x, y), "the 1 GiB tensor came back different"
        del x, y


def _api_checks() -> None:  # noqa: C901 - a list of independent checks
    with check("notice_runs_and_answers_nothing"):
        from rpcdist.agent import current_agent

        agent = current_agent()
        replies_before = agent.status()["counts"]["calls_in_flight"]
        for i in range(3):
            agent.notify("w1", rf.take_notice, (i,), function_name="rpc_functions.take_notice")
        # A small tensor travels in the notice itself (collectives send theirs this way).
        carried = torch.arange(1000, dtype=torch.float64)
        agent.notify("w1", rf.take_notice, (carried,), function_name="rpc_functions.take_notice")
        carried.zero_()  # already encoded: the notice holds what was sent
        # A call after them runs after them (one link, in order), on w1's loop thread.
        got = rpc.rpc_sync("w1", rf.notices, timeout=CALL_TIMEOUT)
        assert [value for value, _ in got[:3]] == [0, 1, 2], got
        assert torch.equal(got[3][0], torch.arange(1000, dtype=torch.float64)), got[3]
        assert {thread for _, thread in got} == {"rpcdist-loop"}, got
        try:  # a large one is refused before anything is sent: it belongs in a call
            big = torch.zeros(1 << 19)  # 2 MB
            agent.notify("w1", rf.take_notice, (big,), function_name="rpc_functions.take_notice")
        except ValueError as exc:
            assert "at most" in str(exc), exc
        else:
            raise AssertionError("a 2 MB notice was sent")
        assert len(rpc.rpc_sync("w1", rf.notices, timeout=CALL_TIMEOUT)) == 4
        assert agent.status()["counts"]["calls_in_flight"] == replies_before  # nothing awaited
        try:
            agent.notify("w1", rf.whoami, (), function_name="rpc_functions.whoami")
        except ValueError as exc:
            assert "inline" in str(exc), exc
        else:
            raise AssertionError("a notice of a user function (which may block) was sent")

    with check("torch_threads_on_callee"):
        # The pool threads a callee starts after torch.set_num_threads(n) run matrix products
        # with n threads: with n=1 (torchrun's setting for several processes per machine) they
        # must not start a team of one thread per core. (These workers start with
        # OMP_NUM_THREADS=1, so the check changes the setting to 2 and back.)
        before = rpc.rpc_sync("w1", rf.set_torch_threads_elsewhere, (1,), timeout=CALL_TIMEOUT)
        wanted = 2 if before == 1 else 1
        try:
            rpc.rpc_sync("w1", rf.set_torch_threads_elsewhere, (wanted,), timeout=CALL_TIMEOUT)
            existing = set(rpc.rpc_sync("w1", rf.thread_names, timeout=CALL_TIMEOUT))
            calls = [rpc.rpc_async("w1", rf.openmp_team_size, (0.5,), timeout=CALL_TIMEOUT) for _ in range(6)]
            sizes = dict(f.wait() for f in calls)
        finally:
            rpc.rpc_sync("w1", rf.set_torch_threads_elsewhere, (before,), timeout=CALL_TIMEOUT)
        started = {name: size for name, size in sizes.items() if name not in existing}
        assert started, f"no pool thread started for 6 concurrent calls: {sizes}"
        if None not in started.values():
            assert set(started.values()) == {wanted}, f"team sizes of w1's new pool threads: {started}"

    with check("concurrency_1000"):
        n = 1000
        futures = [
            rpc.rpc_async(
                "w1", rf.gather_point, ("c1000", n, i, torch.full((3,), float(i)), 60.0), timeout=120
            )
            for i in range(n)
        ]
        results = [f.wait() for f in futures]
        for i, (index, tensor) in enumerate(results):
            assert index == i, f"result {i} belongs to call {index}"
            assert torch.equal(tensor, torch.full((3,), 2.0 * i)), f"result {i}: {tensor}"

    with check("worker_info"):
        me = rpc.get_worker_info()
        assert (me.name, me.id) == ("w0", 0), me
        w1 = rpc.get_worker_info("w1")
        assert (w1.name, w1.id) == ("w1", 1), w1
        assert [(i.name, i.id) for i in rpc.get_all_worker_infos()] == [("w0", 0), ("w1", 1)]
        for to in (w1, rpc.WorkerInfo("w1", 1), 1, "w1"):
            assert rpc.rpc_sync(to, rf.whoami, timeout=CALL_TIMEOUT) == "w1", to
            assert rpc.rpc_async(to, rf.whoami, timeout=CALL_TIMEOUT).wait() == "w1", to
            rref = rpc.remote(to, rf.whoami, timeout=CALL_TIMEOUT)
            assert rref.to_here() == "w1" and rref.owner() == w1, to
        assert rpc.rpc_sync(me, rf.whoami, timeout=CALL_TIMEOUT) == "w0"

    with check("rref/to_here"):
        rref = rpc.remote("w1", rf.add, (torch.ones(2), 3))
        assert torch.equal(rref.to_here(), torch.full((2,), 4.0))
        assert torch.equal(rref.to_here(), torch.full((2,), 4.0)), "a second to_here()"
        counter = rpc.remote("w1", rf.make_counter, (5,)).to_here()
        assert isinstance(counter, rf.Counter) and counter.get() == 5
        assert rpc.remote("w0", rf.add, (1, 2)).to_here() == 3

    with check("rref/ownership"):
        theirs = rpc.remote("w1", rf.make_counter, (5,))
        assert theirs.owner() == rpc.get_worker_info("w1")
        assert theirs.owner_name() == "w1"
        assert theirs.is_owner() is False
        mine = rpc.remote("w0", rf.make_counter, (6,))
        assert mine.owner() == rpc.get_worker_info("w0") and mine.owner_name() == "w0"
        assert mine.is_owner() is True
        view = rpc.rpc_sync("w1", rf.rref_view, (theirs,), timeout=RREF_VIEW_TIMEOUT)
        assert view["is_owner"] is True and view["owner_name"] == "w1", view

    with check("rref/local_value_owner"):
        mine = rpc.remote("w0", rf.make_counter, (6,))
        value = mine.local_value()
        assert isinstance(value, rf.Counter) and value.get() == 6
        value.increment(4)
        assert mine.local_value() is value, "local_value() must return the owner's object itself"
        assert mine.to_here().get() == 10
        local = rpc.RRef(rf.Counter(11))
        assert local.is_owner() and local.owner() == rpc.get_worker_info()
        assert local.local_value().get() == 11
        theirs = rpc.remote("w1", rf.make_counter, (5,))
        view = rpc.rpc_sync("w1", rf.rref_view, (theirs,), timeout=RREF_VIEW_TIMEOUT)  # local_value() on w1
        assert view["local_value"] == 5, view

    with check("rref/local_value_non_owner"):
        theirs = rpc.remote("w1", rf.make_counter, (5,))
        theirs.to_here()
        with raises(RpcError):
            theirs.local_value()
        local = rpc.RRef(rf.Counter(11))
        view = rpc.rpc_sync("w1", rf.rref_view, (local,), timeout=RREF_VIEW_TIMEOUT)
        assert view["is_owner"] is False and view["owner_name"] == "w0", view
        assert view["local_value_error"] == "RpcError", view
        assert view["to_here"] == 11, view

    with check("rref/proxies"):
        rref = rpc.remote("w1", rf.make_counter, (0,))
        assert rref.rpc_sync().increment(2) == 2
        assert rref.rpc_async().increment(3).wait() == 5
        assert rref.remote().get().to_here() == 5
        with raises(rf.CustomError, match="proxy boom"):
            rref.rpc_sync().fail("proxy boom")

    for to in TARGETS:  # owned by the other worker, and by this one
        with check(f"rref/raises/{to}"):
            with raises(ValueError, match="remote boom") as r:
                rpc.remote(to, rf.raise_value_error, ("remote boom",)).to_here(CALL_TIMEOUT)
            assert type(r.value) is ValueError
            assert r.value.remote_worker == to, getattr(r.value, "remote_worker", "no remote_worker")
            assert "raise_value_error" in r.value.remote_traceback
            with raises(rf.CustomError) as r:
                rpc.remote(to, rf.raise_custom, ("custom boom", 3)).to_here(CALL_TIMEOUT)
            assert r.value.code == 3 and r.value.message == "custom boom"

    with check("rref/plain_pickle_refused"):
        local = rpc.RRef(35)
        with raises(RuntimeError, match="Can not pickle rref in python pickler"):
            pickle.dumps(local)
        buffer = io.BytesIO()
        with raises(RuntimeError, match="Can not pickle rref in python pickler"):
            torch.save(local, buffer)
        assert rpc.rpc_sync("w1", rf.add, (1, 2), timeout=CALL_TIMEOUT) == 3  # nothing leaked a hold

    with check("profiler/rpc_events"):
        with torch.autograd.profiler.profile() as prof:
            rpc.rpc_sync("w1", torch.add, args=(torch.ones(2), 1), timeout=CALL_TIMEOUT)
            rpc.rpc_async("w1", rf.add, (1, 2), timeout=CALL_TIMEOUT).wait()
            rpc.remote("w1", torch.mul, args=(torch.ones(2), 2)).to_here()
        names = {e.name for e in prof.function_events}
        for expected in (
            "rpc_sync#aten::add(w0 -> w1)",
            "rpc_async#add(w0 -> w1)",
            "rpc_remote#aten::mul(w0 -> w1)",
        ):
            assert expected in names, (expected, sorted(n for n in names if n.startswith("rpc_")))
        assert rpc.rpc_sync("w1", rf.add, (1, 1), timeout=CALL_TIMEOUT) == 2  # no profiler: no event

    with check("profiler/remote_events"):
        from torch.autograd.profiler_legacy import profile as legacy_profile

        t = torch.ones(4, 4)
        for profile in (legacy_profile, torch.autograd.profiler.profile):  # torch's RPC: the legacy one
            with profile(record_shapes=True) as prof:
                doubled = rpc.rpc_sync("w1", rf.add_then_double, (t, t), timeout=CALL_TIMEOUT)
                assert torch.equal(doubled, t * 4)
                fut = rpc.rpc_async("w1", rf.add_one_via, ("w0", t), timeout=CALL_TIMEOUT)
                assert torch.equal(fut.wait(), t + 1)
            events = prof.function_events
            call = next(e for e in events if e.name == "rpc_sync#add_then_double(w0 -> w1)")
            remote = {e.name: e for e in events if e.is_remote}
            add = remote["rpc_sync#add_then_double(w0 -> w1)#remote_op: aten::add"]
            assert "rpc_sync#add_then_double(w0 -> w1)#remote_op: aten::mul" in remote, sorted(remote)
            assert add.node_id == 1 and add.input_shapes[:2] == [[4, 4], [4, 4]], add
            assert call.time_range.start <= add.time_range.start <= add.time_range.end <= call.time_range.end
            # w1's own call back to w0, and the op it ran there
            outer = "rpc_async#add_one_via(w0 -> w1)#remote_op: "
            nested = remote[outer + "rpc_sync#aten::add(w1 -> w0)"]
            assert nested.node_id == 1, nested
            assert remote[outer + "rpc_sync#aten::add(w1 -> w0)#remote_op: aten::add"].node_id == 0
            assert not [e for e in events if not e.is_remote and e.node_id not in (0, -1)]
        with legacy_profile() as prof:  # an async function is not profiled on the callee
            assert rpc.rpc_sync("w1", rf.async_add, (1, 2), timeout=CALL_TIMEOUT) == 3
        assert [e.name for e in prof.function_events if e.is_remote] == []
        assert "rpc_sync#async_add(w0 -> w1)" in {e.name for e in prof.function_events}

    with check("future/api"):
        fut = rpc.rpc_async("w1", rf.sleep_blocking, (0.5,), timeout=CALL_TIMEOUT)
        assert not fut.done(), "a 0.5 s call reported done as soon as it was issued"
        seen: list[Any] = []
        called = threading.Event()
        fut.add_done_callback(lambda f: (seen.append(f.value()), called.set()))
        chained = fut.then(lambda f: f.value() * 4)
        assert chained.wait() == 2.0
        assert called.wait(30) and seen == [0.5], seen
        assert fut.done() and fut.value() == 0.5 and fut.wait() == 0.5
        late: list[Any] = []
        fut.add_done_callback(lambda f: late.append(f.value()))
        assert late == [0.5], "a callback added to a completed future must run at once"
        assert fut.then(lambda f: f.value() + 1).then(lambda f: f.value() * 10).wait() == 15.0

    with check("future/errors"):
        bad = rpc.rpc_async("w1", rf.raise_value_error, ("future boom",), timeout=CALL_TIMEOUT)
        chained = bad.then(lambda f: f.value())
        with raises(ValueError, match="future boom"):
            chained.wait()
        with raises(ValueError, match="future boom"):
            bad.wait()
        with raises(ValueError, match="future boom"):
            bad.value()
        failing_callback = rpc.rpc_async("w1", rf.add, (1, 2), timeout=CALL_TIMEOUT).then(lambda f: 1 / 0)
        with raises(ZeroDivisionError):
            failing_callback.wait()

    with check("future/torch_futures"):
        futs = [rpc.rpc_async("w1", rf.add, (i, 1), timeout=CALL_TIMEOUT) for i in range(8)]
        assert all(isinstance(f, torch.futures.Future) for f in futs), [type(f) for f in futs]
        assert torch.futures.wait_all(futs) == [i + 1 for i in range(8)]
        combined = torch.futures.collect_all([rpc.rpc_async("w1", rf.add, (2, 3), timeout=CALL_TIMEOUT)])
        assert [f.wait() for f in combined.wait()] == [5]
        chained = rpc.rpc_async("w1", rf.add, (1, 1), timeout=CALL_TIMEOUT).then(lambda f: f.wait() * 3)
        assert isinstance(chained, torch.futures.Future) and chained.wait() == 6
        with raises(TypeError):
            rpc.rpc_async("w1", rf.add, (1, 1), timeout=CALL_TIMEOUT).then(None)
        bad = rpc.rpc_async("w1", rf.raise_value_error, ("torch wait_all boom",), timeout=CALL_TIMEOUT)
        with raises(ValueError, match="torch wait_all boom"):
            torch.futures.wait_all([bad])
        assert isinstance(rpc.remote("w1", rf.add, (1, 2)).to_here_async(), torch.futures.Future)

    with check("future/await_other_loop"):
        fut = rpc.rpc_async("w1", rf.sleep_blocking, (0.3,), timeout=CALL_TIMEOUT)
        out: dict[str, Any] = {}

        def other_thread() -> None:
            async def main() -> tuple[Any, Any]:
                first = await fut  # made on the main thread, awaited on this thread's own loop
                second = await rpc.rpc_async("w1", rf.async_add, (5, 6), timeout=CALL_TIMEOUT)
                return first, second

            try:
                out["value"] = asyncio.run(main())
                out["sync"] = rpc.rpc_sync("w1", rf.add, (1, 2), timeout=CALL_TIMEOUT)  # plain thread
            except BaseException as exc:  # noqa: BLE001 - reported below
                out["error"] = exc

        thread = threading.Thread(target=other_thread, name="test-other-loop")
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "awaiting from another event loop hung"
        if "error" in out:
            raise out["error"]
        assert out["value"] == (0.3, 11) and out["sync"] == 3, out

    with check("callee_loop/sync_mode"):
        for to in TARGETS:
            where = rpc.rpc_sync(to, rf.where_async_runs, timeout=CALL_TIMEOUT)
            assert where == {"thread": "rpcdist-loop", "on_agent_loop": True}, (to, where)
            blocking = rpc.rpc_sync(to, rf.where_blocking_runs, timeout=CALL_TIMEOUT)
            assert blocking["thread"].startswith(f"rpcdist-{to}"), (to, blocking)
            assert not blocking["on_agent_loop"], (to, blocking)

    with check("blocking_does_not_stall/sync_mode"):
        # Leave a few idle pool threads on w1, then send a burst: six blocking calls and three
        # fast ones. The pool (16 threads) has room for all nine at once.
        for warm in [rpc.rpc_async("w1", rf.sleep_blocking, (0.3,)) for _ in range(4)]:
            warm.wait()
        slow = [rpc.rpc_async("w1", rf.sleep_blocking, (2.0,), timeout=CALL_TIMEOUT) for _ in range(6)]
        fast = [rpc.rpc_async("w1", rf.add, (i, 1), timeout=CALL_TIMEOUT) for i in range(3)]
        assert [f.wait() for f in fast] == [1, 2, 3]
        running = [not s.done() for s in slow]
        assert all(running), f"fast calls waited for blocking ones (still running: {running})"
        assert [s.wait() for s in slow] == [2.0] * 6

    with check("async_execution/sync_mode"):
        assert rpc.rpc_sync("w1", rf.chained_add, ("w0", 3, 4), timeout=CALL_TIMEOUT) == 14
        assert rpc.rpc_sync("w1", rf.chained_add, ("w1", 1, 1), timeout=CALL_TIMEOUT) == 4
        assert rpc.rpc_async("w0", rf.chained_add, ("w1", 2, 2), timeout=CALL_TIMEOUT).wait() == 8
        assert rpc.remote("w1", rf.chained_add, ("w0", 1, 2), timeout=CALL_TIMEOUT).to_here() == 6
        with raises(ValueError, match="nested boom"):
            rpc.rpc_sync("w1", rf.chained_failure, ("w0", "nested boom"), timeout=CALL_TIMEOUT)


# ============================================================================ errors, timeouts, bad input
CALLEE_ONLY_SOURCE = '''
class CalleeOnlyError(Exception):
    """Only the callee can import this class."""
'''
CALLER_ONLY_SOURCE = """
def secret(x):
    return x
"""


def errors(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    if rank == 1:
        write_module(Path(workdir) / "rank1_only", rf.CALLEE_ONLY_MODULE, CALLEE_ONLY_SOURCE)
    if rank == 0:
        write_module(Path(workdir) / "rank0_only", rf.CALLER_ONLY_MODULE, CALLER_ONLY_SOURCE)
    init(rank, world_size, init_method, **opts)
    if rank == 0:
        _error_checks_rank0()
    else:
        _error_checks_rank1()
    finish(rank, world_size)


def _remote_error_details(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "remote_worker": getattr(exc, "remote_worker", None),
        "remote_function": getattr(exc, "remote_function", None),
    }


async def _raw_exchange(address: str, frame: bytes, timeout: float = 20.0) -> tuple[str, str]:
    """Send ``frame`` raw on a fresh Exchange stream, with the job's token (as a member would);
    returns the final status code and details."""
    agent = rpc_api._agent
    metadata = agent.transport.security.metadata() if agent is not None else ()
    channel = grpc.aio.insecure_channel(address)
    try:
        call = channel.stream_stream(EXCHANGE_METHOD, request_serializer=None, response_deserializer=None)(
            metadata=metadata
        )

        async def talk() -> tuple[str, str]:
            with contextlib.suppress(Exception):
                await call.write(frame)
                await call.done_writing()
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            return (await call.code()).name, await call.details()

        return await asyncio.wait_for(talk(), timeout)
    finally:
        await channel.close()


def _on_agent_loop(coro: Any, timeout: float = 30.0) -> Any:
    agent = rpc_api._agent
    assert agent is not None
    return asyncio.run_coroutine_threadsafe(coro, agent.loop).result(timeout)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _error_checks_rank0() -> None:  # noqa: C901 - a list of independent checks
    # (remote() to this worker itself, whose to_here() does not cross the wire, is checked
    # separately by rref/raises/w0.)
    with check("exc/value_error"):
        for to in TARGETS:
            for how, call in each_way(to, rf.raise_value_error, "boom 42"):
                if how == "remote" and to == "w0":
                    continue
                where = f"{how} to {to}"
                with raises(ValueError, match="boom 42") as r:
                    call()
                exc = r.value
                assert type(exc) is ValueError, f"{where}: {type(exc)}"
                assert getattr(exc, "remote_worker", None) == to, f"{where}: {vars(exc)}"
                assert "raise_value_error" in exc.remote_traceback, f"{where}: {exc.remote_traceback}"
                assert "raise_value_error" in full_text(exc), f"{where}: the note lacks the remote traceback"
                if how != "remote":
                    assert exc.remote_function == "rpc_functions.raise_value_error", exc.remote_function

    with check("exc/custom"):
        for to in TARGETS:
            for how, call in each_way(to, rf.raise_custom, "custom boom", 3):
                if how == "remote" and to == "w0":
                    continue
                where = f"{how} to {to}"
                with raises(rf.CustomError) as r:
                    call()
                exc = r.value
                assert type(exc) is rf.CustomError, f"{where}: {type(exc)}"
                assert (exc.message, exc.code) == ("custom boom", 3), f"{where}: {exc.args}"
                assert "raise_custom" in getattr(exc, "remote_traceback", ""), f"{where}: {vars(exc)}"

    with check("exc/async_function"):
        with raises(ValueError, match="async boom") as r:
            rpc.rpc_sync("w1", rf.async_raise_value_error, ("async boom",), timeout=CALL_TIMEOUT)
        assert "async_raise_value_error" in r.value.remote_traceback

    for name, func, args, message, remote_type in [
        ("exc/unrebuildable", rf.raise_unrebuildable, ("left", "right"), "left/right", "UnrebuildableError"),
        ("exc/unpicklable", rf.raise_lock_holding, ("lock boom",), "lock boom", "LockHoldingError"),
        (
            "exc/callee_only_type",
            rf.raise_callee_only,
            ("callee only boom",),
            "callee only boom",
            "CalleeOnlyError",
        ),
    ]:
        with check(name) as c:
            with raises(RemoteError) as r:
                rpc.rpc_sync("w1", func, args, timeout=CALL_TIMEOUT)
            exc = r.value
            c.value = _remote_error_details(exc)
            assert message in str(exc), f"the RemoteError lost the message {message!r}: {exc}"
            assert exc.remote_type.endswith(remote_type), f"remote_type={exc.remote_type!r}"
            assert func.__name__ in exc.remote_traceback, f"remote_traceback={exc.remote_traceback!r}"
            assert getattr(exc, "remote_worker", None) == "w1", c.value

    with check("timeout/explicit"):
        with raises(RpcTimeoutError) as r:
            rpc.rpc_sync("w1", rf.sleep_blocking, (2.0,), timeout=0.5)
        assert isinstance(r.value, TimeoutError)
        with raises(RpcTimeoutError):
            rpc.rpc_async("w1", rf.sleep_blocking, (2.0,), timeout=0.5).wait()
        with raises(RpcTimeoutError):
            rpc.remote("w1", rf.sleep_blocking, (2.0,), timeout=0.5).to_here(0.5)
        with raises(RpcTimeoutError):
            rpc.rpc_sync("w1", rf.async_sleep_recorded, ("t-explicit", 5.0), timeout=0.5)
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"

    with check("timeout/sent_from_this_thread") as c:
        # A small call from a plain thread to a peer with an open link is written by the thread
        # itself and its timeout kept by the loop's sweep: it still fails on time, and the
        # callee is told to cancel.
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"  # the link is open
        started = time.monotonic()
        with raises(RpcTimeoutError):
            rpc.rpc_sync("w1", rf.async_sleep_recorded, ("t-from-thread", 30.0), timeout=1.5)
        c.value = elapsed = time.monotonic() - started
        assert 1.5 <= elapsed < 3.5, f"timed out after {elapsed:.2f} s (timeout 1.5 s)"
        wait_until(
            lambda: rpc.rpc_sync("w1", rf.get_state, ("t-from-thread",), timeout=CALL_TIMEOUT) != ["started"],
            15,
            "the timed-out call to be cancelled",
        )
        assert rpc.rpc_sync("w1", rf.get_state, ("t-from-thread",), timeout=CALL_TIMEOUT) == [
            "started",
            "cancelled",
        ]

    with check("timeout/async_cancelled") as c:
        for to in TARGETS:
            key = f"cancel-me-{to}"
            with raises(RpcTimeoutError):
                rpc.rpc_sync(to, rf.async_sleep_recorded, (key, 30.0), timeout=0.5)
            wait_until(
                lambda to=to, key=key: (
                    rpc.rpc_sync(to, rf.get_state, (key,), timeout=CALL_TIMEOUT) != ["started"]
                ),
                15,
                f"the timed-out call on {to} to end",
            )
            state = rpc.rpc_sync(to, rf.get_state, (key,), timeout=CALL_TIMEOUT)
            assert state == ["started", "cancelled"], f"on {to}: {state}"
        c.value = state

    with check("timeout/async_execution_answer_dropped") as c:
        # An async_execution function returned a Future that is not done when its caller gives
        # up: the callee drops the call at once (its graceful shutdown never waits for it), and
        # the Future's completion later answers nothing and breaks nothing.
        assert rpc.rpc_sync("w1", rf.future_later, ("quick", 0.05), timeout=CALL_TIMEOUT) == "quick"
        with raises(RpcTimeoutError):
            rpc.rpc_sync("w1", rf.future_later, ("dropped", 2.0), timeout=0.5)
        wait_until(lambda: rpc.rpc_sync("w1", rf.calls_running, timeout=CALL_TIMEOUT) == 1, 15, "the drop")
        wait_until(lambda: rpc.rpc_sync("w1", rf.get_state, ("dropped",)) == ["completed"], 15, "completion")
        c.value = rpc.rpc_sync("w1", rf.future_later, ("after", 0.05), timeout=CALL_TIMEOUT)
        assert c.value == "after"

    with check("bad/unknown_worker"):
        for to in ("nobody", 7, -1, rpc.WorkerInfo("w1", 5), rpc.WorkerInfo("ghost", 1)):
            for api_fn in (rpc.rpc_async, rpc.rpc_sync, rpc.remote):
                with raises(UnknownWorkerError) as r:
                    api_fn(to, rf.count_call, ("unknown",))  # raised at once: no Future, nothing sent
                assert isinstance(r.value, ValueError)
        with raises(UnknownWorkerError, match="nobody"):
            rpc.rpc_async("nobody", rf.count_call, ("unknown",))
        with raises(UnknownWorkerError):
            rpc.get_worker_info("nobody")
        assert rpc.rpc_sync("w1", rf.get_count, ("unknown",), timeout=CALL_TIMEOUT) == 0
        assert rf.get_count("unknown") == 0

    with check("bad/lambda_and_local_function"):

        def local_function() -> int:
            return 1

        for func, word in ((lambda: 1, "lambda"), (local_function, "local")):
            for api_fn in (rpc.rpc_async, rpc.rpc_sync, rpc.remote):
                with raises(SerializationError, match=word) as r:
                    api_fn("w1", func)  # raised at once, before anything is sent
                assert isinstance(r.value, TypeError)

    with check("bad/unpicklable_args"):
        lock = threading.Lock()
        for api_fn in (rpc.rpc_async, rpc.rpc_sync, rpc.remote):
            with raises(SerializationError, match="lock") as r:
                api_fn("w1", rf.count_call, ("lock-arg", lock))
            assert isinstance(r.value, TypeError)
            with raises(SerializationError):
                api_fn("w1", rf.count_call, ("lock-kwarg",), {"lock": lock})
        assert rpc.rpc_sync("w1", rf.get_count, ("lock-arg",), timeout=CALL_TIMEOUT) == 0
        assert rpc.rpc_sync("w1", rf.get_count, ("lock-kwarg",), timeout=CALL_TIMEOUT) == 0

    with check("bad/unpicklable_result"):
        for to in TARGETS:
            with raises(SerializationError):
                rpc.rpc_sync(to, rf.return_lock, timeout=CALL_TIMEOUT)
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"

    secret = importlib.import_module(rf.CALLER_ONLY_MODULE).secret
    qualified = f"{rf.CALLER_ONLY_MODULE}.secret"

    with check("bad/unimportable_function") as c:
        assert secret(2) == 2  # importable here, and only here
        for how, call in each_way("w1", secret, 5)[:2]:
            with raises(Exception) as r:  # noqa: B017 - the type is the callee's import error
                call()
            assert not isinstance(r.value, RpcTimeoutError), f"{how}: timed out instead of failing"
            assert qualified in full_text(r.value), (
                f"{how}: the error does not name {qualified}: {full_text(r.value)}"
            )
            c.value = _remote_error_details(r.value)
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"

    with check("bad/unimportable_function_remote"):
        rref = rpc.remote("w1", secret, (5,))
        with raises(Exception) as r:  # noqa: B017 - the type is the callee's import error
            rref.to_here(10)
        assert not isinstance(r.value, RpcTimeoutError), (
            "to_here() timed out: the failure of the remote() call itself never reached it"
        )
        assert qualified in full_text(r.value), full_text(r.value)

    with check("bad/unimportable_function_remote_fails_while_the_fetch_is_sent"):
        # The creation's failure may arrive while the thread calling to_here() is still sending
        # the fetch (after it looked at the creation): the fetch must fail with it all the same,
        # not wait for a value the owner never makes. The thread is made that slow here.
        from rpcdist.agent import current_agent

        agent = current_agent()
        rref = rpc.remote("w1", secret, (5,))
        creation = rref._confirmed  # (its failure has almost always not arrived yet here)
        assert creation is not None, "remote() has no creation to wait for"

        def slow_submit(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + CALL_TIMEOUT
            while not creation.done() and time.monotonic() < deadline:
                time.sleep(0.002)
            return type(agent).submit(agent, *args, **kwargs)

        agent.submit = slow_submit
        try:
            with raises(Exception) as r:  # noqa: B017 - the type is the callee's import error
                rref.to_here(10)
        finally:
            del agent.submit
        assert creation.done() and creation.exception() is not None
        assert not isinstance(r.value, RpcTimeoutError), "to_here() waited for a value never made"
        assert qualified in full_text(r.value), full_text(r.value)

    with check("bad/payload_result_too_large"):
        with raises(PayloadTooLargeError, match="max_payload_bytes") as r:
            rpc.rpc_sync("w1", rf.make_bytes, (2 << 20,), timeout=CALL_TIMEOUT)
        assert "1048576" in str(r.value) and isinstance(r.value, ValueError), str(r.value)
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"

    with check("bad/payload_incoming_too_large"):
        big = torch.zeros(2 << 20, dtype=torch.uint8)
        with raises(PayloadTooLargeError, match="max_payload_bytes"):
            rpc.rpc_sync("w1", rf.payload_size, (big,), timeout=CALL_TIMEOUT)
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"

    agent = rpc_api._agent
    assert agent is not None
    address = agent.addresses[1]

    with check("bad/malformed_frames") as c:
        unknown_chunk = agent_pb2.Frame(
            envelopes=[agent_pb2.Envelope(call_id=12345, kind=agent_pb2.CHUNK, data=b"xyz")]
        ).SerializeToString()
        frames = {
            "garbage": b"\xff\xff\xff",
            "truncated_envelope": b"\x0a\x20\x08\x01\x10",
            "truncated_large_frame": b"\x0a" + _varint(200_000) + b"\x08" * 70_000,
            "chunk_of_unknown_message": unknown_chunk,
        }
        outcomes = {}
        for name, frame in frames.items():
            outcomes[name] = _on_agent_loop(_raw_exchange(address, frame))
            assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1", (
                f"w1 stopped serving after {name}"
            )
        c.value = outcomes
        wrong = {name: got for name, got in outcomes.items() if got[0] != "INVALID_ARGUMENT"}
        assert not wrong, f"expected INVALID_ARGUMENT, got {wrong}"
        assert rpc.rpc_sync("w1", rf.add, (torch.ones(2), 1), timeout=CALL_TIMEOUT).tolist() == [2.0, 2.0]

    with check("bad/frame_announcing_huge_buffer") as c:
        header = agent_pb2.Envelope(
            call_id=1, kind=agent_pb2.REQUEST, payload=b"x", buffer_sizes=[1 << 40], function="f"
        )
        frame = agent_pb2.Frame(envelopes=[header]).SerializeToString()
        c.value = _on_agent_loop(_raw_exchange(address, frame))
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"
        # Refused before any allocation (the message never completes, so OK is acceptable);
        # UNKNOWN/INTERNAL would mean an exception escaped the stream handler.
        assert c.value[0] in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), c.value


def _error_checks_rank1() -> None:
    """Rank 1 runs with rpc_timeout=2 and max_payload_bytes=1 MiB (see test_rpc_errors)."""
    with check("timeout/default") as c:
        assert rpc_api._agent is not None and rpc_api._agent.options.rpc_timeout == 2.0
        with raises(RpcTimeoutError):
            rpc.rpc_sync("w0", rf.sleep_blocking, (4.0,))
        with raises(RpcTimeoutError):
            rpc.rpc_async("w0", rf.sleep_blocking, (4.0,)).wait()
        with raises(RpcTimeoutError):
            rpc.remote("w0", rf.sleep_blocking, (4.0,)).to_here()
        with raises(RpcTimeoutError) as r:
            rpc.rpc_sync("w0", rf.async_sleep_recorded, ("default-timeout", 30.0))
        c.value = str(r.value)
        wait_until(
            lambda: rpc.rpc_sync("w0", rf.get_state, ("default-timeout",)) != ["started"],
            15,
            "the cancellation",
        )
        assert rpc.rpc_sync("w0", rf.get_state, ("default-timeout",)) == ["started", "cancelled"]

    with check("timeout/zero_means_none"):
        assert rpc.rpc_sync("w0", rf.sleep_blocking, (3.0,), timeout=0) == 3.0
        assert (
            rpc.rpc_async("w0", rf.async_sleep_recorded, ("no-timeout", 3.0), timeout=0).wait() == "completed"
        )
        assert rpc.rpc_sync("w0", rf.sleep_blocking, (3.0,), timeout=10) == 3.0

    with check("bad/payload_caller") as c:
        big = torch.zeros(2 << 20, dtype=torch.uint8)
        for api_fn in (rpc.rpc_async, rpc.rpc_sync, rpc.remote):
            with raises(PayloadTooLargeError, match="max_payload_bytes") as r:
                api_fn("w0", rf.count_call, ("too-big", big))  # raised at once, nothing sent
            assert isinstance(r.value, ValueError)
            assert "1048576" in str(r.value), str(r.value)
        c.value = str(r.value)
        assert rpc.rpc_sync("w0", rf.get_count, ("too-big",)) == 0
        small = torch.zeros(512 << 10, dtype=torch.uint8)
        assert rpc.rpc_sync("w0", rf.payload_size, (small,)) == 512 << 10


# ============================================================================ asyncio-native workers
def _loop_threads() -> list[str]:
    return [name for name in python_threads() if name == "rpcdist-loop"]


async def asyncio_native(rank: int, world_size: int, init_method: str, workdir: str) -> dict[str, Any]:
    await rpc.init_rpc_async(
        f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options(init_method)
    )
    with check(f"asyncio/no_loop_thread/{rank}"):
        assert _loop_threads() == [], python_threads()
        assert rpc_api._agent is not None and rpc_api._agent.loop is asyncio.get_running_loop()
    if rank == 0:
        await _asyncio_checks()
    await finish_async(rank, world_size)
    with check(f"asyncio/after_shutdown/{rank}"):
        left = [name for name in python_threads() if name.startswith("rpcdist")]
        assert left == [], f"rpcdist threads alive after shutdown_async(): {left}"
    return {"threads_before_exit": python_threads()}


async def _asyncio_checks() -> None:  # noqa: C901 - a list of independent checks
    with check("asyncio/callee_loop"):
        for to in TARGETS:
            where = await rpc.rpc_async(to, rf.where_async_runs, timeout=CALL_TIMEOUT)
            assert where == {"thread": "MainThread", "on_agent_loop": True}, (to, where)
            blocking = await rpc.rpc_async(to, rf.where_blocking_runs, timeout=CALL_TIMEOUT)
            assert blocking["thread"].startswith(f"rpcdist-{to}") and not blocking["on_agent_loop"], blocking

    with check("asyncio/many_sequential"):
        for i in range(1500):
            func = rf.add if i % 2 else rf.async_add
            result = await rpc.rpc_async("w1", func, (i, 1), timeout=CALL_TIMEOUT)
            assert result == i + 1, (i, result)
        assert _loop_threads() == []

    with check("asyncio/many_gathered"):
        futures = [
            rpc.rpc_async("w1", rf.add if i % 2 else rf.async_add, (i, 2), timeout=CALL_TIMEOUT)
            for i in range(1500)
        ]
        results = await asyncio.gather(*futures)
        assert results == [i + 2 for i in range(1500)]
        assert _loop_threads() == []

    with check("asyncio/blocking_does_not_stall"):
        slow = rpc.rpc_async("w1", rf.sleep_blocking, (2.0,), timeout=CALL_TIMEOUT)
        for i in range(20):
            assert await rpc.rpc_async("w1", rf.add, (i, i), timeout=CALL_TIMEOUT) == 2 * i
        assert await rpc.rpc_async("w1", rf.async_add, (1, 1), timeout=CALL_TIMEOUT) == 2
        assert not slow.done(), "the fast calls to w1 finished only after its 2 s blocking call"
        assert await slow == 2.0

    with check("asyncio/async_execution"):
        assert await rpc.rpc_async("w1", rf.chained_add, ("w0", 3, 4), timeout=CALL_TIMEOUT) == 14
        assert await rpc.rpc_async("w0", rf.chained_add, ("w1", 1, 2), timeout=CALL_TIMEOUT) == 6
        with raises(ValueError, match="nested boom"):
            await rpc.rpc_async("w1", rf.chained_failure, ("w0", "nested boom"), timeout=CALL_TIMEOUT)

    with check("asyncio/future_api"):
        fut = rpc.rpc_async("w1", rf.async_add, (20, 22), timeout=CALL_TIMEOUT)
        assert not fut.done(), "done before this loop could even read the reply"
        called: list[Any] = []
        fut.add_done_callback(lambda f: called.append(f.value()))
        chained = fut.then(lambda f: f.value() + 1)
        assert await chained == 43
        assert fut.done() and fut.value() == 42 and fut.wait() == 42 and called == [42], called
        assert await fut == 42, "awaiting a completed future again"
        pending = rpc.rpc_async("w1", rf.sleep_blocking, (0.5,), timeout=CALL_TIMEOUT)
        with raises(BlockingCallError):
            pending.wait()  # would block the loop that must deliver the reply
        assert await pending == 0.5

    with check("asyncio/await_other_loop"):
        fut = rpc.rpc_async("w1", rf.sleep_blocking, (0.3,), timeout=CALL_TIMEOUT)

        def other_thread() -> tuple[Any, Any]:
            async def main() -> tuple[Any, Any]:
                first = await fut  # made on the main loop, awaited on this thread's own loop
                second = await rpc.rpc_async("w1", rf.async_add, (5, 6), timeout=CALL_TIMEOUT)
                return first, second

            return asyncio.run(main())

        assert await asyncio.wait_for(asyncio.to_thread(other_thread), 60) == (0.3, 11)

    with check("asyncio/plain_thread_blocking"):
        assert await asyncio.to_thread(rpc.rpc_sync, "w1", rf.add, (1, 2), None, CALL_TIMEOUT) == 3
        fut = rpc.rpc_async("w1", rf.add, (2, 2), timeout=CALL_TIMEOUT)
        assert await asyncio.to_thread(fut.wait, CALL_TIMEOUT) == 4

    with check("asyncio/blocking_call_refused"):
        with raises(BlockingCallError):
            rpc.rpc_sync("w1", rf.add, (1, 1), timeout=CALL_TIMEOUT)

    with check("asyncio/remote"):
        rref = rpc.remote("w1", rf.make_counter, (3,))
        value = await rref.to_here_async()
        assert isinstance(value, rf.Counter) and value.get() == 3
        assert await rref.rpc_async().increment(2) == 5
        mine = rpc.remote("w0", rf.make_counter, (4,))
        assert (await mine.to_here_async()).get() == 4 and mine.local_value().get() == 4


# ============================================================================ shutdown
class _FullCollections:
    """Counts full garbage collections (each costs in proportion to the program's heap) while
    automatic ones are off, so only those something asked for are counted."""

    def __enter__(self) -> _FullCollections:
        self.count = 0
        gc.disable()
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)
        gc.enable()


def shutdown_graceful(rank: int, world_size: int, init_method: str, workdir: str) -> None:
    """Rank 1 issues a 3 s call to rank 0 and shuts down at once; rank 0 shuts down while
    that call runs on it. The call must still complete, with its result delivered.

    Neither shutdown runs a full garbage collection: it would cost in proportion to the
    program's heap (seconds for a big one), while rpcdist's gRPC objects go by reference
    counting (grpc's poller thread then ends; the strict thread check sees to that)."""
    init(rank, world_size, init_method)
    collections = _FullCollections()
    if rank == 0:
        with check("graceful/callee") as c:
            rf.wait_started(30)
            assert rf.get_count("sleep_signalled/done") == 0
            with collections:
                rpc.shutdown()
            c.value = rf.get_count("sleep_signalled/done")
            assert c.value == 1, "shutdown() returned before the call it was serving completed"
    else:
        with check("graceful/caller"):
            fut = rpc.rpc_async("w0", rf.sleep_signalled, (3.0,))
            assert not fut.done()
            with collections:
                rpc.shutdown()
            assert fut.done(), "shutdown() returned with this worker's call still pending"
            assert fut.wait() == 3.0
    with check(f"graceful/no-full-collection/{rank}"):
        assert collections.count == 0, f"shutdown() ran {collections.count} full garbage collection(s)"
    with check(f"graceful/after/{rank}"):
        with raises(RpcError):
            rpc.rpc_sync(0, rf.whoami)
        rpc.shutdown()  # a second shutdown is a no-op


def shutdown_nongraceful(rank: int, world_size: int, init_method: str, workdir: str) -> None:
    """Both workers leave with shutdown(graceful=False); rank 1 has a call outstanding. First,
    a request reaching a worker that is shutting down (its link still open) is refused."""
    init(rank, world_size, init_method)
    if rank == 1:
        with check("nongraceful/refused_while_closing") as c:
            rpc.rpc_sync("w0", rf.closing_for, (3.0,), timeout=CALL_TIMEOUT)
            with raises(RpcError) as r:
                rpc.rpc_sync("w0", rf.note_run, ("while closing",), timeout=CALL_TIMEOUT)
            c.value = str(r.value)
            assert "w0 is shutting down" in str(r.value) and "was not run" in str(r.value), r.value
            wait_until(lambda: _answers("w0"), 30, "w0 to take calls again")
            assert rpc.rpc_sync("w0", rf.note_run, ("after",), timeout=CALL_TIMEOUT) == "after"
    else:
        with check("nongraceful/refused_while_closing/callee"):
            wait_until(lambda: "after" in rf.ran_while_closing, 60, "the call made after the window")
            assert rf.ran_while_closing == ["after"], rf.ran_while_closing
    if rank == 0:
        with check("nongraceful/callee"):
            rf.wait_started(30)
            rf.wait_idle(30)  # the user function ends on its own; nobody waits for its reply
            rpc.shutdown(graceful=False)
    else:
        with check("nongraceful/caller") as c:
            fut = rpc.rpc_async("w0", rf.sleep_signalled, (3.0,), timeout=CALL_TIMEOUT)
            rpc.rpc_sync("w0", rf.wait_started, (30,), timeout=CALL_TIMEOUT)
            rpc.shutdown(graceful=False)
            assert fut.done(), "non-graceful shutdown left an outstanding call pending"
            with raises(WorkerUnavailableError) as r:
                fut.wait()
            c.value = str(r.value)
    with check(f"nongraceful/after/{rank}"):
        with raises(RpcError):
            rpc.rpc_sync(0, rf.whoami)


def _answers(worker: str) -> bool:
    try:
        return rpc.rpc_sync(worker, rf.whoami, timeout=CALL_TIMEOUT) == worker
    except RpcError:
        time.sleep(0.25)  # (each refusal is logged there)
        return False


# ---------------------------------------------------------------------------- a worker dies
def _backward_through(rpc_module: Any, name: str) -> Callable[[], Any]:
    """Start, in a thread, a distributed backward pass whose part on ``name`` sleeps 60 s;
    returns the wait for its end."""
    import rpcdist.autograd as dist_autograd

    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def backward() -> None:
        try:
            with dist_autograd.context() as context_id:
                x = torch.ones(2, requires_grad=True)
                y = rpc_module.rpc_sync(name, rf.slow_backward_identity, (x,), timeout=CALL_TIMEOUT)
                dist_autograd.backward(context_id, [y.sum()])
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reported
            done.set_exception(exc)

    threading.Thread(target=backward, daemon=True).start()
    return lambda: done.result(150)


def _end_of_waits(waits: dict[str, Callable[[], Any]]) -> dict[str, dict[str, Any]]:
    """Wait for each in turn; how each ended: its outcome (or error type, message, and whether
    it is a WorkerUnavailableError) and when (``<what>_failed_at`` wall clock, comparable across
    processes; ``<what>_at_monotonic``)."""
    ended: dict[str, dict[str, Any]] = {}
    for what, wait in waits.items():
        entry: dict[str, Any] = {}
        try:
            wait()
            entry[what] = "returned"
        except Exception as exc:  # noqa: BLE001 - reported
            entry[what] = type(exc).__name__
            entry[f"{what}_message"] = str(exc)
            entry[f"{what}_isinstance_unavailable"] = isinstance(exc, WorkerUnavailableError)
        entry[f"{what}_failed_at"] = time.time()
        entry[f"{what}_at_monotonic"] = time.monotonic()
        ended[what] = entry
    return ended


def worker_death(  # noqa: C901 - one scenario, every way to wait on a worker
    rank: int,
    world_size: int,
    init_method: str,
    workdir: str,
    death: str = "kill",
    cut: str = "",
    **opts: Any,
) -> dict[str, Any]:
    """Three workers; w2 is lost while w0 waits on it in every way a worker can — a 60 s call
    (its timeout 120 s), ``to_here`` of an RRef still being created, a P2P recv, a collective
    of a group with w2, a distributed backward pass whose part on w2 is running — and while w1
    has already asked to shut down. Reports how each wait ended and after how long, whether
    w1 still served w0 afterwards, and how long each survivor's shutdown took.

    ``death``: "kill" (SIGKILL: its connections close), "freeze" (SIGSTOP: they stay open,
    nothing answers) or "cut" (w0 takes down its network interface ``cut``, the veth towards
    w2's host). A frozen or cut-off w2 is killed once the waits have ended."""
    import rpcdist as dist

    init(rank, world_size, init_method, **opts)
    # The group's messages take the same path as the calls (a co-located frozen peer's Unix
    # socket stays open, and is not heartbeated: see the README).
    path = options(init_method, **opts)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=path)  # fmt: skip
    with_w2 = dist.new_group([0, 2])
    report: dict[str, Any] = {}
    if rank == 0:
        waits: dict[str, Callable[[], Any]] = {}
        pending = rpc.rpc_async("w2", rf.sleep_blocking, (60.0,), timeout=120.0)
        waits["call"] = pending.wait
        creating = rpc.remote("w2", rf.slow_ones, (60.0,), timeout=120.0)
        waits["to_here"] = creating.to_here_async(timeout=120.0).wait
        waits["recv"] = dist.irecv(torch.zeros(2), src=2).wait
        waits["all_reduce"] = dist.all_reduce(torch.ones(2), group=with_w2, async_op=True).wait
        waits["backward"] = _backward_through(rpc, "w2")
        time.sleep(1.0)  # the backward pass has reached w2's sleeping function
        if death == "cut":
            pid = rpc.rpc_sync("w2", rf.freeze_in, (3600.0,), timeout=CALL_TIMEOUT)
            time.sleep(1.0)
            subprocess.run(["ip", "link", "set", cut, "down"], check=True, timeout=30)
        else:
            how = rf.die_in if death == "kill" else rf.freeze_in
            pid = rpc.rpc_sync("w2", how, (1.0,), timeout=CALL_TIMEOUT)
        start = time.monotonic()
        for what, ended in _end_of_waits(waits).items():
            report.update(ended)
            report[f"{what}_failed_after"] = report.pop(f"{what}_at_monotonic") - start
        if death != "kill":
            os.kill(pid, signal.SIGKILL)
        report["w1_answers"] = rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT)
    elif rank == 2:
        time.sleep(120)  # killed long before
    if rank != 2:
        dist.destroy_process_group()
    start = time.monotonic()
    rpc.shutdown()
    report["shutdown_seconds"] = time.monotonic() - start
    return report


def worker_lost_everywhere(  # noqa: C901 - one scenario, every way to wait on a worker
    rank: int, world_size: int, init_method: str, workdir: str, **opts: Any
) -> dict[str, Any]:
    """Every worker but the last waits on the last one in every way a worker can (a call in
    flight, ``to_here``, a P2P recv, an all_reduce, a distributed backward pass), then the
    test kills it or cuts its host off (markers in ``workdir``: ``waiting_<rank>`` when the
    waits are under way, ``victim_pid``; the test writes ``fault_at``). Reports, for every
    wait, how it ended and when (wall clock, comparable with ``fault_at``); then whether the
    survivors still serve each other, and how long their shutdown took."""
    import rpcdist as dist

    marks = Path(workdir)
    victim = world_size - 1
    init(rank, world_size, init_method, **opts)
    path = options(init_method, **opts)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=path)  # fmt: skip
    report: dict[str, Any] = {}
    if rank == victim:
        (marks / "victim_pid").write_text(str(os.getpid()))
        time.sleep(300)  # killed long before
        return report
    name = f"w{victim}"
    waits: dict[str, Callable[[], Any]] = {
        "call": rpc.rpc_async(name, rf.sleep_blocking, (60.0,), timeout=120.0).wait,
        "to_here": rpc.remote(name, rf.slow_ones, (60.0,), timeout=120.0).to_here_async(timeout=120.0).wait,
        "recv": dist.irecv(torch.zeros(2), src=victim).wait,
        "all_reduce": dist.all_reduce(torch.ones(2), async_op=True).wait,
    }
    waits["backward"] = _backward_through(rpc, name)
    time.sleep(1.0)  # the backward pass has reached the victim's sleeping function
    (marks / f"waiting_{rank}").touch()
    for what, ended in _end_of_waits(waits).items():
        report.update(ended)
        report.pop(f"{what}_at_monotonic")
    (marks / f"measured_{rank}").touch()
    survivors = [r for r in range(world_size) if r != victim]
    report["survivors_answer"] = [rpc.rpc_sync(f"w{r}", rf.whoami, timeout=CALL_TIMEOUT) for r in survivors]
    dist.destroy_process_group()
    start = time.monotonic()
    rpc.shutdown()
    report["shutdown_seconds"] = time.monotonic() - start
    return report


# ============================================================================ security
def security_member(
    rank: int, world_size: int, init_method: str, workdir: str, **opts: Any
) -> dict[str, Any]:
    """A member of a group that outsiders attack (see test_security_auth / test_security_tls):
    rank 0 waits until the test process has made its attempts (store key
    ``security/attacked``), then checks that the members still call each other both ways."""
    init(rank, world_size, init_method, **opts)
    agent = rpc_api._agent
    assert agent is not None
    if rank == 0:
        agent.rendezvous.store.wait(["security/attacked"], SERVE_TIMEOUT)
        with check("members_keep_working") as c:
            c.value = [
                rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT),
                rpc.rpc_sync("w1", rf.add, (torch.ones(2), 1), timeout=CALL_TIMEOUT).tolist(),
            ]
    else:
        with check("members_keep_working") as c:
            c.value = [rpc.rpc_sync("w0", rf.whoami, timeout=CALL_TIMEOUT)]
    transport = agent.transport
    links = {rank: type(link).__name__ for rank, link in transport._links.items()}
    finish(rank, world_size)
    return {"links": links, "token": bool(transport.security.token), "tls": transport.security.tls}


# ============================================================================ etcd
def etcd_job_through_member_loss(
    rank: int, world_size: int, init_method: str, workdir: str, c10d_init_method: str, rounds_after: int
) -> dict[str, Any]:
    """A job that met on an etcd cluster (``etcd://`` for RPC and for the process group) and
    keeps calling its peers, all-reducing and using the job's store while the test kills one
    etcd member; each round all ranks agree (all_reduce MIN) whether to go on, and they stop
    ``rounds_after`` rounds after every rank saw the key ``app/killed`` the test sets once it
    killed the member."""
    import rpcdist as dist
    from rpcdist.store import PrefixStore
    from rpcdist.store.etcd_store import store_from_url

    init(rank, world_size, init_method)
    dist.init_process_group("gloo", init_method=c10d_init_method, rank=rank, world_size=world_size)
    store = PrefixStore("app", store_from_url(init_method, timeout=CALL_TIMEOUT))
    peer = (rank + 1) % world_size
    rounds, killed_at, adds = 0, None, []
    store.set(f"looping/{rank}", b"1")
    while True:
        rounds += 1
        assert (
            rpc.rpc_sync(peer, torch.add, (torch.ones(2), rounds), timeout=CALL_TIMEOUT).tolist()
            == [1.0 + rounds] * 2
        )
        adds.append(store.add("counter", 1))
        store.set(f"round/{rank}", str(rounds))
        store.wait([f"round/{peer}"], timeout=CALL_TIMEOUT)
        if killed_at is None and store.check(["killed"]):
            killed_at = rounds
        done = torch.tensor([1.0 if killed_at is not None and rounds >= killed_at + rounds_after else 0.0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            break
    store.underlying_store.close()
    dist.destroy_process_group()
    rpc.shutdown()  # its barrier goes through the cluster too
    return {"rounds": rounds, "rounds_after_kill": rounds - (killed_at or rounds), "adds": adds}


# ============================================================================ reply channels
def reply_channels(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    init(rank, world_size, init_method, **opts)
    if rank == 0:
        _reply_channel_checks()
    finish(rank, world_size)


def _reply_channel_checks() -> None:  # noqa: C901 - a list of independent checks
    agent = rpc_api.current_agent()

    with check("channel/answers_without_the_loop") as c:
        # A co-located callee answers rpc_sync on a reply channel the waiting thread reads:
        # the call completes while this worker's event loop is busy (blocked here for 10 s).
        assert rpc.rpc_sync("w1", rf.whoami, timeout=CALL_TIMEOUT) == "w1"  # link and channel open
        loop_free = threading.Event()
        blocked = threading.Event()

        def block_the_loop() -> None:
            blocked.set()
            time.sleep(10.0)
            loop_free.set()

        agent.loop.call_soon_threadsafe(block_the_loop)
        assert blocked.wait(CALL_TIMEOUT)
        got = rpc.rpc_sync("w1", rf.add, (torch.ones(3), 2), timeout=CALL_TIMEOUT)
        c.value = answered_while_blocked = not loop_free.is_set()
        assert torch.equal(got, torch.full((3,), 3.0))
        assert answered_while_blocked, "the answer waited for the caller's event loop"
        assert loop_free.wait(CALL_TIMEOUT)
        assert rpc.rpc_sync("w1", rf.open_reply_channels, (0,), timeout=CALL_TIMEOUT) >= 1

    with check("channel/timeout_then_next_answers") as c:
        # A call that times out on its channel raises RpcTimeoutError naming the worker and the
        # function; its late answer never reaches a later call.
        with raises(RpcTimeoutError) as r:
            rpc.rpc_sync("w1", rf.sleep_blocking, (3.0,), timeout=1.0)
        text = full_text(r.value)
        assert "w1" in text and "sleep_blocking" in text and "1 s" in text, text
        for i in range(5):
            assert rpc.rpc_sync("w1", rf.echo, (i,), timeout=CALL_TIMEOUT) == i
        time.sleep(3.0)  # the late answer is due by now
        for i in range(5):
            assert rpc.rpc_sync("w1", rf.echo, (("after", i),), timeout=CALL_TIMEOUT) == ("after", i)
        c.value = True

    with check("channel/threads_get_their_own_answers") as c:
        # 8 threads, 40 calls each, each waiting on a channel of its own.
        errors: list[str] = []

        def caller(tid: int) -> None:
            for i in range(40):
                got = rpc.rpc_sync("w1", rf.echo, ((tid, i),), timeout=CALL_TIMEOUT)
                if got != (tid, i):
                    errors.append(f"thread {tid} call {i} got {got!r}")

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT)
        assert not errors, errors[:5]
        c.value = rpc.rpc_sync("w1", rf.open_reply_channels, (0,), timeout=CALL_TIMEOUT)
        assert 1 <= c.value <= 9, c.value  # one per thread waiting at once, reused after

    with check("channel/large_results") as c:
        # Results of every size come back whole on a channel: inline, big frames, shared slots.
        for n in (1, 1000, 20_000, 300_000, 4_000_000):
            for offset in (0.5, 7.0):
                got = rpc.rpc_sync("w1", rf.ramp, (n, offset), timeout=CALL_TIMEOUT)
                assert got.shape == (n,) and float(got[0]) == offset and float(got[-1]) == n - 1 + offset
        c.value = True

    with check("channel/rref_results") as c:
        # An answer that carries an RRef goes on the link after all (its protocol relies on the
        # caller's loop decoding it in order); the thread waiting on the channel is told, and
        # the channel keeps serving the next calls.
        for i in range(10):
            rref = rpc.rpc_sync("w1", rf.rref_of, (i,), timeout=CALL_TIMEOUT)
            assert isinstance(rref, rpc.RRef) and rref.owner_name() == "w1"
            assert rref.to_here(CALL_TIMEOUT) == i
            assert rpc.rpc_sync("w1", rf.echo, (i,), timeout=CALL_TIMEOUT) == i
        c.value = rpc.rpc_sync("w1", rf.open_reply_channels, (0,), timeout=CALL_TIMEOUT)
        assert c.value >= 1

    with check("channel/requests_run_while_the_callees_loop_is_busy") as c:
        # A plain function's rpc_sync goes on the channel too: the callee's thread reading it
        # runs the call and answers, while the callee's event loop is blocked.
        rpc.rpc_async("w1", rf.block_the_loop, (6.0,))
        time.sleep(0.3)  # (sent: a call made while this worker's loop sends one goes behind it)
        deadline = time.monotonic() + 5.0
        blocked, thread, pool = False, "", (0, 0)
        while not blocked and time.monotonic() < deadline:
            blocked, thread, pool = rpc.rpc_sync("w1", rf.loop_state, timeout=CALL_TIMEOUT)
        c.value = thread
        assert blocked, "no call was answered while the callee's loop was blocked"
        assert "-channel-" in thread, (thread, "pool running and queued:", pool)
        time.sleep(6.0)  # (the loop is free again)

    with check("channel/requests_keep_their_order_behind_the_link") as c:
        # A request on the channel runs only after everything its caller sent before on the
        # link: a notice that waits behind the callee's blocked loop is handled first.
        on_channel = 0
        for attempt in range(3):
            rpc.rpc_async("w1", rf.block_the_loop, (1.0,))
            time.sleep(0.3)  # (sent, and the callee's loop blocked)
            agent.notify("w1", rf.take_notice, (("ordered", attempt),), function_name="take_notice")
            seen, thread = rpc.rpc_sync("w1", rf.notices_seen_by, timeout=CALL_TIMEOUT)
            assert ("ordered", attempt) in seen, (attempt, seen)
            on_channel += "-channel-" in thread
        c.value = on_channel
        assert on_channel >= 1, "no request went on the channel"

    with check("channel/busy_callee_gets_requests_on_the_link") as c:
        # A callee whose pool is full says so on the channel: the caller's next requests go on
        # its link (the loop and the pool serve a loaded worker better) for a while, then on
        # the channel again.
        limit = rpc.rpc_sync("w1", rf.pool_limit, timeout=CALL_TIMEOUT)
        sleepers = [rpc.rpc_async("w1", rf.sleep_blocking, (1.5,)) for _ in range(limit)]
        time.sleep(0.3)  # (all running)
        _, thread, _ = rpc.rpc_sync("w1", rf.loop_state, timeout=CALL_TIMEOUT)
        assert "-channel-" not in thread, thread  # queued on the pool, answered from there
        idle = agent.transport._my_channels._idle.get(1, [])
        assert any(channel.busy_until > time.monotonic() for channel in idle), "the caller was not told"
        for sleeper in sleepers:
            sleeper.wait()
        time.sleep(0.2)  # (the busy spell is over)
        _, thread, _ = rpc.rpc_sync("w1", rf.loop_state, timeout=CALL_TIMEOUT)
        c.value = thread
        assert "-channel-" in thread, thread

    with check("channel/remote_error") as c:
        # An error raised by the callee comes back on the channel with its type and traceback.
        with raises(ValueError, match="bad value") as r:
            rpc.rpc_sync("w1", rf.raise_value_error, ("bad value",), timeout=CALL_TIMEOUT)
        c.value = full_text(r.value)
        assert "raise_value_error" in c.value


def at_the_calls_limit(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    """Both workers run with the same ``max_inflight_calls_per_peer`` (``opts``) and keep that
    many calls in flight to each other: a caller that waits for a free place is never refused
    by its callee (whose answers, written by its pool threads, may reach the caller before the
    thread has counted the call as ended)."""
    init(rank, world_size, init_method, **opts)
    other = f"w{1 - rank}"
    with check(f"limit/never_refused/{rank}") as c:
        futures = [rpc.rpc_async(other, rf.add, (i, 1), timeout=CALL_TIMEOUT) for i in range(3000)]
        results = [f.wait() for f in futures]
        c.value = len(results)
        assert results == [i + 1 for i in range(3000)]
    finish(rank, world_size)
