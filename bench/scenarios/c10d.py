"""rpcdist's c10d collectives and send/recv vs torch.distributed with gloo, side by side.

    python bench/run.py c10d [--quick] [--repeats N] [--json out.json]    (or bench/c10d_bench.py)

A round is one process group of one system (gloo or rpcdist) and one world size (2 or 4) on
127.0.0.1: fresh processes, a fresh rendezvous on an ephemeral port, every phase measured,
the group destroyed and every process reaped before the next round starts, so the two
systems' processes are never alive at once. For each world size the gloo and rpcdist rounds
alternate, and which goes first swaps every repetition, so drift on this noisy machine lands
on both. Processes fork from a forkserver that imported torch once (saves seconds of
``import torch`` per process); rpcdist and gloo are imported in the ranks only. Every rank
exits when the orchestrator dies, even by SIGKILL (a lifeline pipe).

Measured per round, all float32 (MB = 2^20 bytes), after warm-up; each phase's number is the
median over several back-to-back calls of the slowest rank's call time, the table shows the
median over rounds:
  send/recv 1, 16, 64 MB from rank 0 to rank 1 (world 2), as MB/s
  all_reduce SUM of 4 KB, 1 MB, 16 MB, 64 MB (world 2 and 4)
  broadcast 16 MB from rank 0 (world 2 and 4)
  barrier (world 2 and 4)
--quick: one round, 4 KB and 1 MB only (all_reduce 4 KB / 1 MB, broadcast and send/recv 1 MB).

Failures: a phase that raises on any rank is reported with every rank's traceback; one that
overruns its budget is reported as a HANG with all threads' stacks of every rank. Either way
the group is killed and a fresh group of the same system runs the phases left, so one
failure costs one measurement, not the run; a phase that hung is skipped in later rounds of
that system and world size. Progress and tracebacks go to stderr, the table to stdout;
``--json`` also writes every per-round number and every failure in full.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _harness as H
from _driver import Scenario
from _group import Follower, run_ranks
from _harness import KiB, MiB, log

from scenarios import _c10d_workers as W

LARGE_TARGET, SMALL_TARGET = 1.5, 3.0  # rpcdist/gloo time ratios aimed for


def size_text(size: int) -> str:
    return f"{size // MiB} MB" if size >= MiB else f"{size // KiB} KB"


class GroupFollower(Follower):
    """A c10d group: the ranks run the same phases in order; a phase's number combines all ranks."""

    def __init__(self, tag: str, cfg: dict[str, Any], world: int, order: list[str]) -> None:
        super().__init__(tag, cfg, [f"rank {r}" for r in range(world)])
        self.order = order

    def on_result(self, rank: int, phase: str, result: Any, now: float) -> None:
        per_rank = self.reports[phase]
        if len(per_rank) == self.world and phase != "init":
            res = self.out["results"][phase] = combine(per_rank, self.world)
            log(
                f"  {self.tag} {phase:20s} {summarize(res)}  ({now - self.first_start.get(phase, now):.1f} s)"
            )

    def next_phase(self, phase: str) -> str:
        i = self.order.index(phase) if phase in self.order else len(self.order)
        return self.order[min(i + 1, len(self.order) - 1)]

    def hang_phase(self, late: list[int]) -> str:
        """The earliest phase some rank has not finished: where the group is stuck."""
        for phase in self.order:
            if len(self.reports.get(phase, {})) < self.world:
                return phase
        return self.order[-1]

    def settled(self, rank: int, phase: str) -> bool:
        return super().settled(rank, phase) or rank in self.reports.get(phase, {})

    def measures_load(self, rank: int) -> bool:
        return rank == 0


def combine(per_rank: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """Per iteration, the slowest rank's time; then median / p10 / p90 over iterations (µs)."""
    series = [per_rank[r]["samples_ns"] for r in range(world)]
    n = min(len(s) for s in series)
    slowest = [max(s[i] for s in series) for i in range(n)]
    return {
        **H.percentiles_us(slowest),
        "n": n,
        "rank_median_us": [per_rank[r]["median_us"] for r in range(world)],
    }


def summarize(r: dict[str, Any]) -> str:
    per_rank = " ".join(f"{v:.0f}" for v in r["rank_median_us"])
    return (
        f"median {r['median_us']:.0f} µs  p10 {r['p10_us']:.0f}  p90 {r['p90_us']:.0f}  "
        f"(n={r['n']}; per-rank medians {per_rank})"
    )


class C10d(Scenario):
    name = "c10d"
    doc = __doc__
    log_name = "c10d-bench"
    systems = ("gloo", "rpcdist")
    peer = "gloo"
    part_keys = ("world",)
    preload = ("torch", "torch.distributed")
    quick_help = "one round, 4 KB and 1 MB only: ~1 minute"
    repeats_help = "rounds per system and world (default 5; 1 with --quick)"
    systems_help = "comma-separated subset of gloo,rpcdist (rows stay)"
    label_width = 44
    right = {2, 3, 4, 5}
    failures_heading = "failures (every rank's traceback, and stacks for hangs, on stderr and in --json):"

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4)")

    def make_config(self, quick: bool) -> dict[str, Any]:
        if quick:
            return {
                "worlds": [2, 4],
                "send_recv_sizes": [1 * MiB],
                "all_reduce_sizes": [4 * KiB, 1 * MiB],
                "broadcast_sizes": [1 * MiB],
                # (warm-up calls, timed calls)
                "iters_small": (10, 50),
                "iters_1m": (3, 10),
                "iters_16m": (2, 5),
                "iters_64m": (1, 3),
                "phase_budget": 30.0,
                "init_budget": 60.0,
                "error_grace": 5.0,
                "op_timeout": 120.0,
                "max_groups": 6,
            }
        return {
            "worlds": [2, 4],
            "send_recv_sizes": [1 * MiB, 16 * MiB, 64 * MiB],
            "all_reduce_sizes": [4 * KiB, 1 * MiB, 16 * MiB, 64 * MiB],
            "broadcast_sizes": [16 * MiB],
            "iters_small": (20, 200),
            "iters_1m": (5, 40),
            "iters_16m": (3, 10),
            "iters_64m": (2, 7),
            "phase_budget": 120.0,
            "init_budget": 120.0,
            "error_grace": 10.0,
            "op_timeout": 300.0,
            "max_groups": 8,
        }

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        if args.worlds:
            cfg["worlds"] = [int(w) for w in args.worlds.split(",") if w]
            if any(w < 2 for w in cfg["worlds"]):
                ap.error("world sizes must be >= 2")

    def parts(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"world": w} for w in cfg["worlds"]]

    # ---- one round: one system, one world size, every phase (in fresh groups after a failure) ---
    def group_phases(self, cfg: dict[str, Any], world: int) -> list[tuple[str, str, int]]:
        """The phases one group runs, in order: (name, kind, bytes)."""
        out = [("barrier", "barrier", 0)]
        out += [(W.phase_name("all_reduce", s), "all_reduce", s) for s in cfg["all_reduce_sizes"]]
        out += [(W.phase_name("broadcast", s), "broadcast", s) for s in cfg["broadcast_sizes"]]
        if world == 2:
            out += [(W.phase_name("send_recv", s), "send_recv", s) for s in cfg["send_recv_sizes"]]
        return out

    def run_group(
        self, system: str, world: int, phases: list[tuple[str, str, int]], cfg: dict[str, Any]
    ) -> dict[str, Any]:
        """Start ``world`` ranks of ``system``, follow them through ``phases`` and reap them."""
        order = ["init"] + [p[0] for p in phases] + ["shutdown"]
        follower = GroupFollower(f"{system:7s} w{world}", cfg, world, order)

        def args_of(rank: int, init: str, conn: Any, stack_file: str, life: Any) -> tuple[Any, ...]:
            return (system, rank, world, init, phases, cfg, conn, stack_file, life)

        names = [f"{system}-w{world}-rank{r}" for r in range(world)]
        return run_ranks(
            self.context(), f"c10dbench-{system}-w{world}-", names, W.rank_main, args_of, follower
        )

    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        world = part["world"]
        out: dict[str, Any] = {
            "results": {},
            "errors": {},
            "summaries": {},
            "hung": [],
            "groups": [],
            "load": None,
        }
        remaining = []
        for ph in self.group_phases(cfg, world):
            if ph[0] in skip:
                out["errors"][ph[0]] = "skipped: this phase hung in an earlier round"
            else:
                remaining.append(ph)
        init_failures = 0
        foreign = steal = wall = 0.0
        while remaining:
            if len(out["groups"]) >= cfg["max_groups"]:
                for ph in remaining:
                    out["errors"].setdefault(
                        ph[0], f"LOST: not run, {cfg['max_groups']} groups failed already"
                    )
                break
            if out["groups"]:
                log(f"  {system:7s} w{world} fresh group for the {len(remaining)} phase(s) left")
            t0 = time.monotonic()
            g = self.run_group(system, world, remaining, cfg)
            stop = g["stop"]
            out["groups"].append(
                {
                    "phases": [p[0] for p in remaining],
                    "stop": stop,
                    "hung": bool(g["hung"]),
                    "clean": g["clean"],
                    "seconds": time.monotonic() - t0,
                    "exitcodes": g["exitcodes"],
                }
            )
            out["results"].update(g["results"])
            out["errors"].update(g["errors"])
            out["summaries"].update(g["summaries"])
            if g.get("load"):
                foreign += g["load"]["foreign_core_s"]
                steal += g["load"]["steal_core_s"]
                wall += g["load"]["seconds"]
            if stop is None or stop == "shutdown":
                break
            if stop in ("init", "orchestrator"):
                init_failures += 1
                if stop == "orchestrator" or init_failures >= 2:
                    for ph in remaining:
                        out["errors"].setdefault(ph[0], f"LOST: the group could not start ({stop} failed)")
                    break
                continue  # e.g. the ephemeral port was taken: try once more
            if g["hung"]:
                out["hung"].append(stop)
            names = [p[0] for p in remaining]
            cut = names.index(stop) + 1 if stop in names else len(names)
            remaining = [p for p in remaining[cut:] if p[0] not in out["results"]]
            time.sleep(0.5)
        if wall > 0:
            out["load"] = {"foreign_cores": foreign / wall, "steal_cores": steal / wall, "seconds": wall}
        return out

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        rows = []

        def add(phase: str, world: int, label: str, size: int) -> None:
            small = phase == "barrier" or size < 256 * KiB
            unit = "MB/s" if phase.startswith("send_recv") else "µs" if small else "ms"
            target = SMALL_TARGET if small else LARGE_TARGET
            rows.append(
                {
                    "id": f"{phase}_w{world}",
                    "phase": phase,
                    "key": "median_us",
                    "world": world,
                    "label": label,
                    "unit": unit,
                    "size": size,
                    "target": target,
                }
            )

        if 2 in cfg["worlds"]:
            for s in cfg["send_recv_sizes"]:
                add(W.phase_name("send_recv", s), 2, f"send/recv {size_text(s)}, rank 0 -> 1, world 2", s)
        for w in cfg["worlds"]:
            for s in cfg["all_reduce_sizes"]:
                add(W.phase_name("all_reduce", s), w, f"all_reduce SUM {size_text(s)}, world {w}", s)
        for w in cfg["worlds"]:
            for s in cfg["broadcast_sizes"]:
                add(W.phase_name("broadcast", s), w, f"broadcast {size_text(s)} from rank 0, world {w}", s)
        for w in cfg["worlds"]:
            add("barrier", w, f"barrier, world {w}", 0)
        return rows

    @staticmethod
    def in_unit(row: dict[str, Any], median_us: float) -> float:
        """A median call time in the row's unit."""
        if row["unit"] == "MB/s":
            return (row["size"] / MiB) / (median_us / 1e6)
        return median_us / 1e3 if row["unit"] == "ms" else median_us

    def cell(self, row: dict[str, Any], values: list[float], problems: list[str]) -> dict[str, Any]:
        """``values`` are call times (µs): the table shows them in the row's unit."""
        med = statistics.median(values) if values else None
        return {
            "times_us": values,
            "values": [self.in_unit(row, t) for t in values],
            "median_us": med,
            "median": self.in_unit(row, med) if med is not None else None,
            "problems": problems,
        }

    def header(self) -> list[str]:
        return ["metric", "unit", "gloo", "rpcdist", "rpcdist/gloo time", "target", "met", "better"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        g, r = a["gloo"], a["rpcdist"]
        ratio = r["median_us"] / g["median_us"] if r["median_us"] is not None and g["median_us"] else None
        met = "-" if ratio is None else "yes" if ratio <= row["target"] else "NO"
        if ratio is None:
            better = "-"
        elif 0.95 <= ratio <= 1.05:
            better = "about equal"
        else:
            better = f"rpcdist {1 / ratio:.2f}x faster" if ratio < 1 else f"gloo {ratio:.2f}x faster"
        return [
            row["label"],
            row["unit"],
            self.fmt(g["median"], row, g["problems"]),
            self.fmt(r["median"], row, r["problems"]),
            f"{ratio:.2f}x" if ratio is not None else "-",
            f"<= {row['target']:g}x",
            met,
            better,
        ]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        return [
            "rpcdist vs gloo (torch.distributed, backend gloo): c10d collectives on 127.0.0.1, float32; "
            f"medians over {meta['repeats']} interleaved round(s) per system and world size{quick}",
            f"targets: send/recv, all_reduce and broadcast of >= 1 MB within {LARGE_TARGET:g}x gloo's time; "
            f"small-message latency (4 KB all_reduce, barrier) within {SMALL_TARGET:g}x",
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        return [
            "rpcdist/gloo time: ratio of the median call times, lower is better for rpcdist (for send/recv, "
            "gloo MB/s / rpcdist MB/s). MB = 2^20 bytes. A call's time is the slowest rank's, "
            "back to back after warm-up;",
            "one intra-op torch thread per rank (as torchrun's OMP_NUM_THREADS=1). "
            "* = some rounds failed; ERR / HANG / SKIP / LOST = no round succeeded (see failures below).",
        ]


SCENARIO = C10d()
