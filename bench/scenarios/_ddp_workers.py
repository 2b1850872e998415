"""The processes the ``ddp`` scenario (``ddp.py``) starts: the ranks of one DDP job of one system.

A group is ``world`` processes that call ``torch.distributed.init_process_group`` with backend
"gloo" or "rpcdist" (torch's own DDP either way: only the process group under it differs) and
then train each model of the phase list with ``DistributedDataParallel`` (default buckets), in
the same order. The protocol with the orchestrator is the c10d scenario's (``_c10d_workers``):
("phase", name, budget), ("result", name, {...}), ("error", name, traceback), ("measured",),
("done",), over a ``multiprocessing`` Pipe, never through the library under test.

Timing: after warm-up steps, every rank times each training step (forward, backward with
DDP's bucketed gradient all-reduce, optimizer step) with ``perf_counter_ns``; the orchestrator
takes, per step, the slowest rank's time. Every rank trains on its own fixed random batch, so
data loading is not measured.

Failure injection for the harness: ``DDPBENCH_FAIL`` / ``DDPBENCH_HANG`` = ``system:phase[:rank]``.
Nothing heavy is imported at module level: the orchestrator imports this module too.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import _harness as H

MODELS = ("mlp", "cnn")


def build_model(kind: str, torch: Any) -> tuple[Any, Any, Any]:
    """(model, input batch, targets) of ``kind``, the same on every rank and system (seeded)."""
    nn = torch.nn
    torch.manual_seed(0)
    if kind == "mlp":  # 784-2048-2048-10: 5.8 M parameters, 23 MB of gradients per step
        model = nn.Sequential(
            nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
        )
        x = torch.randn(64, 784)
    elif kind == "cnn":  # two conv blocks and two dense layers on 3x32x32: 1.1 M parameters
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
        x = torch.randn(32, 3, 32, 32)
    else:
        raise ValueError(kind)
    y = torch.randint(0, 10, (x.shape[0],))
    return model, x, y


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
    """Entry point of rank ``rank`` of a ``world``-process DDP job over ``system``."""
    _keep = H.child_setup(stack_file, lifeline, "ddpbench")  # noqa: F841
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 for several ranks per machine
    conn.send(("phase", "init", cfg["init_budget"]))
    try:
        if system == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        elif system == "rpcdist":
            import rpcdist  # noqa: F401 - registers the "rpcdist" backend
        else:
            raise ValueError(system)
        dist.init_process_group(
            backend=system,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg["op_timeout"]),
        )
        if dist.get_backend() != system:
            raise RuntimeError(f"the default group runs on {dist.get_backend()!r}, not {system!r}")
    except BaseException:
        conn.send(("error", "init", traceback.format_exc()))
        H.wait_for_stop(conn)
        return
    conn.send(("result", "init", {}))

    for name, kind, _ in phases:
        conn.send(("phase", name, cfg["phase_budget"]))
        try:
            if H.injected("DDPBENCH_FAIL", system, name, rank, world - 1):
                raise RuntimeError(f"failure injected into phase {name!r} on rank {rank} by DDPBENCH_FAIL")
            if H.injected("DDPBENCH_HANG", system, name, rank, 0):
                while True:
                    time.sleep(1)
            result = _train(torch, dist, kind, rank, cfg)
        except BaseException:
            conn.send(("error", name, traceback.format_exc()))
            H.wait_for_stop(conn)
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


def _train(torch: Any, dist: Any, kind: str, rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x, y = build_model(kind, torch)
    torch.manual_seed(1 + rank)  # each rank its own batch, as a DistributedSampler would give
    x, y = torch.randn_like(x), y[torch.randperm(len(y))]
    ddp = DDP(model)  # default buckets (25 MB, the first 1 MB): what users run
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        return float(loss)

    first = step()
    if not first == first:  # NaN: the reduced gradients are garbage
        raise RuntimeError(f"{kind}: the first step's loss is NaN")
    for _ in range(cfg["warmup_steps"] - 1):
        step()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(cfg["steps"]):
        t0 = clock()
        step()
        samples.append(clock() - t0)
    # The replicas must still agree: DDP keeps them equal only if every all-reduce summed right.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = torch.stack([flat.max(), -flat.min(), flat.sum()])
    lo, hi = spread.clone(), spread.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.allclose(lo, hi, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"{kind}: the ranks' parameters differ after training ({lo} vs {hi})")
    return {"samples_ns": samples, "median_us": statistics.median(samples) / 1e3}
