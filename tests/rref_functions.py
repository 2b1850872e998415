"""Functions and classes the RRef test workers (``rref_scenarios``) call on each other.

Every worker imports this module by name. Module-level state (``_kept``) is per process: a
worker keeps RRefs it was sent there, and another worker drops them with :func:`drop`.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
import time
from typing import Any

import torch

import rpcdist.rpc as rpc
from rpcdist.transport import frames

# RRefs (or containers of RRefs) this worker was asked to keep, by key.
_kept: dict[str, Any] = {}
_kept_lock = threading.Lock()


class RRefTestError(Exception):
    """An exception type of these tests, importable on every worker."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message, code)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return f"{self.message} (code {self.code})"


class Env:
    """A small stateful "environment" to keep behind an RRef."""

    def __init__(self, start: float = 0.0) -> None:
        self.state = torch.full((3,), float(start))
        self.steps = 0

    def step(self, action: float) -> tuple[torch.Tensor, int]:
        self.state += action
        self.steps += 1
        return self.state.clone(), self.steps

    async def astep(self, action: float) -> tuple[torch.Tensor, str]:
        """An ``async def`` method: runs on the owner's event loop."""
        await asyncio.sleep(0)
        self.state += action
        self.steps += 1
        return self.state.clone(), threading.current_thread().name

    def total(self) -> float:
        return float(self.state.sum())

    def where(self) -> str:
        return rpc.get_worker_info().name

    def fail(self, message: str) -> None:
        raise RRefTestError(message, 9)

    def slow_total(self, seconds: float) -> tuple[float, str]:
        """The total after ``seconds`` (the caller may drop its RRef meanwhile), and the thread."""
        time.sleep(seconds)
        return self.total(), threading.current_thread().name

    def confirmed(self, rrefs: list[rpc.RRef[Any]]) -> list[bool]:
        """As :func:`confirmed`, called through an RRef of this object (``rref.rpc_sync()``)."""
        return confirmed(rrefs)


def make_env(start: float = 0.0) -> Env:
    return Env(start)


def make_value(i: int) -> torch.Tensor:
    return torch.full((4,), float(i))


_runs: collections.Counter[int] = collections.Counter()
_runs_lock = threading.Lock()


def made_slowly(i: int, seconds: float, fail: bool = False) -> torch.Tensor:
    """:func:`make_value` after ``seconds`` (a value still being made when it is fetched),
    counting its runs (see :func:`runs`); ``fail``: raises instead."""
    with _runs_lock:
        _runs[i] += 1
    time.sleep(seconds)
    if fail:
        raise ValueError(f"made_slowly({i}) failed on purpose")
    return make_value(i)


async def stall_loop(seconds: float) -> bool:
    """Holds its worker's event loop for ``seconds`` (a blocking sleep in an ``async def``)."""
    time.sleep(seconds)
    return True


def made_from(rref: rpc.RRef[Any], i: int, seconds: float) -> torch.Tensor:
    """:func:`made_slowly` once ``rref``'s value has been fetched (a call whose RRef argument
    its owner must confirm first)."""
    rref.to_here(30)
    return made_slowly(i, seconds)


class Maker:
    """A value whose method makes values slowly: ``maker.remote().make(...)``."""

    def make(self, i: int, seconds: float) -> torch.Tensor:
        return made_slowly(i, seconds)


def runs() -> dict[int, int]:
    """How many times :func:`made_slowly` ran for each ``i`` here, since the last call (reset)."""
    with _runs_lock:
        counted = dict(_runs)
        _runs.clear()
    return counted


async def fetch_from_threads(rref: rpc.RRef[Any], threads: int, timeout: float) -> list[Any]:
    """``to_here()`` from ``threads`` threads at once (each on its own reply channel to a
    co-located owner); every thread's value, or the type and text of what it raised and where
    (worker, function). (Plain threads, waited for on the loop: a pool thread blocked in a join
    would hold its place in the pool, which the owner's calls back here may need.)"""

    def fetch() -> Any:
        try:
            return rref.to_here(timeout).tolist()
        except Exception as exc:  # noqa: BLE001 - reported
            where = (getattr(exc, "remote_worker", None), getattr(exc, "remote_function", None))
            return {"type": type(exc).__name__, "message": str(exc), "raised": where}

    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(None, fetch) for _ in range(threads))))


_gates: dict[str, threading.Event] = {}


def blocked_until_opened(key: str, seconds: float) -> bool:
    """Hold a thread of this worker's pool on a plain wait (which lends its place to nothing)
    until :func:`open_gate` opens ``key`` or ``seconds`` pass; whether it was opened."""
    with _kept_lock:
        gate = _gates.setdefault(key, threading.Event())
    return gate.wait(seconds)


async def open_gate(key: str) -> None:
    """Open ``key`` for :func:`blocked_until_opened` (``async``: run by the loop, not queued on
    the pool its waiters hold)."""
    with _kept_lock:
        _gates.setdefault(key, threading.Event()).set()


def make_payload(i: int) -> torch.Tensor:
    """A 1 KiB value per RRef, for the many-RRefs round."""
    return torch.full((256,), float(i))


def fail(message: str, code: int) -> None:
    raise RRefTestError(message, code)


def confirmed(rrefs: list[rpc.RRef[Any]]) -> list[bool]:
    """``confirmed_by_owner()`` of each RRef the call brought, as the function sees them."""
    return [rref.confirmed_by_owner() for rref in rrefs]


async def confirmed_async(rrefs: list[rpc.RRef[Any]]) -> list[bool]:
    """As :func:`confirmed`, in an ``async def`` function (run on the callee's loop)."""
    return confirmed(rrefs)


async def slow_value(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return 1


# ----------------------------------------------------------------------------- bookkeeping
async def ping() -> str:
    """Answered on the event loop (no pool thread): whether the worker's loop still runs."""
    return rpc.get_worker_info().name


def debug() -> dict[str, int]:
    """This worker's RRef counts, after collecting garbage."""
    gc.collect()
    return rpc.debug_info()


def rss_kib() -> int:
    """This process's resident set size (VmRSS) in KiB, after collecting garbage."""
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def keep(key: str, obj: Any) -> int:
    """Keep ``obj`` (RRefs, possibly in containers) under ``key``; returns how many are kept."""
    with _kept_lock:
        _kept[key] = obj
        return len(_kept)


def drop(prefix: str = "") -> int:
    """Drop every kept object whose key starts with ``prefix``; returns how many were dropped."""
    with _kept_lock:
        keys = [k for k in _kept if k.startswith(prefix)]
        for k in keys:
            del _kept[k]
    gc.collect()
    return len(keys)


def same_kept(prefix: str) -> bool:
    """Whether every RRef kept under ``prefix`` is one object (one user RRef per value)."""
    with _kept_lock:
        kept = [v for k, v in _kept.items() if k.startswith(prefix)]
    return all(v is kept[0] for v in kept)


_notices: collections.Counter[str] | None = None


def count_notices(start: bool) -> dict[str, int]:
    """Start (True) or stop (False) counting the notices this worker sends, by function name
    (``frames.encode_message`` is what every notice is encoded with); returns the counts."""
    global _notices
    if start:
        counted: collections.Counter[str] = collections.Counter()
        original = frames.encode_message

        def counting(call_id: int, kind: int, *args: Any, **kwargs: Any) -> Any:
            if kind == frames.NOTIFY:
                counted[kwargs.get("function", "")] += 1
            return original(call_id, kind, *args, **kwargs)

        counting.original = original  # type: ignore[attr-defined]
        frames.encode_message = counting
        _notices = counted
        return {}
    frames.encode_message = getattr(frames.encode_message, "original", frames.encode_message)
    counted, _notices = _notices or collections.Counter(), None
    return dict(counted)


def kept_count() -> int:
    with _kept_lock:
        return len(_kept)


def fetch_kept(prefix: str, timeout: float) -> list[Any]:
    """``to_here()`` of every kept RRef under ``prefix``, in key order (keys end in numbers)."""
    with _kept_lock:
        items = sorted(
            ((k, v) for k, v in _kept.items() if k.startswith(prefix)),
            key=lambda kv: int(kv[0].split("/")[-1]),
        )
    return [v.to_here(timeout) for _, v in items]


def describe_kept(key: str) -> Any:
    with _kept_lock:
        obj = _kept[key]
    return describe(obj)


# ----------------------------------------------------------------------------- describing RRefs
def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Env):
        return ["Env", value.total()]
    return value


def view(rref: rpc.RRef[Any], timeout: float = 30.0) -> dict[str, Any]:
    """How this worker sees one RRef: owner, ownership, and its value (local or fetched)."""
    out: dict[str, Any] = {
        "me": rpc.get_worker_info().name,
        "owner": rref.owner_name(),
        "owner_id": rref.owner().id,
        "is_owner": rref.is_owner(),
    }
    if rref.is_owner():
        out["value"] = _plain(rref.local_value())
    else:
        try:
            rref.local_value()
            out["local_value_error"] = None
        except rpc.RpcError:
            out["local_value_error"] = "RpcError"
        out["value"] = _plain(rref.to_here(timeout))
    return out


def describe(obj: Any) -> Any:
    """A JSON-able picture of a container of RRefs as this worker received it."""
    if isinstance(obj, rpc.RRef):
        return {"rref": view(obj)}
    if isinstance(obj, dict):
        return {"dict": {str(k): describe(v) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [describe(v) for v in obj]}
    return {"other": repr(obj)}


def same_objects(obj: dict[str, Any]) -> bool:
    """Whether ``obj["a"][0]`` and ``obj["b"]`` (one RRef sent twice) arrived as one object."""
    return obj["a"][0] is obj["b"]


def fetch_now(rref: rpc.RRef[Any], timeout: float) -> Any:
    """``to_here()`` at once on an RRef just received (possibly still unconfirmed)."""
    value = rref.to_here(timeout)
    return value.tolist() if isinstance(value, torch.Tensor) else value


async def fetch_now_local(rref: rpc.RRef[Any]) -> Any:
    """On the owner: the value of an owner RRef just received, whose creation may not have run
    yet (``async``: waiting on the loop, not in a pool thread that the creation may need)."""
    assert rref.is_owner(), rref
    value = await rref.to_here_async()
    assert rref.local_value() is value
    return value.tolist() if isinstance(value, torch.Tensor) else value


def fetch_error(rref: rpc.RRef[Any], timeout: float) -> dict[str, Any]:
    """``to_here()`` on an RRef whose creation is expected to have failed: what was raised."""
    try:
        rref.to_here(timeout)
    except Exception as exc:  # noqa: BLE001 - reported
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "code": getattr(exc, "code", None),
        }
    return {"type": None}


def forward(to: str, key: str, obj: Any, keep_here: bool) -> Any:
    """Pass ``obj`` (RRefs inside) on to worker ``to``, which keeps it under ``key``.

    Returns what ``to`` sees of it. ``keep_here``: this worker keeps its copy too.
    """
    if keep_here:
        keep(key, obj)
    rpc.rpc_sync(to, keep, (key, obj), timeout=30)
    return rpc.rpc_sync(to, describe_kept, (key,), timeout=30)


def local_rref(value: Any) -> rpc.RRef[Any]:
    """An RRef owned by this worker, returned to the caller (this worker keeps nothing)."""
    return rpc.RRef(value)


def remote_rref(to: str, i: int) -> dict[str, Any]:
    """An RRef owned by ``to`` created here and returned (nested) to the caller."""
    rref = rpc.remote(to, make_value, (i,))
    return {"made_by": rpc.get_worker_info().name, "rrefs": [rref]}


def rref_pair(to: str, i: int) -> tuple[rpc.RRef[Any], rpc.RRef[Any]]:
    """A tuple of two RRefs: one owned here, one owned by ``to``."""
    return rpc.RRef(make_value(i)), rpc.remote(to, make_value, (i + 1,))
