"""Hello, rpcdist: three processes calling functions on each other.

Run it with one command; there is no server to start and nothing to configure::

    python examples/hello_rpc.py

It starts three worker processes on this machine. They meet through the ``env://`` init method:
the launcher below picks a free local port for MASTER_PORT, and rank 0 hosts the rendezvous
store in its own process. worker0 makes all the calls; worker1 and worker2 only join and then
serve calls until worker0 is done, exactly as with ``torch.distributed.rpc``.

The functions called remotely are in ``hello_functions.py``: rpcdist sends functions by name,
so the worker that runs one must be able to import it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import torch

import rpcdist.rpc as rpc
from rpcdist.futures import wait_all

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hello_functions, also under `python -m`
import hello_functions as hf  # noqa: E402

WORLD_SIZE = 3


def say(text: str) -> None:
    print(text, flush=True)


def tour() -> None:
    """What worker0 does once the group has formed."""
    names = [w.name for w in rpc.get_all_worker_infos()]
    say(f"worker0: the group is {', '.join(names)}; asking each worker who it is:")
    for name in names:
        say(f"   rpc_sync({name!r}, whoami) -> {rpc.rpc_sync(name, hf.whoami)}")

    # 1. rpc_sync: run a function on another worker and wait for its result.
    x = torch.tensor([1.0, 2.0, 3.0])
    where, y = rpc.rpc_sync("worker1", hf.scale, args=(x, 10.0))
    say(f"1. rpc_sync:   {where} computed scale({x.tolist()}, 10) = {y.tolist()}")

    # 2. rpc_async returns a Future at once: start many calls, then gather the results.
    #    slow_square is an `async def`, so each worker runs its calls concurrently.
    start = time.perf_counter()
    futures = [rpc.rpc_async(f"worker{1 + i % 2}", hf.slow_square, args=(i, 0.5)) for i in range(6)]
    results = wait_all(futures)
    elapsed = time.perf_counter() - start
    say(f"2. rpc_async:  6 calls of async def slow_square (0.5 s each) returned in {elapsed:.2f} s")
    for i, (where, square) in enumerate(results):
        say(f"     {where}: {i}^2 = {square}")

    # 3. remote(): create an object on worker2 and keep it there; we get an RRef to it.
    counter = rpc.remote("worker2", hf.Counter, args=(100,))
    counter.rpc_sync().add(5)  # runs Counter.add on worker2
    total = counter.rpc_sync().add(7)
    copy = counter.to_here()  # a copy of the object, fetched from its owner
    say(f"3. remote:     {counter} -> Counter(100) lives on {counter.owner().name}")
    say(f"     add(5), add(7) ran there -> {total}; to_here() fetched a copy: total={copy.total}")

    # 4. An exception raised remotely is raised again here, with its own type.
    try:
        rpc.rpc_sync("worker1", hf.divide, args=(1.0, 0.0))
    except ZeroDivisionError as exc:
        say(f"4. exception:  divide(1, 0) on {exc.remote_worker} raised {type(exc).__name__}: {exc}")


def run_worker(rank: int) -> None:
    """The body of each worker process."""
    # env://: MASTER_ADDR and MASTER_PORT come from the environment the launcher set up.
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD_SIZE)
    try:
        if rank == 0:
            tour()
    finally:
        # Waits for every worker to get here, so worker1 and worker2 serve until worker0 is done.
        rpc.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    say(f"starting {WORLD_SIZE} workers; worker0 hosts the store on 127.0.0.1:{os.environ['MASTER_PORT']}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_worker, args=(rank,), name=f"worker{rank}") for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 100
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    codes = [proc.exitcode for proc in procs]
    if codes != [0] * WORLD_SIZE:
        print(f"some workers failed or hung: exit codes {codes}", file=sys.stderr)
        return 1
    say(f"done: all {WORLD_SIZE} workers shut down cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
