"""DistributedDataParallel training step time over the "rpcdist" backend vs gloo, side by side.

    python bench/run.py ddp [--quick] [--repeats N] [--worlds 2,4] [--models mlp,cnn] [--json out.json]

The same torch DDP (default buckets) trains the same models on the same data; only the backend
of ``torch.distributed.init_process_group`` differs ("gloo", or "rpcdist": rpcdist's
collectives, registered by ``import rpcdist``). A round is one DDP job of one system and one
world size (2 or 4 ranks) on 127.0.0.1, fresh processes and rendezvous (ephemeral port), one
torch thread per rank; the systems' rounds alternate and which goes first swaps every
repetition, as in the c10d scenario (whose round machinery this one reuses).

Models (float32, SGD with momentum, each rank its own fixed batch):
  mlp   784-2048-2048-10, batch 64: 5.8 M parameters, 23 MB of gradients all-reduced per step
  cnn   2 conv blocks + 2 dense layers on 3x32x32, batch 32: 1.1 M parameters
A step is zero_grad, forward, backward (DDP all-reduces the gradient buckets while the
backward pass runs) and optimizer step; its time is the slowest rank's, the table shows the
median over steps, then over rounds. After the timed steps the ranks check that their
parameters still agree. --quick: one round, fewer steps.
"""

from __future__ import annotations

import argparse
from typing import Any

from _group import run_ranks

from scenarios import _ddp_workers as W
from scenarios.c10d import C10d, GroupFollower

TARGET = 1.0  # rpcdist/gloo step time aimed for
LABELS = {
    "mlp": "MLP 784-2048-2048-10 (5.8 M params), batch 64",
    "cnn": "CNN 2 conv + 2 dense (1.1 M params), batch 32",
}


class Ddp(C10d):
    name = "ddp"
    doc = __doc__
    log_name = "ddp-bench"
    preload = ("torch", "torch.distributed", "torch.nn")
    quick_help = "one round, 3 warm-up and 10 timed steps per model: ~2 minutes"
    repeats_help = "rounds per system and world (default 5; 1 with --quick)"
    label_width = 58

    def make_config(self, quick: bool) -> dict[str, Any]:
        common = {"worlds": [2, 4], "models": list(W.MODELS), "error_grace": 5.0, "op_timeout": 120.0}
        if quick:
            return {
                **common,
                "warmup_steps": 3,
                "steps": 10,
                "phase_budget": 90.0,
                "init_budget": 90.0,
                "max_groups": 4,
            }
        return {
            **common,
            "warmup_steps": 5,
            "steps": 30,
            "phase_budget": 240.0,
            "init_budget": 120.0,
            "max_groups": 6,
        }

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        super().add_args(ap)
        ap.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(W.MODELS)}")

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        super().apply_args(cfg, args, ap)
        if args.models:
            cfg["models"] = [m for m in args.models.split(",") if m]
            unknown = set(cfg["models"]) - set(W.MODELS)
            if unknown:
                ap.error(f"unknown model(s) {sorted(unknown)}: choose from {','.join(W.MODELS)}")

    def group_phases(self, cfg: dict[str, Any], world: int) -> list[tuple[str, str, int]]:
        return [(model, model, 0) for model in cfg["models"]]

    def run_group(
        self, system: str, world: int, phases: list[tuple[str, str, int]], cfg: dict[str, Any]
    ) -> dict[str, Any]:
        order = ["init"] + [p[0] for p in phases] + ["shutdown"]
        follower = GroupFollower(f"{system:7s} w{world}", cfg, world, order)

        def args_of(rank: int, init: str, conn: Any, stack_file: str, life: Any) -> tuple[Any, ...]:
            return (system, rank, world, init, phases, cfg, conn, stack_file, life)

        names = [f"{system}-w{world}-rank{r}" for r in range(world)]
        return run_ranks(
            self.context(), f"ddpbench-{system}-w{world}-", names, W.rank_main, args_of, follower
        )

    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "id": f"{model}_w{world}",
                "phase": model,
                "key": "median_us",
                "world": world,
                "label": f"{LABELS[model]}, {world} ranks",
                "unit": "ms",
                "size": 0,
                "target": TARGET,
            }
            for model in cfg["models"]
            for world in cfg["worlds"]
        ]

    def header(self) -> list[str]:
        return ["DDP training step", *super().header()[1:]]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        return [
            "DDP over rpcdist vs gloo (torch.distributed backends, same torch DDP) on 127.0.0.1, float32; "
            f"medians over {meta['repeats']} interleaved round(s) per system and world size{quick}",
            f"target: a training step within {TARGET:g}x gloo's time",
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        cfg = meta["cfg"]
        return [
            f"a step: zero_grad, forward, backward with DDP's bucketed all-reduce, SGD step; its time is the "
            f"slowest rank's, median over {cfg['steps']} steps after {cfg['warmup_steps']} warm-up steps;",
            "one intra-op torch thread per rank (as torchrun's OMP_NUM_THREADS=1). "
            "* = some rounds failed; ERR / HANG / SKIP / LOST = no round succeeded (see failures below).",
        ]


SCENARIO = Ddp()
