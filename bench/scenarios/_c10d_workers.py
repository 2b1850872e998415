"""The processes the ``c10d`` scenario (``c10d.py``) starts: the ranks of one process group of one system.

A group is ``world`` processes of one system ("gloo": ``torch.distributed`` with backend gloo;
"rpcdist": ``import rpcdist as dist``, backend grpc) that join one default process group and
then run the same list of phases in the same order. Every rank talks to the orchestrator over
its own ``multiprocessing`` Pipe, never through the library under test:

    rank -> orchestrator   ("phase", name, budget_s)    the rank starts a phase (hang deadline)
                           ("result", name, {...})      its own per-iteration times (ns)
                           ("error", name, traceback)   the phase raised on this rank; the rank
                                                        then waits to be stopped (its group may
                                                        be out of step: the orchestrator starts
                                                        a fresh one for the phases left)
                           ("measured",)                every phase done, leaving the group
                           ("done",)                    left the group cleanly

Timing: after warm-up, every rank runs the operation back to back and times each call with
``perf_counter_ns``; the orchestrator takes, per iteration, the slowest rank's time. Back to
back, a rank's call time is the period of the operation as that rank sees it (a rank cannot
get more than one operation ahead of a full-synchronising collective), so no barrier of the
system under test sits inside or between the timed calls.

On SIGUSR1 (a hang) a rank writes every thread's stack to its ``stack_file`` (faulthandler).
Failure injection for the harness's own tests: ``C10DBENCH_FAIL`` / ``C10DBENCH_HANG`` =
``system:phase[:rank]`` makes that rank raise in / sleep through that phase (rank defaults to
the last one for FAIL and 0 for HANG).

Nothing heavy is imported at module level: the orchestrator imports this module too.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import _harness as H
from _harness import KiB, MiB


# ------------------------------------------------------------------------------------------------
# the phases: (name, kind, size in bytes); every rank of a group gets the same list
# ------------------------------------------------------------------------------------------------
def phase_name(kind: str, size: int) -> str:
    return kind if kind == "barrier" else f"{kind}_{size}"


def iterations(cfg: dict[str, Any], kind: str, size: int) -> tuple[int, int]:
    """(warm-up calls, timed calls) for an operation on ``size`` bytes."""
    if kind == "barrier" or size < 256 * KiB:
        return cfg["iters_small"]
    if size <= 1 * MiB:
        return cfg["iters_1m"]
    if size <= 16 * MiB:
        return cfg["iters_16m"]
    return cfg["iters_64m"]


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def rank_main(
    system: str,
    rank: int,
    world: int,
    init_method: str,
    phases: list[tuple[str, str, int]],
    cfg: dict[str, Any],
    conn: Any,
    stack_file: str,
    lifeline: Any,
) -> None:
    """Entry point of rank ``rank`` of a ``world``-process group of ``system``."""
    _keep = H.child_setup(stack_file, lifeline, "c10dbench")  # noqa: F841
    from datetime import timedelta

    import torch

    # One intra-op thread per rank, as torchrun sets up (OMP_NUM_THREADS=1) for several
    # processes per machine: 4 ranks on 2 cores must not each start a thread per core.
    torch.set_num_threads(1)
    conn.send(("phase", "init", cfg["init_budget"]))
    try:
        if system == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1 for the pairs too
            import torch.distributed as dist

            backend = "gloo"
        elif system == "rpcdist":
            import rpcdist as dist

            backend = "grpc"
        else:
            raise ValueError(system)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg["op_timeout"]),
        )
        if dist.get_rank() != rank or dist.get_world_size() != world:
            raise RuntimeError(f"joined as rank {dist.get_rank()} of {dist.get_world_size()}")
    except BaseException:
        conn.send(("error", "init", traceback.format_exc()))
        H.wait_for_stop(conn)
        return
    conn.send(("result", "init", {}))

    for name, kind, size in phases:
        conn.send(("phase", name, cfg["phase_budget"]))
        try:
            if H.injected("C10DBENCH_FAIL", system, name, rank, world - 1):
                raise RuntimeError(f"failure injected into phase {name!r} on rank {rank} by C10DBENCH_FAIL")
            if H.injected("C10DBENCH_HANG", system, name, rank, 0):
                while True:  # a hang, injected by C10DBENCH_HANG
                    time.sleep(1)
            result = _measure(dist, torch, kind, size, rank, world, cfg)
        except BaseException:
            conn.send(("error", name, traceback.format_exc()))
            H.wait_for_stop(conn)  # the group may be out of step now: do not run on
            return
        conn.send(("result", name, result))

    conn.send(("measured",))
    conn.send(("phase", "shutdown", cfg["init_budget"]))
    try:
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", "shutdown", traceback.format_exc()))
        return
    conn.send(("done",))


def _measure(
    dist: Any, torch: Any, kind: str, size: int, rank: int, world: int, cfg: dict[str, Any]
) -> dict[str, Any]:
    warmup, iters = iterations(cfg, kind, size)
    n = max(1, size // 4)  # float32 elements

    if kind == "barrier":

        def op() -> None:
            dist.barrier()

        check = None

    elif kind == "all_reduce":
        t = torch.full((n,), float(rank + 1), dtype=torch.float32)

        def check() -> None:
            expect = world * (world + 1) / 2
            if not bool((t == expect).all()):
                raise RuntimeError(f"all_reduce SUM gave {t[:4].tolist()}..., expected {expect} everywhere")
            t.zero_()  # timed calls sum zeros: the values cannot grow to inf

        def op() -> None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    elif kind == "broadcast":
        t = torch.arange(n, dtype=torch.float32) if rank == 0 else torch.zeros(n, dtype=torch.float32)

        def check() -> None:
            if rank != 0 and not torch.equal(t, torch.arange(n, dtype=torch.float32)):
                raise RuntimeError("broadcast: rank 0's tensor did not arrive intact")

        def op() -> None:
            dist.broadcast(t, src=0)

    elif kind == "send_recv":
        t = torch.arange(n, dtype=torch.float32) if rank == 0 else torch.zeros(n, dtype=torch.float32)

        def check() -> None:
            if rank == 1 and not torch.equal(t, torch.arange(n, dtype=torch.float32)):
                raise RuntimeError("recv: rank 0's tensor did not arrive intact")

        def op() -> None:
            if rank == 0:
                dist.send(t, dst=1)
            elif rank == 1:
                got = dist.recv(t, src=0)
                if got not in (None, 0):
                    raise RuntimeError(f"recv reported sender {got!r}, expected 0")

    else:
        raise ValueError(kind)

    op()  # first call (checked): connections, buffers, allocations
    if check is not None:
        check()
    for _ in range(max(0, warmup - 1)):
        op()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(iters):
        t0 = clock()
        op()
        samples.append(clock() - t0)
    return {"samples_ns": samples, "median_us": statistics.median(samples) / 1e3, "warmup": warmup}
