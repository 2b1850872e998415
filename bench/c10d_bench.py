#!/usr/bin/env python
"""rpcdist's c10d collectives and send/recv vs torch.distributed with gloo, side by side.

    python bench/c10d_bench.py [--quick] [--repeats N] [--json out.json]

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
import multiprocessing.connection as mpc
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:  # children get this sys.path too, so they import these modules
    sys.path.insert(0, BENCH_DIR)

import _c10d_workers as W  # noqa: E402
import _harness as H  # noqa: E402
from _harness import KiB, MiB, free_port, load_delta, load_snapshot, log, reap, start  # noqa: E402

SYSTEMS = ("gloo", "rpcdist")
LARGE_TARGET, SMALL_TARGET = 1.5, 3.0  # rpcdist/gloo time ratios aimed for
H.set_name("c10d-bench")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def make_config(quick: bool) -> dict[str, Any]:
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


def group_phases(cfg: dict[str, Any], world: int) -> list[tuple[str, str, int]]:
    """The phases one group runs, in order: (name, kind, bytes)."""
    out = [("barrier", "barrier", 0)]
    out += [(W.phase_name("all_reduce", s), "all_reduce", s) for s in cfg["all_reduce_sizes"]]
    out += [(W.phase_name("broadcast", s), "broadcast", s) for s in cfg["broadcast_sizes"]]
    if world == 2:
        out += [(W.phase_name("send_recv", s), "send_recv", s) for s in cfg["send_recv_sizes"]]
    return out


def size_text(size: int) -> str:
    return f"{size // MiB} MB" if size >= MiB else f"{size // KiB} KB"


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
def dump_stacks(procs: list[Any], stack_files: list[str], ranks: list[int] | None = None) -> str:
    """SIGUSR1 live ranks (faulthandler writes all threads' stacks), then read them."""
    ranks = list(range(len(procs))) if ranks is None else ranks
    return H.dump_stacks([procs[r] for r in ranks], {f"rank {r}": stack_files[r] for r in ranks})


def _context() -> Any:
    """A forkserver that has imported torch (nothing else: no thread, no gRPC state)."""
    return H.forkserver(["torch", "torch.distributed"])


# ------------------------------------------------------------------------------------------------
# one process group
# ------------------------------------------------------------------------------------------------
def run_group(
    system: str, world: int, phases: list[tuple[str, str, int]], cfg: dict[str, Any]
) -> dict[str, Any]:
    """Start ``world`` ranks of ``system``, follow them through ``phases`` and reap them.

    Returns the phases every rank finished (combined numbers), the errors per phase, and
    ``stop``: the phase that failed or hung (None if the group ran to the end)."""
    ctx = _context()
    order = ["init"] + [p[0] for p in phases] + ["shutdown"]
    out: dict[str, Any] = {
        "results": {},
        "errors": {},
        "summaries": {},  # phase -> one line per failing rank
        "stop": None,
        "hung": False,
        "clean": False,
    }
    procs: list[Any] = []
    conns: dict[Any, int] = {}
    with tempfile.TemporaryDirectory(prefix=f"c10dbench-{system}-w{world}-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        life_r, life_w = ctx.Pipe(duplex=False)  # only this process holds life_w
        try:
            init = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(world):
                parent, child = ctx.Pipe()
                p = start(
                    ctx,
                    f"{system}-w{world}-rank{rank}",
                    W.rank_main,
                    (system, rank, world, init, phases, cfg, child, stack_files[rank], life_r),
                )
                child.close()
                procs.append(p)
                conns[parent] = rank
            drive(system, world, order, procs, conns, out, cfg, stack_files)
        except BaseException as exc:
            out["errors"].setdefault("orchestrator", traceback.format_exc())
            out["summaries"].setdefault("orchestrator", f"{type(exc).__name__}: {exc}")
            out["stop"] = out["stop"] or "orchestrator"
            if not isinstance(exc, Exception):
                raise
        finally:
            for c in conns:  # a rank waiting after a failure: stop now
                try:
                    c.send(("stop",))
                except (OSError, ValueError):
                    pass
            reap(procs, 30.0 if out["clean"] else 3.0)
            out["exitcodes"] = {p.name: p.exitcode for p in procs}
            for c in conns:
                c.close()
            life_r.close()
            life_w.close()
    return out


def drive(
    system: str,
    world: int,
    order: list[str],
    procs: list[Any],
    conns: dict[Any, int],
    out: dict[str, Any],
    cfg: dict[str, Any],
    stack_files: list[str],
) -> None:
    """Follow every rank until all are done, one fails (plus a grace period for the others to
    report), one dies, or one overruns its phase's budget."""
    now = time.monotonic()
    where = ["init"] * world  # each rank's current phase
    deadline = [now + cfg["init_budget"]] * world
    started = [now] * world
    done = [False] * world
    gone = [False] * world
    reports: dict[str, dict[int, Any]] = {}  # phase -> rank -> result dict
    errors: dict[str, dict[int, str]] = {}
    failed_at: tuple[str, float] | None = None
    load_start: dict[str, float] | None = None
    first_start: dict[str, float] = {}  # phase -> when its first rank started it
    pids = [p.pid for p in procs]

    def index(phase: str) -> int:
        return order.index(phase) if phase in order else len(order)

    def first_incomplete() -> str:
        """The earliest phase some rank has not finished: where the group is stuck."""
        for phase in order:
            if len(reports.get(phase, {})) < world:
                return phase
        return order[-1]

    def finish(stop: str) -> None:
        out["stop"] = stop
        for phase, per_rank in errors.items():
            text = "\n".join(f"rank {r}: {tb.rstrip()}" for r, tb in sorted(per_rank.items()))
            out["errors"][phase] = text
            out["summaries"][phase] = "; ".join(
                f"rank {r}: {last_line(tb)}" for r, tb in sorted(per_rank.items())
            )

    while True:
        for c in mpc.wait([c for c, r in conns.items() if not gone[r]], timeout=0.2):
            rank = conns[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                gone[rank] = True
                if not done[rank]:
                    errors.setdefault(where[rank], {}).setdefault(
                        rank,
                        f"the rank's process went away during phase {where[rank]!r} "
                        f"(exit code {procs[rank].exitcode})",
                    )
                continue
            kind = msg[0]
            now = time.monotonic()
            if kind == "phase":
                where[rank], deadline[rank], started[rank] = msg[1], now + msg[2], now
                first_start.setdefault(msg[1], now)
                if load_start is None and msg[1] not in ("init",):
                    load_start = load_snapshot(pids)
            elif kind == "result":
                reports.setdefault(msg[1], {})[rank] = msg[2]
                nxt = order[min(index(msg[1]) + 1, len(order) - 1)]
                where[rank], deadline[rank], started[rank] = nxt, now + cfg["phase_budget"], now
                if len(reports[msg[1]]) == world and msg[1] != "init":
                    out["results"][msg[1]] = combine(reports[msg[1]], world)
                    log(
                        f"  {system:7s} w{world} {msg[1]:20s} {summarize(out['results'][msg[1]])}"
                        f"  ({now - first_start.get(msg[1], now):.1f} s)"
                    )
            elif kind == "error":
                errors.setdefault(msg[1], {})[rank] = msg[2]
                where[rank] = msg[1]
                lines = msg[2].strip().splitlines()
                log(
                    f"  {system:7s} w{world} {msg[1]:20s} FAILED on rank {rank}: {lines[-1] if lines else ''}"
                )
                if failed_at is None:
                    failed_at = (msg[1], now)
            elif kind == "measured":
                if rank == 0 and load_start is not None:
                    out["load"] = load_delta(load_start, load_snapshot(pids))
            elif kind == "done":
                done[rank] = True

        now = time.monotonic()
        if all(done):
            out["clean"] = True
            finish(None)
            return
        if failed_at is not None:
            phase, t_fail = failed_at
            settled = all(
                gone[r] or r in errors.get(phase, {}) or r in reports.get(phase, {}) for r in range(world)
            )
            if settled or now > t_fail + cfg["error_grace"]:
                finish(phase)  # the phases after it run in a fresh group
                silent = [
                    r
                    for r in range(world)
                    if not gone[r] and r not in errors.get(phase, {}) and r not in reports.get(phase, {})
                ]
                if silent:  # ranks still inside the failed phase: show where they wait
                    waiting = ", ".join(f"rank {r} in {where[r]!r}" for r in silent)
                    stacks = dump_stacks(procs, stack_files, silent)
                    out["errors"][phase] += (
                        f"\nstill running {cfg['error_grace']:g} s after the first error: {waiting}\n{stacks}"
                    )
                return
            continue
        late = [r for r in range(world) if not done[r] and not gone[r] and now > deadline[r]]
        if late:
            stuck = first_incomplete()
            stacks = dump_stacks(procs, stack_files)
            waiting = ", ".join(
                f"rank {r} in {where[r]!r} for {now - started[r]:.0f} s" for r in range(world)
            )
            errors.setdefault(stuck, {})
            text = f"HANG: phase {stuck!r} did not finish within its budget ({waiting})\n{stacks}"
            finish(stuck)
            out["errors"][stuck] = text + ("\n" + out["errors"][stuck] if out["errors"].get(stuck) else "")
            out["summaries"][stuck] = text.splitlines()[0]
            out["hung"] = True
            log(f"  {system:7s} w{world} HANG in phase {stuck!r} ({waiting}); stacks:\n{stacks}")
            return
        dead = [r for r in range(world) if not done[r] and (gone[r] or procs[r].exitcode not in (None, 0))]
        if dead:
            # let the others report what they saw first
            for c, r in conns.items():
                while not gone[r] and c.poll(0.2):
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        gone[r] = True
                        break
                    if msg[0] == "error":
                        errors.setdefault(msg[1], {})[r] = msg[2]
            stuck = first_incomplete()
            for r in dead:
                errors.setdefault(stuck, {}).setdefault(
                    r, f"rank {r}'s process died during phase {where[r]!r} (exit code {procs[r].exitcode})"
                )
            log(f"  {system:7s} w{world} rank(s) {dead} died during phase {stuck!r}")
            finish(stuck)
            return


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


# ------------------------------------------------------------------------------------------------
# one round: one system, one world size, every phase (in fresh groups after a failure)
# ------------------------------------------------------------------------------------------------
def run_round(system: str, world: int, cfg: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    phases = group_phases(cfg, world)
    out: dict[str, Any] = {
        "results": {},
        "errors": {},
        "summaries": {},
        "hung": [],
        "groups": [],
        "load": None,
    }
    remaining = []
    for ph in phases:
        if ph[0] in skip:
            out["errors"][ph[0]] = "skipped: this phase hung in an earlier round"
        else:
            remaining.append(ph)
    init_failures = 0
    foreign = steal = wall = 0.0
    while remaining:
        if len(out["groups"]) >= cfg["max_groups"]:
            for ph in remaining:
                out["errors"].setdefault(ph[0], f"LOST: not run, {cfg['max_groups']} groups failed already")
            break
        if out["groups"]:
            log(f"  {system:7s} w{world} fresh group for the {len(remaining)} phase(s) left")
        t0 = time.monotonic()
        g = run_group(system, world, remaining, cfg)
        out["groups"].append(
            {
                "phases": [p[0] for p in remaining],
                "stop": g["stop"],
                "hung": g["hung"],
                "clean": g["clean"],
                "seconds": time.monotonic() - t0,
                "exitcodes": g["exitcodes"],
            }
        )
        out["results"].update(g["results"])
        for phase, err in g["errors"].items():
            out["errors"][phase] = err
        out["summaries"].update(g["summaries"])
        if g.get("load"):
            foreign += g["load"]["foreign_core_s"]
            steal += g["load"]["steal_core_s"]
            wall += g["load"]["seconds"]
        stop = g["stop"]
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


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def metric_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []

    def add(phase: str, world: int, label: str, size: int) -> None:
        small = phase == "barrier" or size < 256 * KiB
        if phase.startswith("send_recv"):
            unit = "MB/s"
        elif small:
            unit = "µs"
        else:
            unit = "ms"
        rows.append(
            {
                "id": f"{phase}_w{world}",
                "phase": phase,
                "world": world,
                "label": label,
                "unit": unit,
                "size": size,
                "target": SMALL_TARGET if small else LARGE_TARGET,
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


def row_value(row: dict[str, Any], median_us: float) -> float:
    """A round's median call time in the row's unit."""
    if row["unit"] == "MB/s":
        return (row["size"] / MiB) / (median_us / 1e6)
    if row["unit"] == "ms":
        return median_us / 1e3
    return median_us


def collect(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row and system: per-round times (run order), their median, and why rounds lack one."""
    agg: dict[str, dict[str, Any]] = {}
    for row in rows:
        agg[row["id"]] = {}
        for system in SYSTEMS:
            times, problems = [], []
            for rnd in rounds:
                if rnd["system"] != system or rnd["world"] != row["world"]:
                    continue
                res = rnd["results"].get(row["phase"])
                if res is not None:
                    times.append(res["median_us"])
                    continue
                problems.append(H.problem(rnd["errors"].get(row["phase"], "")))
            med = statistics.median(times) if times else None
            agg[row["id"]][system] = {
                "times_us": times,
                "values": [row_value(row, t) for t in times],
                "median_us": med,
                "median": row_value(row, med) if med is not None else None,
                "problems": problems,
            }
    return agg


def fmt(v: float | None, problems: list[str] | None = None) -> str:
    if v is None:
        return problems[0] if problems else "-"
    if v >= 100:
        s = f"{v:,.0f}"
    elif v >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return s + ("*" if problems else "")


def better(r: float | None) -> str:
    if r is None:
        return "-"
    if 0.95 <= r <= 1.05:
        return "about equal"
    return f"rpcdist {1 / r:.2f}x faster" if r < 1 else f"gloo {r:.2f}x faster"


def render(
    rows: list[dict[str, Any]],
    agg: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    rounds: list[dict[str, Any]],
) -> str:
    header = ["metric", "unit", "gloo", "rpcdist", "rpcdist/gloo time", "target", "met", "better"]
    table = []
    for row in rows:
        a = agg[row["id"]]
        g, r = a["gloo"], a["rpcdist"]
        ratio = (
            r["median_us"] / g["median_us"]
            if r["median_us"] is not None and g["median_us"] not in (None, 0)
            else None
        )
        met = "-" if ratio is None else "yes" if ratio <= row["target"] else "NO"
        table.append(
            [
                row["label"],
                row["unit"],
                fmt(g["median"], g["problems"]),
                fmt(r["median"], r["problems"]),
                f"{ratio:.2f}x" if ratio is not None else "-",
                f"<= {row['target']:g}x",
                met,
                better(ratio),
            ]
        )
    quick = " (--quick)" if meta["quick"] else ""
    out = [
        f"rpcdist vs gloo (torch.distributed, backend gloo): c10d collectives on 127.0.0.1, float32; "
        f"medians over {meta['repeats']} interleaved round(s) per system and world size{quick}",
        f"targets: send/recv, all_reduce and broadcast of >= 1 MB within {LARGE_TARGET:g}x gloo's time; "
        f"small-message latency (4 KB all_reduce, barrier) within {SMALL_TARGET:g}x",
        *H.table_lines(header, table, right={2, 3, 4, 5}),
    ]
    out.append("")
    out.append(
        "rpcdist/gloo time: ratio of the median call times, lower is better for rpcdist (for send/recv, "
        "gloo MB/s / rpcdist MB/s). MB = 2^20 bytes. A call's time is the slowest rank's, "
        "back to back after warm-up;"
    )
    out.append(
        "one intra-op torch thread per rank (as torchrun's OMP_NUM_THREADS=1). "
        "* = some rounds failed; ERR / HANG / SKIP / LOST = no round succeeded (see failures below)."
    )
    out.append("")
    out.append("per-round values, in run order:")
    for row in rows:
        a = agg[row["id"]]
        parts = []
        for system in SYSTEMS:
            texts = [fmt(v) for v in a[system]["values"]]
            parts.append(H.round_values(system, texts, a[system]["problems"]))
        out.append(f"  {row['label']:<44s} {' | '.join(parts)}")
    for w in meta["cfg"]["worlds"]:
        parts = []
        for system in SYSTEMS:
            loads = H.round_loads([r for r in rounds if r["system"] == system and r["world"] == w])
            if loads:
                parts.append(f"{system}: {' '.join(loads)}")
        out.append(f"  {f'other load while measuring, world {w} (cores)':<44s} {' | '.join(parts)}")
    out.append(H.machine_line(meta, ["torch", "rpcdist"]))
    return "\n".join(out)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def failures(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, rnd in enumerate(rounds):
        for phase, err in rnd["errors"].items():
            if err.startswith("skipped"):
                continue
            out.append(
                {
                    "round": i,
                    "system": rnd["system"],
                    "world": rnd["world"],
                    "rep": rnd["rep"],
                    "phase": phase,
                    "summary": rnd["summaries"].get(phase) or err.strip().splitlines()[0],
                    "text": err,
                }
            )
    return out


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(
        ap,
        quick_help="one round, 4 KB and 1 MB only: ~1 minute",
        repeats_help="rounds per system and world (default 5; 1 with --quick)",
        systems=SYSTEMS,
        systems_help="comma-separated subset of gloo,rpcdist (rows stay)",
    )
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--phase-budget", type=float, default=None, help="seconds before a phase counts as hung")
    args = ap.parse_args(argv)

    cfg = make_config(args.quick)
    if args.phase_budget is not None:
        cfg["phase_budget"] = args.phase_budget
    if args.worlds:
        cfg["worlds"] = [int(w) for w in args.worlds.split(",") if w]
        if any(w < 2 for w in cfg["worlds"]):
            ap.error("world sizes must be >= 2")
    repeats, systems = H.repeats_and_systems(ap, args, SYSTEMS)
    H.exit_on_sigterm()
    meta = H.start_meta(args, repeats, cfg, systems, ["torch", "rpcdist"])
    log(
        f"start: {repeats} round(s) per system and world, systems {systems}, worlds {cfg['worlds']}, "
        f"loadavg {os.getloadavg()}, machine probe {meta['probe_start']}"
    )

    # Start the forkserver (it imports torch once) before the first round, not inside it.
    warm = start(_context(), "forkserver-warmup", W.nothing, ())
    reap([warm], cfg["init_budget"])

    rounds: list[dict[str, Any]] = []
    hung: dict[tuple[str, int], set[str]] = {(s, w): set() for s in SYSTEMS for w in cfg["worlds"]}
    try:
        for rep in range(repeats):
            for wi, world in enumerate(cfg["worlds"]):
                # which system goes first alternates per world size and swaps every repetition
                order = list(SYSTEMS) if (rep + wi) % 2 == 0 else list(reversed(SYSTEMS))
                for system in order:
                    if system not in systems:
                        continue
                    log(f"rep {rep + 1}/{repeats}: {system} world {world} round")
                    t0 = time.monotonic()
                    res = run_round(system, world, cfg, hung[(system, world)])
                    res.update(system=system, world=world, rep=rep, seconds=time.monotonic() - t0)
                    hung[(system, world)].update(res["hung"])  # later rounds skip what hung
                    rounds.append(res)
                    log(
                        f"rep {rep + 1}/{repeats}: {system} world {world} round took {res['seconds']:.1f} s "
                        f"in {len(res['groups'])} group(s); other load while measuring "
                        f"{H.load_text(res.get('load'))}"
                    )
                    time.sleep(0.5)  # let the exited processes' CPU settle
    finally:
        H.reap_all()

    rows = metric_rows(cfg)
    agg = collect(rows, rounds)
    H.end_meta(meta)
    print(render(rows, agg, meta, rounds))
    fails = failures(rounds)
    if fails:
        print()
        print("failures (every rank's traceback, and stacks for hangs, on stderr and in --json):")
        for f in fails:
            print(
                f"  round {f['round']} ({f['system']}, world {f['world']}, rep {f['rep']}), "
                f"phase {f['phase']}: {f['summary']}"
            )
        print("\nfull failure reports:", file=sys.stderr)
        for f in fails:
            print(
                f"\n=== {f['system']} world {f['world']} rep {f['rep']} phase {f['phase']} ===\n{f['text']}",
                file=sys.stderr,
            )
    print(f"\ntotal runtime {meta['seconds']:.1f} s")
    sys.stdout.flush()

    if args.json:
        doc = {
            "meta": meta,
            "rows": rows,
            "summary": agg,
            "rounds": rounds,
            "failures": fails,
        }
        H.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    H.run_main(main)
