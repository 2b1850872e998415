"""RPC calls in torch's profiler: under ``torch.autograd.profiler.profile()`` (or
``torch.profiler.profile``), every ``rpc_sync``/``rpc_async``/``remote`` call records an event
named as torch names it, ``rpc_async#module.func(worker0 -> worker1)``, spanning the call
from its start until its future completes::

    with torch.autograd.profiler.profile() as prof:
        rpc.rpc_sync("worker1", torch.add, args=(t, 1))
    [e.name for e in prof.function_events]   # [..., "rpc_sync#torch.add(worker0 -> worker1)"]

Nothing is recorded (and nothing costs anything) when no profiler is running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rpcdist.futures import Future

__all__ = ["function_name", "profiling_key", "profiled"]


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
    record._call_end_callbacks_on_future(future)  # the event ends when the call does
    return future
