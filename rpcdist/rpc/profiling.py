"""RPC calls in torch's profiler.

The call's own event
--------------------
Under ``torch.autograd.profiler.profile()``, ``torch.profiler.profile`` or torch's legacy
profiler, every ``rpc_sync``/``rpc_async``/``remote`` call records an event named as torch
names it, ``rpc_async#module.func(worker0 -> worker1)``, spanning the call from its start
until its future completes::

    with torch.autograd.profiler.profile() as prof:
        rpc.rpc_sync("worker1", torch.add, args=(t, 1))
    [e.name for e in prof.function_events]   # [..., "rpc_sync#aten::add(worker0 -> worker1)"]

Nothing is recorded (and nothing costs anything) when no profiler is running.

The callee's events
-------------------
An ``rpc_sync``/``rpc_async`` of a blocking function made while a profiler runs asks the
callee to profile the call: the callee runs it under torch's legacy profiler, on its own
pool thread only, and sends the events back with the result. They join the caller's profile
as torch's RPC adds them: named ``<call's event>#remote_op: <callee's event>``
(``rpc_sync#aten::add(w0 -> w1)#remote_op: aten::add``), ``is_remote=True``, ``node_id`` the
callee's rank, placed on the caller's timeline from the start of the call's event, with
input shapes and memory when the caller's profiler records them. Calls the callee makes
while profiled come back the same way, nested names and all.

torch gives no Python way to add events to a profile, so :func:`install` (run by
``init_rpc``) wraps the two places where torch's profilers start and where they build their
event lists; a profile without RPC calls is built exactly as before. Not profiled on the
callee (the call's own event is still recorded): ``async def`` and ``@async_execution``
functions (they share the callee's event loop with other calls), ``remote()`` (its value
stays on the owner) and calls to a callee that is running a profiler of its own.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.profiler as kineto_profiler
import torch.autograd.profiler_legacy as legacy_profiler
from torch.autograd.profiler_util import FunctionEvent

from rpcdist.agent.markers import TORCH_ASYNC_EXECUTION_ATTR, is_async_execution, is_inline
from rpcdist.futures import Future
from rpcdist.serialization import trust

log = logging.getLogger(__name__)

__all__ = [
    "REMOTE_OP_STR",
    "function_name",
    "install",
    "profiled",
    "profiled_call",
    "profiling_key",
    "run_profiled",
]

REMOTE_OP_STR = "#remote_op: "
"""Between a call's event name and the name of a callee's event, as torch writes it."""


def function_name(func: Callable[..., Any]) -> str:
    """The name torch's profiler gives a called function: ``aten::add`` for torch's builtin
    operators, else its ``__qualname__`` (as torch's RPC does)."""
    try:
        from torch.jit._builtins import _find_builtin

        builtin = _find_builtin(func)
    except Exception:  # noqa: BLE001 - torch cannot look it up: not a builtin
        builtin = None
    if builtin is not None:
        return builtin
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__


def profiling_key(mode: str, function: str, caller: str, callee: str) -> str:
    """The profiler event name torch gives a call: ``rpc_<mode>#<function>(<caller> -> <callee>)``."""
    return f"rpc_{mode}#{function}({caller} -> {callee})"


def profiled(key: Callable[[], str], start: Callable[[], Future[Any]]) -> Future[Any]:
    """``start()`` the call; while a profiler runs, record it as event ``key()`` until its
    future completes."""
    if not torch.autograd._profiler_enabled():
        return start()
    record = torch.autograd.profiler.record_function(key())
    record.__enter__()
    try:
        future = start()
    except BaseException:
        record.__exit__(None, None, None)
        raise
    # The event ends when the call does, in a callback on the thread that completes it. The
    # caller sees the call complete only after that, or a profile it closes right after the
    # call (a callee profiling a nested call) would miss the event.
    ended = record._call_end_callbacks_on_future(future.torch_future())  # read in C++
    result: Future[Any] = Future(loop=getattr(future, "_loop_hint", None))

    def finished(_: Any) -> None:
        error = future.exception()
        result._try_complete(None if error is not None else future.value(), error)

    ended.add_done_callback(finished)
    return result


# ============================================================================ the callee's events
@trust
@dataclass
class RemoteEvent:
    """One event a callee recorded, as it travels back: times in µs from the start of the
    callee's profiling of the call."""

    name: str
    start_us: float
    end_us: float
    thread: int
    node_id: int
    input_shapes: Any = None
    cpu_memory_usage: int = 0
    sequence_nr: int = -1


@trust
@dataclass
class Profiled:
    """What a profiled call returns over the wire: the function's result and its events."""

    value: Any
    events: list[RemoteEvent]


class _Session:
    """The remote events that arrive for one running profile (one thread's)."""

    def __init__(self, record_shapes: bool, profile_memory: bool) -> None:
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self._lock = threading.Lock()  # replies arrive on the agent's loop thread
        self._batches: list[tuple[str, int, list[RemoteEvent]]] = []

    def add(self, key: str, callee_rank: int, events: list[RemoteEvent]) -> None:
        with self._lock:
            self._batches.append((key, callee_rank, events))

    def function_events(self, local: list[Any]) -> list[FunctionEvent]:
        """The received events as torch's FunctionEvents, each batch placed from the start of
        its call's event among ``local`` (the n-th reply of a key at the n-th such event)."""
        with self._lock:
            batches, self._batches = self._batches, []
        if not batches:
            return []
        keys = {key for key, _, _ in batches}
        starts: dict[str, list[float]] = collections.defaultdict(list)
        for event in local:
            if event.name in keys:
                starts[event.name].append(event.time_range.start)
        for found in starts.values():
            found.sort()
        seen: collections.Counter[str] = collections.Counter()
        made: list[FunctionEvent] = []
        for key, callee_rank, events in batches:
            index = seen[key]
            seen[key] += 1
            origin = starts[key][index] if index < len(starts[key]) else 0.0
            for remote in events:
                made.append(
                    FunctionEvent(
                        id=next(_event_ids),
                        name=key + REMOTE_OP_STR + remote.name,
                        thread=remote.thread,
                        start_us=origin + remote.start_us,
                        end_us=origin + remote.end_us,
                        input_shapes=remote.input_shapes if self.record_shapes else None,
                        cpu_memory_usage=remote.cpu_memory_usage if self.profile_memory else 0,
                        is_remote=True,
                        sequence_nr=remote.sequence_nr,
                        node_id=remote.node_id if remote.node_id >= 0 else callee_rank,
                    )
                )
        return made


_local = threading.local()  # .session: the _Session of the profile running on this thread
_event_ids = itertools.count(1 << 40)  # apart from the ids torch gives local events
_installed = False
_install_lock = threading.Lock()
_parse_legacy_records: Callable[[Any], list[Any]] = legacy_profiler._parse_legacy_records


def install() -> None:
    """Let torch's profilers take in remote events (idempotent): wrap where they start (a
    session for the thread) and where they build their event lists (the session's events
    are added there)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        try:
            _wrap_profilers()
        except AttributeError as exc:  # another torch: the calls' own events still show
            log.warning("cannot add remote events to torch's profiler (%s)", exc)
        _installed = True


def _wrap_profilers() -> None:
    def starting(profile: Any) -> _Session:
        session = _Session(bool(profile.record_shapes), bool(profile.profile_memory))
        _local.session = session
        return session

    start_legacy = legacy_profiler.profile._start_trace
    start_kineto = kineto_profiler.profile._start_trace
    parse_kineto = kineto_profiler.profile._parse_kineto_results

    def legacy_start_trace(self: Any) -> None:
        starting(self)
        start_legacy(self)

    def legacy_parse(thread_records: Any) -> list[Any]:
        events = _parse_legacy_records(thread_records)
        session = getattr(_local, "session", None)  # a legacy profile ends on its own thread
        _local.session = None
        if session is not None:
            events.extend(session.function_events(events))
        return events

    def kineto_start_trace(self: Any) -> None:
        self._rpcdist_session = starting(self)
        start_kineto(self)

    def kineto_parse(self: Any, result: Any, *args: Any, **kwargs: Any) -> list[Any]:
        events = parse_kineto(self, result, *args, **kwargs)
        session = getattr(self, "_rpcdist_session", None)
        if session is not None:
            events.extend(session.function_events(events))
        return events

    legacy_profiler.profile._start_trace = legacy_start_trace
    legacy_profiler._parse_legacy_records = legacy_parse
    kineto_profiler.profile._start_trace = kineto_start_trace
    kineto_profiler.profile._parse_kineto_results = kineto_parse


def _collects_remotely(func: Any) -> bool:
    """Whether a call of ``func`` can be profiled on the callee: it runs on a pool thread
    there (not an ``async def``, ``@async_execution`` or rpcdist's own inline handler)."""
    return not (
        inspect.iscoroutinefunction(func)
        or is_async_execution(func)
        or is_inline(func)
        or inspect.iscoroutinefunction(getattr(func, TORCH_ASYNC_EXECUTION_ATTR, None))
    )


def profiled_call(
    agent: Any, mode: str, to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float
) -> Future[Any]:
    """An ``rpc_sync``/``rpc_async`` made while a profiler runs on this thread: its event,
    and the callee's events when it can profile the call."""
    dest = agent.worker(to)
    key = profiling_key(mode, function_name(func), agent.info.name, dest.name)
    session = getattr(_local, "session", None)
    if session is None or not _collects_remotely(func):
        return profiled(lambda: key, lambda: agent.submit(to, func, args, kwargs, timeout))
    from rpcdist import serialization

    name = serialization.check_importable(func)  # refused here as an unprofiled call would be
    flags = (session.record_shapes, session.profile_memory)

    def start() -> Future[Any]:
        reply = agent.submit(
            to, run_profiled, (func, flags, *(args or ())), kwargs, timeout, function_name=name
        )

        def unwrap(done: Any) -> Any:
            outcome = done.value()
            if isinstance(outcome, Profiled):
                session.add(key, dest.id, outcome.events)
                return outcome.value
            return outcome

        return reply.then(unwrap)

    return profiled(lambda: key, start)


@trust
def run_profiled(func: Callable[..., Any], flags: tuple[bool, bool], *args: Any, **kwargs: Any) -> Any:
    """On the callee: run ``func`` under torch's legacy profiler (this thread only) and
    return :class:`Profiled` with its events; just run it if this thread is profiled already."""
    if torch.autograd._profiler_enabled():
        return func(*args, **kwargs)
    record_shapes, profile_memory = flags
    config = torch._C._profiler.ProfilerConfig(
        torch._C._profiler.ProfilerState.CPU,
        record_shapes,
        profile_memory,
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        torch._C._profiler._ExperimentalConfig(),
    )
    outer = getattr(_local, "session", None)
    session = _local.session = _Session(record_shapes, profile_memory)  # nested calls' events
    torch.autograd._enable_profiler_legacy(config)
    try:
        value = func(*args, **kwargs)
    finally:
        records = torch.autograd._disable_profiler_legacy()
        _local.session = outer
    events = _parse_legacy_records(records)
    events.extend(session.function_events(events))
    return Profiled(value, [_travelling(event) for event in events])


def _travelling(event: Any) -> RemoteEvent:
    return RemoteEvent(
        name=event.name,
        start_us=float(event.time_range.start),
        end_us=float(event.time_range.end),
        thread=int(event.thread),
        node_id=int(getattr(event, "node_id", -1)),
        input_shapes=event.input_shapes or None,
        cpu_memory_usage=int(event.cpu_memory_usage or 0),
        sequence_nr=int(getattr(event, "sequence_nr", -1)),
    )
