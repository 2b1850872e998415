"""The functions hello_rpc.py calls on other workers.

rpcdist sends a function by name (``hello_functions.scale``), not by value, so the worker that
runs it must be able to import it: that is why these live in their own module rather than in
the script. The same module works with the worker program, too:
``rpcdist-worker --import hello_functions ...``.
"""

from __future__ import annotations

import asyncio
import os

import torch

import rpcdist.rpc as rpc


def whoami() -> str:
    """Where this call ran: the worker's name and process id."""
    return f"{rpc.get_worker_info().name} (pid {os.getpid()})"


def scale(t: torch.Tensor, factor: float) -> tuple[str, torch.Tensor]:
    """A plain function: runs on one of the callee's worker threads."""
    return rpc.get_worker_info().name, t * factor


async def slow_square(x: int, seconds: float) -> tuple[str, int]:
    """An ``async def`` function: runs on the callee's event loop, so many can wait at once."""
    await asyncio.sleep(seconds)
    return rpc.get_worker_info().name, x * x


def divide(a: float, b: float) -> float:
    """Raises ZeroDivisionError for b == 0; the caller gets that exception back."""
    return a / b


class Counter:
    """An object that stays on the worker that created it; callers hold an RRef to it."""

    def __init__(self, start: int) -> None:
        self.total = start
        self.owner = rpc.get_worker_info().name

    def add(self, n: int) -> int:
        self.total += n
        return self.total
