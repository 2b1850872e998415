"""Functions and classes of the restricted-mode and limits tests (``security_scenarios``).

Both workers import this module, so the exposed functions and registered classes are
registered on both; the unexposed ones exist on both too (the callee could import them), so
a refusal proves restricted mode, not a missing module.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np
import torch

import rpcdist.rpc as rpc


class Pwn:
    """A malicious argument: unpickling it would create ``marker`` through ``os.system``."""

    def __init__(self, marker: str, how: str = "system") -> None:
        self.marker = marker
        self.how = how

    def __reduce__(self) -> Any:
        if self.how == "eval":
            return (eval, (f"open({self.marker!r}, 'w').close()",))
        if self.how == "open":
            return (open, (self.marker, "w"))
        return (os.system, (f"touch {self.marker}",))


@rpc.register_safe_class
class SafePoint:
    def __init__(self, x: float, y: float) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SafePoint) and (self.x, self.y) == (other.x, other.y)


class UnsafePoint(SafePoint):
    """Not registered: refused in restricted mode."""


class Counter:
    """An RRef's value: ``bump`` is public, ``_secret`` is not."""

    def __init__(self) -> None:
        self.n = 0

    def bump(self, by: int) -> int:
        self.n += by
        return self.n

    def _secret(self) -> str:
        return "private"


@rpc.expose
def echo(value: Any) -> Any:
    return value


@rpc.expose
def add(t: torch.Tensor, a: np.ndarray, extra: dict[str, Any]) -> dict[str, Any]:
    return {"sum": t + torch.from_numpy(a), "extra": extra}


@rpc.expose
async def async_double(t: torch.Tensor) -> torch.Tensor:
    await asyncio.sleep(0)
    return t * 2


@rpc.expose
def make_counter() -> Counter:
    return Counter()


@rpc.expose
def make_unsafe_point() -> UnsafePoint:
    return UnsafePoint(1, 2)


@rpc.expose
def raise_value_error(text: str) -> None:
    raise ValueError(text)


def not_exposed() -> str:
    return "ran"


def allowlisted() -> str:
    """Not decorated: admitted through RpcBackendOptions(allowlist=[...])."""
    return "allowlisted ran"


_lock = threading.Lock()
_running = 0
_most_running = 0


@rpc.expose
def slow(seconds: float) -> int:
    """Sleep on a pool thread; records how many ran at once (see :func:`most_running`)."""
    global _running, _most_running
    with _lock:
        _running += 1
        _most_running = max(_most_running, _running)
    try:
        time.sleep(seconds)
    finally:
        with _lock:
            _running -= 1
    return 1


@rpc.expose
def most_running(reset: bool = False) -> int:
    global _most_running
    with _lock:
        value = _most_running
        if reset:
            _most_running = 0
    return value
