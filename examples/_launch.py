"""What the multi-process examples share: start ``world_size`` workers on this machine that
meet through ``env://`` (rank 0 hosts the store on a free port), wait for them, report."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_local_store() -> str:
    """Point env:// at 127.0.0.1 and a free port (inherited by the workers); returns the port."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    return os.environ["MASTER_PORT"]


def run_workers(
    target: Callable[[int, Any], None], world_size: int, args: Any, timeout: float, say: Callable[[str], None]
) -> int:
    """Run ``target(rank, args)`` in ``world_size`` spawned processes; kill whatever is still
    running after ``timeout`` seconds. Returns the exit status for the launcher."""
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, args)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    codes = [proc.exitcode for proc in procs]
    if codes != [0] * world_size:
        print(f"some workers failed or hung: exit codes {codes}", file=sys.stderr)
        return 1
    say(f"done in {time.perf_counter() - start:.1f} s: all {world_size} workers shut down cleanly")
    return 0
