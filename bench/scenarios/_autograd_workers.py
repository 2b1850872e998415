"""The processes the ``autograd`` scenario (``autograd.py``) starts, and what they call on each other.

A group is the processes of one scenario of one system ("torch": ``torch.distributed.rpc`` /
``torch.distributed.autograd`` / ``torch.distributed.optim``, TensorPipe defaults; "rpcdist":
``rpcdist.rpc`` / ``rpcdist.autograd`` / ``rpcdist.optim``). The workload code is the same for
both; only the three modules differ.

  "ps"        rank 0 "ps" owns the model (an MLP) and serves; ranks 1.. "trainer<k>" each train
              it: forward through the PS (``rpc_sync``), loss, ``dist_autograd.backward``,
              ``DistributedOptimizer.step``, each in its own distributed autograd context.
  "pipeline"  rank 0 "driver" holds stage 1 of a 2-stage model and drives; rank 1 "stage2"
              holds stage 2 and answers ``rpc_sync``.

Every process talks to the orchestrator over its own ``multiprocessing`` Pipe, never through
the library under test:

    rank -> orchestrator   ("phase", name, budget_s)    a phase starts (hang deadline)
                           ("result", name, {...})      its numbers
                           ("error", name, traceback)   it raised; the rank then waits to be
                                                        stopped
                           ("ready",)                   a trainer finished its warm-up: it
                                                        waits for ("go", t0, window)
                           ("measured",)                all phases done, shutting down
                           ("done",)                    shut down cleanly
    orchestrator -> rank   ("go", t0, window_s)         every trainer is warm: measure from
                                                        monotonic time t0 for window_s
                           ("stop",)                    give up (another rank failed)

The functions that run on a peer (``ps_forward``, ``stage2_forward``, ...) live here, not in
the driver (``__main__`` in the orchestrator), so both systems pickle them by
reference: every benchmark process has this directory on ``sys.path``.

Failure injection for the harness's own tests: ``AGBENCH_FAIL`` / ``AGBENCH_HANG`` =
``system:phase[:rank]`` makes that rank (default: the last) raise in / sleep through that phase.

Nothing heavy is imported at module level: the orchestrator imports this module too.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import _harness as H

from scenarios._rpc_workers import backend_options

_MODEL: Any = None  # "ps": the whole MLP, on rank 0
_STAGE2: Any = None  # "pipeline": stage 2, on rank 1


# ------------------------------------------------------------------------------------------------
# the model, and what peers call
# ------------------------------------------------------------------------------------------------
def _mlp(dims: list[int], seed: int) -> Any:
    """Linear / ReLU / ... / Linear through ``dims`` (e.g. 64 -> 128 -> 10), seeded."""
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def ps_forward(x: Any) -> Any:
    """On the PS: the model's forward (recorded by the caller's distributed autograd context).

    Each layer computes with a clone of its weight and bias, and the gradients reach the
    parameters through the clones. With the parameters themselves, the other trainer's
    ``DistributedOptimizer.step`` (SGD updates them in place) bumps the version of tensors this
    forward saved for backward, and both systems' backward fail at once with "one of the
    variables needed for gradient computation has been modified by an inplace operation".
    """
    import torch
    import torch.nn.functional as F

    h = x
    for layer in _MODEL:
        if isinstance(layer, torch.nn.Linear):
            h = F.linear(h, layer.weight.clone(), layer.bias.clone())
        else:
            h = layer(h)
    return h


def ps_param_rrefs(system: str) -> list[Any]:
    """On the PS: an RRef to each of the model's parameters, for a ``DistributedOptimizer``."""
    rpc = _rpc_module(system)
    return [rpc.RRef(p) for p in _MODEL.parameters()]


def stage2_forward(h: Any) -> Any:
    """On "stage2": stage 2 of the pipeline model."""
    return _STAGE2(h)


def stage2_state() -> list[Any]:
    """On "stage2": copies of stage 2's parameters (for the gradient check)."""
    return [p.detach().clone() for p in _STAGE2.parameters()]


def getpid() -> int:
    return os.getpid()


# ------------------------------------------------------------------------------------------------
# process setup
# ------------------------------------------------------------------------------------------------
def _rpc_module(system: str) -> Any:
    if system == "torch":
        import torch.distributed.rpc as rpc
    elif system == "rpcdist":
        import rpcdist.rpc as rpc
    else:
        raise ValueError(system)
    return rpc


def _modules(system: str) -> tuple[Any, Any, Any]:
    """(rpc, dist_autograd, DistributedOptimizer) of ``system``."""
    if system == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
    elif system == "rpcdist":
        import rpcdist.autograd as dist_autograd
        import rpcdist.rpc as rpc
        from rpcdist.optim import DistributedOptimizer
    else:
        raise ValueError(system)
    return rpc, dist_autograd, DistributedOptimizer


def is_ps(scenario: str) -> bool:
    """"ps" (2 trainers) and "ps4" (4 trainers) are the same parameter-server workload."""
    return scenario.startswith("ps")


def worker_name(scenario: str, rank: int) -> str:
    if is_ps(scenario):
        return "ps" if rank == 0 else f"trainer{rank}"
    return "driver" if rank == 0 else "stage2"


class _Phases:
    """Runs one rank's phases and reports them; after a failure the rank waits to be stopped."""

    def __init__(self, system: str, rank: int, world: int, conn: Any, cfg: dict[str, Any]) -> None:
        self.system, self.rank, self.world, self.conn, self.cfg = system, rank, world, conn, cfg

    def run(self, name: str, fn: Any, *args: Any, budget: float | None = None) -> Any:
        self.conn.send(("phase", name, budget or self.cfg["phase_budget"]))
        try:
            if H.injected("AGBENCH_FAIL", self.system, name, self.rank, self.world - 1):
                raise RuntimeError(
                    f"failure injected into phase {name!r} on rank {self.rank} by AGBENCH_FAIL"
                )
            if H.injected("AGBENCH_HANG", self.system, name, self.rank, self.world - 1):
                while True:  # a hang, injected by AGBENCH_HANG
                    time.sleep(1)
            result = fn(*args)
        except BaseException:
            self.conn.send(("error", name, traceback.format_exc()))
            H.wait_for_stop(self.conn)
            raise  # not reached
        self.conn.send(("result", name, result if isinstance(result, dict) else {}))
        return result


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def rank_main(
    system: str,
    scenario: str,
    rank: int,
    world: int,
    init_method: str,
    cfg: dict[str, Any],
    conn: Any,
    stack_file: str,
    lifeline: Any,
) -> None:
    """Entry point of rank ``rank`` of a ``world``-process group of ``system`` running ``scenario``."""
    global _MODEL, _STAGE2
    _keep = H.child_setup(stack_file, lifeline, "agbench")  # noqa: F841
    import torch

    # One intra-op thread per process, as torchrun sets up (OMP_NUM_THREADS=1) for several
    # processes per machine: 3 processes on 2 cores must not each start a thread per core.
    torch.set_num_threads(1)
    rpc, dist_autograd, DistributedOptimizer = _modules(system)
    phases = _Phases(system, rank, world, conn, cfg)
    dims = cfg["dims"]
    # The model exists before the group does, so no call can arrive before it.
    if is_ps(scenario) and rank == 0:
        _MODEL = _mlp(dims, cfg["seed"])
    elif scenario == "pipeline" and rank == 1:
        _STAGE2 = _mlp(dims[1:], cfg["seed"] + 1)

    def init() -> dict[str, Any]:
        # TensorPipe / rpcdist defaults, or the cross-host path when ``cfg["path"]`` says so
        options = backend_options(system, rpc, init_method, cfg)
        rpc.init_rpc(worker_name(scenario, rank), rank=rank, world_size=world, rpc_backend_options=options)
        return {}

    phases.run("init", init, budget=cfg["init_budget"])
    if rank == 0 and is_ps(scenario) or rank == 1 and scenario == "pipeline":
        # A server: it answers calls until the others shut the group down (bounded by the
        # orchestrator's own deadline for the whole group).
        pass
    elif is_ps(scenario):
        _trainer(system, rank, rpc, dist_autograd, DistributedOptimizer, phases, cfg)
    else:
        _driver(system, rpc, dist_autograd, phases, cfg)
    conn.send(("measured",))
    phases.run("shutdown", rpc.shutdown, budget=cfg["serve_budget"] if _serves(scenario, rank) else None)
    conn.send(("done",))


def _serves(scenario: str, rank: int) -> bool:
    return (is_ps(scenario) and rank == 0) or (scenario == "pipeline" and rank == 1)


def _batches(cfg: dict[str, Any], seed: int) -> list[tuple[Any, Any]]:
    """A few fixed random batches (inputs, class labels), cycled through."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(cfg["batch"], cfg["dims"][0], generator=g),
            torch.randint(0, cfg["dims"][-1], (cfg["batch"],), generator=g),
        )
        for _ in range(cfg["n_batches"])
    ]


# ------------------------------------------------------------------------------------------------
# (a) parameter server: a trainer
# ------------------------------------------------------------------------------------------------
def _trainer(
    system: str,
    rank: int,
    rpc: Any,
    dist_autograd: Any,
    DistributedOptimizer: Any,
    phases: _Phases,
    cfg: dict[str, Any],
) -> None:
    import torch
    import torch.nn.functional as F

    data = _batches(cfg, 1000 + rank)
    state: dict[str, Any] = {}

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync("ps", ps_forward, args=(x,))
            loss = F.cross_entropy(out, y)
            dist_autograd.backward(context_id, [loss])
            state["opt"].step(context_id)
        return float(loss.detach())

    def setup() -> dict[str, Any]:
        ps_pid = rpc.rpc_sync("ps", getpid)
        if ps_pid == os.getpid():
            raise RuntimeError("the PS runs in the trainer's process")
        params = rpc.rpc_sync("ps", ps_param_rrefs, args=(system,))
        state["opt"] = DistributedOptimizer(torch.optim.SGD, params, lr=cfg["lr"])
        losses = [step(i) for i in range(cfg["ps_warmup"])]
        return {"params": len(params), "warmup_steps": len(losses), "warmup_loss_first": losses[0]}

    phases.run("ps_setup", setup)
    # Both trainers start measuring at the same moment: the orchestrator waits for both.
    phases.conn.send(("ready",))
    msg = phases.conn.recv()
    if msg[0] != "go":
        os._exit(1)
    t0, window = msg[1], msg[2]

    def train() -> dict[str, Any]:
        delay = t0 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = time.monotonic()
        stop_at = t0 + window
        clock = time.perf_counter_ns
        samples: list[int] = []
        losses: list[float] = []
        i = 0
        while True:
            a = clock()
            losses.append(step(i))
            samples.append(clock() - a)
            i += 1
            if time.monotonic() >= stop_at:
                break
        end = time.monotonic()
        return {
            "steps": len(samples),
            "start": start,
            "end": end,
            "t0": t0,
            "steps_per_s": len(samples) / (end - start),
            "step": H.stats_ns(samples),
            "loss_first": statistics.fmean(losses[: len(data)]),
            "loss_last": statistics.fmean(losses[-len(data) :]),
        }

    phases.run("ps_train", train, budget=window + cfg["phase_budget"])


# ------------------------------------------------------------------------------------------------
# (b) 2-stage pipeline: the driver
# ------------------------------------------------------------------------------------------------
def _driver(system: str, rpc: Any, dist_autograd: Any, phases: _Phases, cfg: dict[str, Any]) -> None:
    import torch
    import torch.nn.functional as F

    dims = cfg["dims"]
    stage1 = _mlp(dims[:2], cfg["seed"])  # Linear(dims[0], dims[1]), then a ReLU in forward()
    data = _batches(cfg, 7)

    def forward(x: Any, y: Any) -> Any:
        h = torch.relu(stage1(x))
        out = rpc.rpc_sync("stage2", stage2_forward, args=(h,))
        return F.cross_entropy(out, y)

    def with_autograd(i: int) -> None:
        x, y = data[i % len(data)]
        with dist_autograd.context() as context_id:
            loss = forward(x, y)
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
        if len(grads) != 2:
            raise RuntimeError(f"get_gradients gave {len(grads)} tensors on the driver, expected 2")

    def plain(i: int) -> None:
        x, y = data[i % len(data)]
        with torch.no_grad():
            forward(x, y)

    def check() -> dict[str, Any]:
        """The distributed gradients of stage 1 equal those of the same model run locally."""
        if rpc.rpc_sync("stage2", getpid) == os.getpid():
            raise RuntimeError("stage 2 runs in the driver's process")
        x, y = data[0]
        with dist_autograd.context() as context_id:
            loss = forward(x, y)
            dist_autograd.backward(context_id, [loss])
            got = dist_autograd.get_gradients(context_id)
            got = {id(p): got[p].clone() for p in stage1.parameters()}
        local2 = _mlp(dims[1:], 0)
        with torch.no_grad():
            for p, v in zip(local2.parameters(), rpc.rpc_sync("stage2", stage2_state), strict=True):
                p.copy_(v)
        ref1 = _mlp(dims[:2], 0)
        ref1.load_state_dict(stage1.state_dict())
        F.cross_entropy(local2(torch.relu(ref1(x))), y).backward()
        worst = 0.0
        for p, q in zip(stage1.parameters(), ref1.parameters(), strict=True):
            worst = max(worst, float((got[id(p)] - q.grad).abs().max()))
        if worst > 1e-5:
            raise RuntimeError(f"distributed gradients of stage 1 differ from local ones by {worst:g}")
        return {"max_grad_diff": worst}

    def measure() -> dict[str, Any]:
        for i in range(cfg["pipe_warmup"]):
            plain(i)
            with_autograd(i)
        clock = time.perf_counter_ns
        samples: dict[str, list[int]] = {"plain": [], "autograd": []}
        fns = {"plain": plain, "autograd": with_autograd}
        # Short alternating blocks (the order swaps every block) so drift lands on both.
        for b in range(cfg["pipe_blocks"]):
            order = ["plain", "autograd"] if b % 2 == 0 else ["autograd", "plain"]
            for kind in order:
                fn, out = fns[kind], samples[kind]
                for i in range(cfg["pipe_block_iters"]):
                    a = clock()
                    fn(i)
                    out.append(clock() - a)
        res = {kind: H.stats_ns(s) for kind, s in samples.items()}
        res["overhead_us"] = res["autograd"]["median_us"] - res["plain"]["median_us"]
        return res

    phases.run("pipe_check", check)
    phases.run("pipeline", measure)
