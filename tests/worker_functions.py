"""Functions the rpcdist-worker tests import into the worker program (``--import worker_functions``).

Not a test module: tests/test_worker_program.py puts this directory on the workers' PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

import rpcdist.rpc as rpc


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t * factor


async def delayed_sum(values: list[int], delay: float) -> int:
    await asyncio.sleep(delay)
    return sum(values)


def whoami() -> tuple[str, int, int]:
    """This worker's name, rank and process id."""
    me = rpc.get_worker_info()
    return me.name, me.id, os.getpid()


def fail(message: str) -> None:
    raise ValueError(message)


def relay(to: str, values: list[int]) -> int:
    """Call another worker from inside a call (a nested RPC)."""
    return rpc.rpc_sync(to, delayed_sum, args=(values, 0.0))


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def sleep_on(to: str, seconds: float) -> None:
    """Have worker ``to`` sleep, with this worker's default RPC timeout (set by --rpc-timeout)."""
    rpc.rpc_sync(to, time.sleep, args=(seconds,))
