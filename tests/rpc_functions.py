"""Functions the RPC test workers call on each other.

Every worker imports this module by name, so everything here is importable on every worker.
Module-level state (counters, events, records of what ran) is per process: a worker reads the
state of another through an RPC to one of the getters below.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import threading
import time
from typing import Any

import numpy as np
import torch

import rpcdist.rpc as rpc
from rpcdist.agent.markers import inline
from rpcdist.rpc import api as rpc_api

# ----------------------------------------------------------------------------- process state
_lock = threading.Condition()
_counts: collections.Counter[str] = collections.Counter()
_states: dict[str, list[str]] = {}
_released = threading.Event()
_active_blocking = 0


def release() -> None:
    """Let this worker's scenario go on to shutdown."""
    _released.set()


def wait_released(timeout: float) -> None:
    if not _released.wait(timeout):
        raise TimeoutError(f"not released within {timeout} s")


async def wait_released_async(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _released.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not released within {timeout} s")
        await asyncio.sleep(0.02)


def arrive(tag: str) -> int:
    """Count one arrival at ``tag`` on this worker; returns the count."""
    with _lock:
        _counts[f"arrive/{tag}"] += 1
        _lock.notify_all()
        return _counts[f"arrive/{tag}"]


def wait_arrivals(tag: str, n: int, timeout: float) -> None:
    with _lock:
        if not _lock.wait_for(lambda: _counts[f"arrive/{tag}"] >= n, timeout):
            raise TimeoutError(f"only {_counts[f'arrive/{tag}']} of {n} arrivals at {tag!r} in {timeout} s")


async def wait_arrivals_async(tag: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _counts[f"arrive/{tag}"] < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {_counts[f'arrive/{tag}']} of {n} arrivals at {tag!r}")
        await asyncio.sleep(0.02)


def count_call(key: str, *args: Any, **kwargs: Any) -> int:
    """Counts the calls that reached this worker under ``key``."""
    with _lock:
        _counts[key] += 1
        return _counts[key]


def get_count(key: str) -> int:
    with _lock:
        return _counts[key]


def get_state(key: str) -> list[str]:
    """What :func:`async_sleep_recorded` recorded under ``key``, in order."""
    return list(_states.get(key, []))


def wait_idle(timeout: float) -> None:
    """Wait until no :func:`sleep_blocking` runs in this process (so none holds a thread)."""
    with _lock:
        if not _lock.wait_for(lambda: _active_blocking == 0, timeout):
            raise TimeoutError(f"{_active_blocking} sleep_blocking calls still running after {timeout} s")


async def wait_idle_async(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _active_blocking:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_active_blocking} sleep_blocking calls still running")
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------- plain functions
def echo(x: Any) -> Any:
    return x


def add(a: Any, b: Any) -> Any:
    return a + b


async def async_add(a: Any, b: Any) -> Any:
    await asyncio.sleep(0)
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


ran_while_closing: list[str] = []


def closing_for(seconds: float) -> None:
    """This worker's agent reads as shutting down for ``seconds`` (the window of a shutdown in
    which a peer's link is still open), then as running again."""
    agent = rpc_api.current_agent()
    agent.closing = True
    threading.Timer(seconds, setattr, (agent, "closing", False)).start()


def note_run(key: str) -> str:
    ran_while_closing.append(key)
    return key


_notices: list[Any] = []


@inline
def take_notice(value: Any) -> None:
    """An inline handler (as rpcdist's own): sent as a notice by Agent.notify."""
    _notices.append((value, threading.current_thread().name))


def notices() -> list[Any]:
    return list(_notices)


def set_torch_threads_elsewhere(n: int) -> int:
    """torch.set_num_threads(n) from a short-lived thread: the process-wide setting changes,
    but no running thread's own OpenMP team size does. Returns the previous setting."""
    before = torch.get_num_threads()
    setter = threading.Thread(target=torch.set_num_threads, args=(n,))
    setter.start()
    setter.join()
    return before


def openmp_team_size(hold: float = 0.0) -> tuple[str, int | None]:
    """(the name of the thread running this call, its OpenMP team size (omp_get_max_threads):
    what a matrix product started here would use; None when torch's OpenMP is not found)."""
    import ctypes

    time.sleep(hold)  # keep this pool thread busy so concurrent calls get others
    with open("/proc/self/maps") as maps:
        libraries = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    name = threading.current_thread().name
    return name, int(ctypes.CDLL(libraries[0]).omp_get_max_threads()) if libraries else None


def thread_names() -> list[str]:
    return [t.name for t in threading.enumerate()]


def peer_names(world_size: int) -> list[str]:
    """The names of ranks 0..world_size-1 as this worker knows them."""
    return [rpc.get_worker_info(f"w{r}").name for r in range(world_size)]


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    """What the callee received: dtype, shape, strides, contiguity."""
    return {
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "contiguous": t.is_contiguous(),
        "type": type(t).__name__,
    }


def mutate_and_return(t: torch.Tensor) -> torch.Tensor:
    """Writes into the received tensor in place (it must own writable memory), returns it."""
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.add_(1)
    return t


def structure(obj: Any) -> Any:
    """A JSON-able description of a nested object as the callee sees it."""
    if isinstance(obj, torch.Tensor):
        return ["tensor", str(obj.dtype), list(obj.shape)]
    if isinstance(obj, np.ndarray):
        return ["ndarray", str(obj.dtype), list(obj.shape), bool(obj.flags.writeable)]
    if isinstance(obj, dict):
        return {"dict": {str(k): structure(v) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [structure(v) for v in obj]]
    return [type(obj).__name__, repr(obj)]


def verify_arange_and_echo(t: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """Checks on the callee that ``t`` is exactly ``arange(len(t))`` in its dtype, and returns it."""
    expected = torch.arange(t.numel(), dtype=t.dtype)
    return bool(torch.equal(t, expected)), t


def fill_value_and_warm_reuses(t: torch.Tensor) -> tuple[float, float, int]:
    """On the callee: the smallest and largest element of ``t`` and how many received buffers
    this process has served from kept memory so far (rpcdist.transport.warm)."""
    from rpcdist.transport import warm

    return float(t.min()), float(t.max()), warm.warm_buffers.reused


def sleep_blocking(seconds: float) -> float:
    """Blocks a worker thread for ``seconds``."""
    global _active_blocking
    with _lock:
        _active_blocking += 1
    try:
        time.sleep(seconds)
    finally:
        with _lock:
            _active_blocking -= 1
            _lock.notify_all()
    return seconds


_started = threading.Event()


def sleep_signalled(seconds: float) -> float:
    """:func:`sleep_blocking` that first lets :func:`wait_started` return, and counts completions."""
    _started.set()
    sleep_blocking(seconds)
    count_call("sleep_signalled/done")
    return seconds


def wait_started(timeout: float) -> None:
    """Wait until a :func:`sleep_signalled` call runs in this process."""
    if not _started.wait(timeout):
        raise TimeoutError(f"no sleep_signalled call started within {timeout} s")


async def async_sleep_recorded(key: str, seconds: float) -> str:
    """Sleeps on the callee's loop, recording whether it started, completed or was cancelled."""
    _states.setdefault(key, []).append("started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _states[key].append("cancelled")
        raise
    _states[key].append("completed")
    return "completed"


async def where_async_runs() -> dict[str, Any]:
    """Where an ``async def`` function runs on the callee."""
    agent = rpc_api._agent
    return {
        "thread": threading.current_thread().name,
        "on_agent_loop": agent is not None and asyncio.get_running_loop() is agent.loop,
    }


def where_blocking_runs() -> dict[str, Any]:
    agent = rpc_api._agent
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    return {
        "thread": threading.current_thread().name,
        "on_agent_loop": agent is not None and running is agent.loop,
    }


_gates: dict[str, tuple[asyncio.Event, list[int]]] = {}


async def gather_point(
    key: str, n: int, i: int, value: torch.Tensor, timeout: float
) -> tuple[int, torch.Tensor]:
    """Returns only once ``n`` calls for ``key`` are running at the same time on this worker."""
    event, arrived = _gates.setdefault(key, (asyncio.Event(), [0]))
    arrived[0] += 1
    if arrived[0] >= n:
        event.set()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"only {arrived[0]} of {n} calls for {key!r} were in flight together") from None
    return i, value * 2


def make_bytes(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def payload_size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def return_lock() -> Any:
    """A result that cannot be pickled."""
    return threading.Lock()


# ----------------------------------------------------------------------------- errors
class CustomError(Exception):
    """An exception type of the test suite, importable on every worker."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message, code)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return f"{self.message} (code {self.code})"


class UnrebuildableError(Exception):
    """Pickles, but cannot be unpickled: its __init__ needs two arguments, args holds one."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


class LockHoldingError(Exception):
    """Cannot be pickled at all: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_value_error(message: str) -> None:
    raise ValueError(message)


async def async_raise_value_error(message: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(message)


def raise_custom(message: str, code: int) -> None:
    raise CustomError(message, code)


def raise_unrebuildable(a: str, b: str) -> None:
    raise UnrebuildableError(a, b)


def raise_lock_holding(message: str) -> None:
    raise LockHoldingError(message)


CALLEE_ONLY_MODULE = "rpcdist_test_callee_only"
CALLER_ONLY_MODULE = "rpcdist_test_caller_only"


def raise_callee_only(message: str) -> None:
    """Raises an exception whose class only the callee can import (see rpc_scenarios)."""
    module = importlib.import_module(CALLEE_ONLY_MODULE)
    raise module.CalleeOnlyError(message)


# ----------------------------------------------------------------------------- async_execution
@rpc.functions.async_execution
def chained_add(to: str, a: int, b: int) -> Any:
    """Completes when a nested call to ``to`` does: (a + b) * 2."""
    return rpc.rpc_async(to, add, args=(a, b)).then(lambda fut: fut.value() * 2)


@rpc.functions.async_execution
def chained_failure(to: str, message: str) -> Any:
    """The nested call raises ValueError; the RPC must fail with it."""
    return rpc.rpc_async(to, raise_value_error, args=(message,)).then(lambda fut: fut.value())


@rpc.functions.async_execution
def future_later(key: str, seconds: float) -> Any:
    """An rpcdist Future completed ``seconds`` from now by a timer thread (recorded in
    :func:`get_state` as "completed")."""
    fut: Any = rpc.Future()

    def complete() -> None:
        _states.setdefault(key, []).append("completed")
        fut.set_result(key)

    timer = threading.Timer(seconds, complete)
    timer.daemon = True
    timer.start()
    return fut


def shared_slots() -> dict[str, int]:
    """This worker's shared-memory slots: how many exist, how many buffers went out through
    them, and how many given ones peers hold now (not yet named back in SLOTS_READ)."""
    from rpcdist.agent import current_agent

    agent = current_agent()
    return {
        "made": agent.transport.slots.made,
        "lends": agent.transport.slots.lends,
        "given_out": agent.transport.slots.given,
    }


_kept: dict[str, torch.Tensor] = {}


def keep_tensor(key: str, t: torch.Tensor) -> float:
    """Keep a received tensor (and write into it, as a callee may); returns its sum."""
    t[0] = -1.0
    _kept[key] = t
    return float(t.sum())


def kept_tensor_sum(key: str) -> float:
    return float(_kept[key].sum())


def drop_kept_tensor(key: str) -> None:
    del _kept[key]


def calls_running() -> int:
    """Peers' calls this worker runs now (its status counts), this one included."""
    from rpcdist.agent import current_agent

    return int(current_agent().status()["counts"]["calls_running"])


# ----------------------------------------------------------------------------- RRef helpers
class Counter:
    """A small stateful object to keep behind an RRef."""

    def __init__(self, start: int) -> None:
        self.value = start

    def increment(self, by: int = 1) -> int:
        self.value += by
        return self.value

    def get(self) -> int:
        return self.value

    def fail(self, message: str) -> None:
        raise CustomError(message, 7)


def make_counter(start: int) -> Counter:
    return Counter(start)


def rref_view(rref: rpc.RRef[Any]) -> dict[str, Any]:
    """How a worker sees an RRef it was sent: ownership and (on the owner) its local value."""
    view: dict[str, Any] = {
        "me": rpc.get_worker_info().name,
        "owner_name": rref.owner_name(),
        "owner": [rref.owner().name, rref.owner().id],
        "is_owner": rref.is_owner(),
    }
    if rref.is_owner():
        value = rref.local_value()
        view["local_value"] = value.get() if isinstance(value, Counter) else value
    else:
        try:
            rref.local_value()
            view["local_value_error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            view["local_value_error"] = type(exc).__name__
        value = rref.to_here()
        view["to_here"] = value.get() if isinstance(value, Counter) else value
    return view


def add_then_double(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two torch ops the callee's profiler records (aten::add, aten::mul)."""
    return torch.mul(torch.add(a, b), 2)


def add_one_via(dst: str, a: torch.Tensor) -> torch.Tensor:
    """A call that makes a nested call to ``dst`` (whose events come back too)."""
    return rpc.rpc_sync(dst, torch.add, args=(a, 1))


def slow_ones(seconds: float) -> torch.Tensor:
    """A value that takes ``seconds`` to make (for an RRef whose creation is still running)."""
    time.sleep(seconds)
    return torch.ones(2)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward pass sleeps 60 s (so a distributed backward waits on it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(60.0)
        return grad


def slow_backward_identity(x: torch.Tensor) -> torch.Tensor:
    """``x``, through a function whose gradient takes 60 s to compute here."""
    return _SlowBackward.apply(x)


def freeze_in(seconds: float) -> int:
    """This worker stops (SIGSTOP: alive, connections open, answering nothing) ``seconds``
    from now, as a hung process or a vanished host looks to its peers; returns its pid."""
    import os
    import signal

    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    return os.getpid()


def die_in(seconds: float) -> int:
    """This worker kills itself (SIGKILL, no clean-up) ``seconds`` from now; returns its pid."""
    import os
    import signal

    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return os.getpid()


def open_reply_channels(caller_rank: int) -> int:
    """On a callee: how many reply channels ``caller_rank`` has open to this worker."""
    agent = rpc_api.current_agent()
    return sum(1 for rank, _ in agent.transport._reply_channels if rank == caller_rank)


def ramp(n: int, offset: float) -> torch.Tensor:
    """``offset + arange(n)`` as float32 (a result of any size, checkable element by element)."""
    return torch.arange(n, dtype=torch.float32) + offset


_loop_blocked = threading.Event()


async def block_the_loop(seconds: float) -> None:
    """Blocks this worker's event loop for ``seconds`` (an ``async def`` that never awaits)."""
    _loop_blocked.set()
    time.sleep(seconds)
    _loop_blocked.clear()


def loop_state() -> tuple[bool, str, tuple[int, int]]:
    """Whether this worker's loop is blocked by :func:`block_the_loop`, the thread that runs
    this call, and the worker pool's running and queued jobs."""
    pool = rpc_api.current_agent().pool
    return _loop_blocked.is_set(), threading.current_thread().name, (pool._running, len(pool._jobs))


def pool_limit() -> int:
    """How many user functions this worker's pool runs at once."""
    return rpc_api.current_agent().pool._limit


def notices_seen_by() -> tuple[list[Any], str]:
    """The notices :func:`take_notice` got so far, and the thread that runs this call."""
    return [value for value, _ in _notices], threading.current_thread().name


def rref_of(value: Any) -> Any:
    """An RRef (owned here) to ``value``."""
    return rpc.RRef(value)
