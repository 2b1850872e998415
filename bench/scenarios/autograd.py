"""rpcdist's distributed autograd + DistributedOptimizer vs torch's, on the same workload.

    python bench/run.py autograd [--quick] [--repeats N] [--json out.json]  (or bench/autograd_bench.py)

The workload is written once (``scenarios/_autograd_workers.py``) and run with either
``rpcdist.rpc`` / ``rpcdist.autograd`` / ``rpcdist.optim.DistributedOptimizer`` or
``torch.distributed.rpc`` (TensorPipe defaults) / ``torch.distributed.autograd`` /
``torch.distributed.optim.DistributedOptimizer``; only the imports differ.

  (a) parameter server, 3 processes: "ps" owns an MLP (64-128-10 by default: Linear, ReLU,
      Linear); "trainer1" and "trainer2" each run training steps on their own fixed random
      batches (32 x 64, class labels): in a distributed autograd context, ``rpc_sync`` the
      forward to the PS, cross-entropy loss locally, ``dist_autograd.backward``, then
      ``DistributedOptimizer(SGD).step`` (each trainer has its own, as in torch's PS tutorial;
      the owner serialises concurrent steps). The PS's forward computes with a clone of each
      weight (gradients reach the parameters through the clones): with the parameters
      themselves, one trainer's in-place SGD step invalidates the tensors the other's forward
      saved, and both systems' backward fail ("modified by an inplace operation"). After a
      warm-up both trainers start together at one instant and train for a fixed wall window;
      the number is the aggregate rate: both trainers' steps / (last trainer's end - common
      start).
  (b) distributed autograd overhead, 2 processes: "driver" holds stage 1 (Linear 64->128,
      ReLU) and "stage2" holds stage 2 (Linear 128->10), called with ``rpc_sync``.
      Per iteration, with distributed autograd: context, forward (stage 1, rpc_sync stage 2,
      loss), ``dist_autograd.backward``, ``get_gradients``, context exit; plain: the same
      forward under ``torch.no_grad()`` with no context and no backward. Both kinds run in
      short alternating blocks on the same group; the overhead is median(with) - median(plain).
      Before measuring, the driver checks that stage 1's distributed gradients equal those of
      the same model run locally.

A round is one group: one system, one scenario, fresh processes on 127.0.0.1 and a fresh
rendezvous on an ephemeral port, every process reaped before the next round starts, so the
two systems' processes are never alive at once (an idle TensorPipe process spins a core,
which would tax whoever is measured next). For each scenario the torch and rpcdist rounds
alternate and which goes first swaps every repetition. Processes fork from a forkserver that
imported torch once; every process uses one intra-op thread (as torchrun's OMP_NUM_THREADS=1)
and exits when the orchestrator dies, even by SIGKILL (a lifeline pipe).

Failures: a phase that raises is reported with the rank's traceback; one that overruns its
budget is a HANG, reported with all threads' stacks of every rank; either way the group is
killed and the run goes on (a scenario that hung is skipped in that system's later rounds).
Progress and tracebacks go to stderr, the table to stdout; ``--json`` also writes every
per-round number and every failure in full.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _harness as H
from _driver import Scenario, ratio
from _group import Follower, run_ranks
from _harness import log

from scenarios import _autograd_workers as W

WORLD = {"ps": 3, "ps4": 5, "pipeline": 2}  # processes per workload (ps4: the PS with 4 trainers)
PS_WORKLOADS = [workload for workload in WORLD if W.is_ps(workload)]
TARGET = 1.3  # rpcdist's PS training throughput, as a multiple of torch's, aimed for (issue 9)


class GroupFollower(Follower):
    """One workload's group: per-rank results; the trainers start measuring together."""

    def __init__(self, tag: str, cfg: dict[str, Any], workload: str, world: int | None = None) -> None:
        world = world or WORLD[workload]  # the workloads scenario runs PS groups of other sizes
        super().__init__(tag, cfg, [W.worker_name(workload, r) for r in range(world)])
        self.workload = workload
        self.out["results"] = self.reports  # phase -> rank -> result
        self.trainers = {r for r, name in enumerate(self.labels) if name.startswith("trainer")}
        self.ready: set[int] = set()

    def on_result(self, rank: int, phase: str, result: Any, now: float) -> None:
        if phase != "init":
            took = now - self.started[rank]
            log(f"  {self.tag} {self.labels[rank]:8s} {phase:10s} {summarize(phase, result)}  ({took:.1f} s)")

    def on_message(self, rank: int, msg: tuple[Any, ...]) -> None:
        if msg[0] != "ready":
            return
        self.ready.add(rank)
        self.where[rank] = "waiting for the other trainers"
        if self.ready == self.trainers:
            t0 = time.monotonic() + 0.05
            for r in self.trainers:
                self.conns[r].send(("go", t0, self.cfg["ps_window"]))

    def hang_phase(self, late: list[int]) -> str:
        # Name the hang after a working rank's phase if one is late (a server waiting in
        # shutdown is late only because of them).
        workers = [r for r in late if not W._serves(self.workload, r)] or late
        return self.where[workers[0]]


def summarize(phase: str, r: dict[str, Any]) -> str:
    if phase == "ps_train":
        return (
            f"{r['steps']} steps, {r['steps_per_s']:.1f} steps/s, "
            f"step median {r['step']['median_us'] / 1e3:.2f} ms, "
            f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
        )
    if phase == "pipeline":
        return (
            f"with dist autograd {r['autograd']['median_us']:.0f} µs, "
            f"plain {r['plain']['median_us']:.0f} µs, overhead {r['overhead_us']:.0f} µs"
        )
    if phase == "pipe_check":
        return f"gradients match the local model (max diff {r['max_grad_diff']:.1e})"
    if phase == "ps_setup":
        return f"{r['params']} parameter RRefs, {r['warmup_steps']} warm-up steps"
    return ""


def round_metrics(
    workload: str, results: dict[str, dict[int, Any]], cfg: dict[str, Any], world: int | None = None
) -> dict[str, float]:
    """The table's numbers from one group's per-rank results (``world``: its size, if not WORLD's)."""
    m: dict[str, float] = {}
    if W.is_ps(workload):
        per = results.get("ps_train", {})
        if len(per) == (world or WORLD[workload]) - 1:
            begin = min(r["start"] for r in per.values())
            end = max(r["end"] for r in per.values())
            m[f"{workload}_steps_per_s"] = sum(r["steps"] for r in per.values()) / (end - begin)
            m[f"{workload}_step_ms"] = statistics.fmean(r["step"]["median_us"] for r in per.values()) / 1e3
    else:
        r = results.get("pipeline", {}).get(0)
        if r is not None:
            m["pipe_autograd_us"] = r["autograd"]["median_us"]
            m["pipe_plain_us"] = r["plain"]["median_us"]
            m["pipe_overhead_us"] = r["overhead_us"]
    return m


class Autograd(Scenario):
    name = "autograd"
    doc = __doc__
    log_name = "autograd-bench"
    systems = ("torch", "rpcdist")
    part_keys = ("scenario",)  # the JSON's name for a workload ("ps", "pipeline")
    # ``torch.distributed.optim`` alone takes seconds to import
    preload = ("torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim")
    quick_help = "one round per system and scenario, short windows: < 90 s"
    repeats_help = "rounds per system and scenario (default 5; 1 with --quick)"
    systems_help = "comma-separated subset of torch,rpcdist (rows stay)"

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--window", type=float, default=None, help="seconds of PS training measured per round"
        )

    def make_config(self, quick: bool) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "dims": [64, 128, 10],
            "batch": 32,
            "n_batches": 8,
            "lr": 0.05,
            "seed": 0,
            "trainers": WORLD["ps"] - 1,
        }
        if quick:
            cfg.update(
                ps_warmup=20,
                ps_window=4.0,
                pipe_warmup=20,
                pipe_blocks=4,
                pipe_block_iters=50,
                phase_budget=30.0,
                init_budget=60.0,
                error_grace=5.0,
            )
        else:
            cfg.update(
                ps_warmup=50,
                ps_window=15.0,
                pipe_warmup=50,
                pipe_blocks=10,
                pipe_block_iters=100,
                phase_budget=120.0,
                init_budget=120.0,
                error_grace=10.0,
            )
        return cfg

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        if args.window is not None:
            cfg["ps_window"] = args.window
        # The server ranks wait in rpc.shutdown() while the others work: bound the whole group.
        cfg["serve_budget"] = cfg["init_budget"] + 3 * cfg["phase_budget"] + cfg["ps_window"]

    def parts(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"scenario": workload} for workload in WORLD]

    def part_label(self, part: dict[str, Any]) -> str:
        return part["scenario"]

    # ---- one round: one group of one system and workload ---------------------------------------
    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        workload = part["scenario"]
        if skip:
            return {
                "results": {},
                "errors": {"skipped": "skipped: this scenario hung in an earlier round"},
                "summaries": {},
                "hung": None,
                "metrics": {},
                "load": None,
            }
        follower = GroupFollower(f"{system:7s} {workload:8s}", cfg, workload)
        world = follower.world

        def args_of(rank: int, init: str, conn: Any, stack_file: str, life: Any) -> tuple[Any, ...]:
            return (system, workload, rank, world, init, cfg, conn, stack_file, life)

        names = [f"{system}-{label}" for label in follower.labels]
        prefix = f"agbench-{system}-{workload}-"
        g = run_ranks(self.context(), prefix, names, W.rank_main, args_of, follower)
        if not g["clean"]:  # a rank that died or stopped early skews the load figure
            g["load"] = None
        g["metrics"] = round_metrics(workload, g["results"], cfg)
        return g

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        def row(rid: str, workload: str, label: str, unit: str, better: str, **kw: Any) -> dict[str, Any]:
            return {"id": rid, "scenario": workload, "label": label, "unit": unit, "better": better, **kw}

        ps_rows = []
        for workload in PS_WORKLOADS:
            trainers = WORLD[workload] - 1
            ps_rows += [
                row(
                    f"{workload}_steps_per_s",
                    workload,
                    f"(a) PS training, {trainers} trainers: aggregate rate",
                    "steps/s",
                    "higher",
                    target=TARGET,
                ),
                row(
                    f"{workload}_step_ms",
                    workload,
                    f"(a) PS training, {trainers} trainers: time per step, per trainer",
                    "ms",
                    "lower",
                ),
            ]
        return [
            *ps_rows,
            row("pipe_autograd_us", "pipeline", "(b) 2-stage iteration with dist autograd", "µs", "lower"),
            row("pipe_plain_us", "pipeline", "(b) same forward, plain RPC, no autograd", "µs", "lower"),
            row(
                "pipe_overhead_us",
                "pipeline",
                "(b) distributed autograd overhead per iteration",
                "µs",
                "lower",
            ),
        ]

    def value(self, row: dict[str, Any], rnd: dict[str, Any]) -> float | None:
        return rnd["metrics"].get(row["id"])

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        errs = [e for e in rnd["errors"].values() if e]
        return H.problem(errs[0]) if errs else "LOST"

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        lines = [
            "rpcdist vs torch.distributed.rpc + torch.distributed.autograd + torch.distributed.optim."
            f"DistributedOptimizer (TensorPipe defaults), 127.0.0.1: medians over {meta['repeats']} "
            f"interleaved round(s) per system and scenario{quick}",
        ]
        for workload in PS_WORKLOADS:
            head = agg.get(f"{workload}_steps_per_s")
            got = ratio(head["rpcdist"]["median"], head["torch"]["median"]) if head else None
            met = "-" if got is None else ("yes" if got >= TARGET else "NO")
            lines.append(
                f"target: rpcdist's PS training throughput with {WORLD[workload] - 1} trainers at least "
                f"{TARGET:.1f}x torch's -> {f'{got:.2f}x' if got is not None else 'no number'}, met: {met}"
            )
        return lines

    def notes(self, meta: dict[str, Any]) -> list[str]:
        cfg = meta["cfg"]
        arch = "-".join(str(d) for d in cfg["dims"])
        return [
            f"(a) ps + 2 trainers, and ps + 4 trainers; MLP {arch} on the PS, batch {cfg['batch']}, "
            f"SGD lr {cfg['lr']}; a step = context, rpc_sync forward, cross-entropy, dist_autograd.backward, "
            f"DistributedOptimizer.step;",
            f"    all trainers train for one {cfg['ps_window']:g} s window after {cfg['ps_warmup']} warm-up "
            "steps each; aggregate = all steps / (last end - common start).",
            f"(b) 2 processes; stage 1 Linear {cfg['dims'][0]}-{cfg['dims'][1]} + ReLU local, stage 2 Linear "
            f"{cfg['dims'][1]}-{cfg['dims'][2]} remote (rpc_sync), batch {cfg['batch']}; "
            "with dist autograd = context + forward + backward + get_gradients;",
            "    plain = the same forward under torch.no_grad(), no context; "
            f"overhead = median(with) - median(plain), {cfg['pipe_blocks']} alternating blocks "
            f"of {cfg['pipe_block_iters']} iterations each.",
            "rpcdist/torch is the ratio of the medians; 'better when' says which direction favours rpcdist. "
            "One intra-op torch thread per process. * = some rounds failed; ERR / HANG / SKIP / LOST = no "
            "round succeeded (see failures below).",
        ]


SCENARIO = Autograd()
