#!/usr/bin/env python
"""rpcdist vs torch.distributed.rpc (TensorPipe defaults), side by side, plus the raw grpc.aio floor.

    python bench/rpc_bench.py [--quick] [--repeats N] [--json out.json]

Every round starts a fresh pair of processes on 127.0.0.1 (rank 0 calls, rank 1 is called)
for one system, measures everything, and shuts it down before the next system's round
starts; rounds of torch, rpcdist and raw grpc.aio are interleaved and their order rotates, so
drift on this noisy machine lands on all of them. Only one pair is alive at a time: an idle
TensorPipe process spins a whole core, which would otherwise tax whoever is measured next.
torch/rpcdist processes fork from a forkserver that imported torch once (saves seconds of
import per process); the raw grpc.aio pair is spawned fresh and never imports torch. Every
child exits when the orchestrator dies, even by SIGKILL (a lifeline pipe), and every child is
joined, or terminated and killed, before the next round starts.

Measured per round (medians over many calls, then the median over rounds is printed):
  (a) rpc_sync round trip of a no-op with no args (µs)
  (b) rpc_async no-op calls/s with a sliding window of 64 outstanding futures
  (c) MB/s (MB = 2^20 bytes) of one float32 tensor sent one way (the callee returns None)
  (d) remote() + to_here() of a small int (µs)
  (e) idle CPU (% of one core) of the callee and of the caller, from /proc/<pid>/stat
      utime+stime over a few seconds with nothing in flight
  (f) ``rref.rpc_sync().noop()`` round trip through an RRef held by the caller to an object
      the callee owns (made by ``rpc.remote(callee, Target)``) (µs)
  (g) memory per live RRef: the caller makes 100,000 (10,000 with --quick) RRefs to small ints
      on the callee with ``rpc.remote``, in batches of 1,000 (each batch confirmed by the
      owner before the next starts), and reports the growth of the callee's (owner's) and the
      caller's (user's) VmRSS (/proc/<pid>/status, after gc) divided by the count, in bytes.
      Then it drops them all and waits until the owner has freed every value, so the group
      shuts down with nothing pending. Runs after (e), so it cannot disturb the idle figures.
  grpc.aio raw: the same unary round trip / 64-in-flight / one-way sends as bytes in, bytes
      out (generic handlers, no protobuf), and one 64 MB client stream in 1 MB chunks.

Progress goes to stderr, the table to stdout; ``--json`` also writes every per-round number and
every failure (with tracebacks and, for hangs, all threads' stacks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:  # children get this sys.path too, so they import these modules
    sys.path.insert(0, BENCH_DIR)

import _bench_workers as W  # noqa: E402
import _harness as H  # noqa: E402
from _harness import (  # noqa: E402
    MiB,
    cpu_seconds,
    dump_stacks,
    foreign_load,
    free_port,
    load_snapshot,
    log,
    reap,
    start,
)

SYSTEMS = ("torch", "rpcdist", "grpc")
H.set_name("bench")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def make_config(quick: bool) -> dict[str, Any]:
    if quick:
        sizes = [1 * MiB]
        return {
            "warmup": 20,
            "lat_calls": 200,
            "window": 64,
            "calls_n": 1000,
            "calls_batches": 1,
            "sizes": sizes,
            "bulk_warmup": 1,
            "bulk_iters": {str(1 * MiB): 10},
            "remote_calls": 50,
            "rref_calls": 200,
            "rref_count": 10_000,
            "rref_batch": 1000,
            "idle_seconds": 1.5,
            "stream_bytes": 64 * MiB,
            "stream_chunk": 1 * MiB,
            "stream_iters": 2,
            "phase_budget": 45.0,
            "init_budget": 60.0,
        }
    sizes = [1 * MiB, 16 * MiB, 64 * MiB]
    return {
        "warmup": 200,
        "lat_calls": 2000,
        "window": 64,
        "calls_n": 5000,
        "calls_batches": 3,
        "sizes": sizes,
        "bulk_warmup": 2,
        "bulk_iters": {str(1 * MiB): 50, str(16 * MiB): 10, str(64 * MiB): 5},
        "remote_calls": 500,
        "rref_calls": 2000,
        "rref_count": 100_000,
        "rref_batch": 1000,
        "idle_seconds": 3.0,
        "stream_bytes": 64 * MiB,
        "stream_chunk": 1 * MiB,
        "stream_iters": 5,
        "phase_budget": 180.0,
        "init_budget": 120.0,
    }


# ------------------------------------------------------------------------------------------------
# one round of one system
# ------------------------------------------------------------------------------------------------
def _context(system: str) -> Any:
    """How a round's processes start.

    torch / rpcdist pairs fork from a forkserver that has imported torch once, which saves
    every pair several seconds of ``import torch`` on a loaded 2-core machine; the raw gRPC
    pair is spawned fresh and never imports torch.
    """
    if system == "grpc":
        return mp.get_context("spawn")
    return H.forkserver(["torch"])


def run_round(system: str, cfg: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    ctx = _context(system)
    child_cfg = dict(cfg, skip=sorted(skip))
    procs: list[Any] = []
    out: dict[str, Any] = {"results": {}, "errors": {}, "hung": None, "pids": {}}
    with tempfile.TemporaryDirectory(prefix=f"rpcbench-{system}-") as tmp:
        stack_files = {"caller": os.path.join(tmp, "caller.txt"), "callee": os.path.join(tmp, "callee.txt")}
        # Only this process holds life_w: when it dies, every child of the round sees EOF and exits.
        life_r, life_w = ctx.Pipe(duplex=False)
        try:
            parent_conn, child_conn = ctx.Pipe()
            if system in ("torch", "rpcdist"):
                init = f"tcp://127.0.0.1:{free_port()}"
                callee = start(
                    ctx,
                    f"{system}-callee",
                    W.rpc_worker,
                    (system, 1, init, None, child_cfg, stack_files["callee"], life_r),
                )
                caller = start(
                    ctx,
                    f"{system}-caller",
                    W.rpc_worker,
                    (system, 0, init, child_conn, child_cfg, stack_files["caller"], life_r),
                )
                procs = [caller, callee]
            else:
                srv_parent, srv_child = ctx.Pipe()
                callee = start(ctx, "grpc-server", W.grpc_server, (srv_child, stack_files["callee"], life_r))
                procs = [callee]
                srv_child.close()
                if not srv_parent.poll(cfg["init_budget"]):
                    raise RuntimeError(
                        f"the raw grpc server did not report its port (exit code {callee.exitcode})"
                    )
                kind, port = srv_parent.recv()
                caller = start(
                    ctx,
                    "grpc-client",
                    W.grpc_client,
                    (port, child_conn, child_cfg, stack_files["caller"], life_r),
                )
                procs = [caller, callee]
            child_conn.close()
            out["pids"] = {"caller": caller.pid, "callee": callee.pid}
            drive(system, parent_conn, procs, out, cfg, stack_files)
        except BaseException as exc:
            out["errors"].setdefault("orchestrator", f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            # After a clean "done" the callee is just finishing its own shutdown: give it time.
            reap(procs, 30.0 if out.get("clean") else 3.0)
            out["exitcodes"] = {p.name: p.exitcode for p in procs}
            life_r.close()
            life_w.close()
    return out


def drive(
    system: str,
    conn: Any,
    procs: list[Any],
    out: dict[str, Any],
    cfg: dict[str, Any],
    stack_files: dict[str, str],
) -> None:
    """Follow the measuring child's phases until it is done, dies, or overruns a phase."""
    phase, deadline = "startup", time.monotonic() + cfg["init_budget"]
    phase_t0 = time.monotonic()
    start_load: dict[str, float] | None = None
    while True:
        if conn.poll(0.2):
            try:
                msg = conn.recv()
            except EOFError:
                codes = {p.name: p.exitcode for p in procs}
                out["errors"].setdefault(
                    phase, f"the measuring process went away during phase {phase!r}; exit codes {codes}"
                )
                log(f"  {system}: {out['errors'][phase]}")
                return
            kind = msg[0]
            if kind == "phase":
                phase, deadline, phase_t0 = msg[1], time.monotonic() + msg[2], time.monotonic()
                if start_load is None and phase != "init":
                    start_load = load_snapshot(out["pids"].values())
            elif kind == "result":
                out["results"][msg[1]] = msg[2]
                took = time.monotonic() - phase_t0
                # the gap up to the next phase is bounded too
                phase, deadline, phase_t0 = (
                    f"after {msg[1]}",
                    time.monotonic() + cfg["phase_budget"],
                    time.monotonic(),
                )
                log(f"  {system:7s} {msg[1]:16s} {summarize(msg[1], msg[2])}  ({took:.1f} s)")
            elif kind == "error":
                out["errors"][msg[1]] = msg[2]
                phase, deadline, phase_t0 = (
                    f"after {msg[1]}",
                    time.monotonic() + cfg["phase_budget"],
                    time.monotonic(),
                )
                lines = msg[2].strip().splitlines()
                log(f"  {system:7s} {msg[1]:16s} FAILED: {lines[-1] if lines else msg[2]}")
                if not msg[2].startswith("skipped"):
                    print(msg[2], file=sys.stderr, flush=True)
            elif kind == "idle":
                phase = "idle"
                out["results"]["idle"] = measure_idle(out["pids"], cfg["idle_seconds"])
                log(f"  {system:7s} {'idle':16s} {summarize('idle', out['results']['idle'])}")
                conn.send(("go",))
                phase, deadline, phase_t0 = (
                    "after idle",
                    time.monotonic() + cfg["phase_budget"],
                    time.monotonic(),
                )
            elif kind == "measured":
                # Other work competing with the measurements (from the first to the last phase):
                # machine-wide busy CPU less what this benchmark's processes used.
                if start_load is not None:
                    out["load"] = foreign_load(start_load, load_snapshot(out["pids"].values()))
            elif kind == "done":
                out["clean"] = True
                return
            continue
        now = time.monotonic()
        if now > deadline:
            stacks = dump_stacks(procs, stack_files)
            out["hung"] = phase
            out["errors"][phase] = (
                f"HANG: phase {phase!r} still running after {now - phase_t0:.0f} s\n{stacks}"
            )
            log(f"  {system}: HANG in phase {phase!r}; stacks:\n{stacks}")
            return
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            # Give the measuring child a moment to report the error that caused this.
            while conn.poll(0.5):
                try:
                    msg = conn.recv()
                except EOFError:
                    break
                if msg[0] == "error":
                    out["errors"][msg[1]] = msg[2]
            desc = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
            out["errors"].setdefault(phase, f"process died during phase {phase!r}: {desc}")
            log(f"  {system}: process died during phase {phase!r}: {desc}")
            return


def sched_seconds(pid: int) -> float:
    """Run time of all live threads of a process in ns precision (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def measure_idle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process used over ``seconds`` with nothing in flight.

    ``<role>_pct`` comes from /proc/<pid>/stat utime+stime (clock-tick resolution);
    ``<role>_pct_schedstat`` is the same from the threads' schedstat run time, for cross-checking.
    """
    before = {role: (cpu_seconds(pid), sched_seconds(pid)) for role, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    after = {role: (cpu_seconds(pid), sched_seconds(pid)) for role, pid in pids.items()}
    res: dict[str, float] = {"seconds": wall}
    for role in pids:
        res[f"{role}_pct"] = 100.0 * (after[role][0] - before[role][0]) / wall
        res[f"{role}_pct_schedstat"] = 100.0 * (after[role][1] - before[role][1]) / wall
    return res


def summarize(name: str, r: dict[str, Any]) -> str:
    if "MBps" in r:
        return f"{r['MBps']:.0f} MB/s (median {r['median_us'] / 1e3:.2f} ms)"
    if "calls_per_s" in r:
        return f"{r['calls_per_s']:.0f} calls/s (batches {', '.join(f'{x:.0f}' for x in r['batches'])})"
    if "median_us" in r:
        return f"median {r['median_us']:.0f} µs  p10 {r['p10_us']:.0f}  p90 {r['p90_us']:.0f}"
    if "owner_bytes_per_rref" in r:
        return (
            f"{r['count']:,} RRefs: owner {r['owner_bytes_per_rref']:.0f} B/RRef, caller "
            f"{r['caller_bytes_per_rref']:.0f} B/RRef; {r['creates_per_s']:.0f} remote()/s, "
            f"released in {r['release_s']:.1f} s"
        )
    if "callee_pct" in r:
        return f"callee {r['callee_pct']:.1f} %  caller {r['caller_pct']:.1f} % of a core"
    return json.dumps(r)


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def metric_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row: label, unit, which direction is better, and how to read it from a round."""

    def get(phase: str, key: str) -> Any:
        return lambda res: res.get(phase, {}).get(key)

    rows = [
        {
            "id": "latency",
            "label": "(a) rpc_sync no-op round trip",
            "unit": "µs",
            "better": "lower",
            "phase": "latency",
            "get": get("latency", "median_us"),
            "raw": True,
        },
        {
            "id": "calls",
            "label": f"(b) rpc_async no-op, {cfg['window']} in flight",
            "unit": "calls/s",
            "better": "higher",
            "phase": "calls",
            "get": get("calls", "calls_per_s"),
            "raw": True,
        },
    ]
    for size in cfg["sizes"]:
        rows.append(
            {
                "id": f"oneway_{size}",
                "label": f"(c) float32 tensor {size // MiB} MB one way",
                "unit": "MB/s",
                "better": "higher",
                "phase": f"oneway_{size}",
                "get": get(f"oneway_{size}", "MBps"),
                "raw": True,
            }
        )
    rows += [
        {
            "id": "remote",
            "label": "(d) remote() + to_here()",
            "unit": "µs",
            "better": "lower",
            "phase": "remote",
            "get": get("remote", "median_us"),
            "raw": False,
        },
        {
            "id": "idle_callee",
            "label": "(e) idle CPU, callee process",
            "unit": "% core",
            "better": "lower",
            "phase": "idle",
            "get": get("idle", "callee_pct"),
            "raw": True,
            "raw_ratio": False,
        },
        {
            "id": "idle_caller",
            "label": "(e) idle CPU, caller process",
            "unit": "% core",
            "better": "lower",
            "phase": "idle",
            "get": get("idle", "caller_pct"),
            "raw": True,
            "raw_ratio": False,
        },
        {
            "id": "rref_call",
            "label": "(f) RRef proxy call latency",
            "unit": "µs",
            "better": "lower",
            "phase": "rref_call",
            "get": get("rref_call", "median_us"),
            "raw": False,
        },
        {
            "id": "rref_owner_mem",
            "label": f"(g) owner memory per live RRef, {cfg['rref_count']:,} held",
            "unit": "B/RRef",
            "better": "lower",
            "phase": "rref_memory",
            "get": get("rref_memory", "owner_bytes_per_rref"),
            "raw": False,
        },
        {
            "id": "rref_caller_mem",
            "label": f"(g) caller memory per live RRef, {cfg['rref_count']:,} held",
            "unit": "B/RRef",
            "better": "lower",
            "phase": "rref_memory",
            "get": get("rref_memory", "caller_bytes_per_rref"),
            "raw": False,
        },
        {
            "id": "stream",
            "label": f"grpc.aio raw: {cfg['stream_bytes'] // MiB} MB client-stream, "
            f"{cfg['stream_chunk'] // MiB} MB chunks",
            "unit": "MB/s",
            "better": "higher",
            "phase": "stream",
            "get": get("stream", "MBps"),
            "raw": True,
            "raw_only": True,
        },
    ]
    return rows


def collect(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row and system: the per-round values (run order) and their median, or why missing."""
    agg: dict[str, dict[str, Any]] = {}
    for row in rows:
        agg[row["id"]] = {}
        for system in SYSTEMS:
            vals, problems = [], []
            for rnd in rounds:
                if rnd["system"] != system:
                    continue
                v = row["get"](rnd["results"])
                if v is not None:
                    vals.append(v)
                elif row["phase"] in rnd["errors"]:
                    problems.append(H.problem(rnd["errors"][row["phase"]]))
                elif rnd["hung"] or rnd["errors"]:
                    problems.append("LOST")
            agg[row["id"]][system] = {
                "values": vals,
                "median": statistics.median(vals) if vals else None,
                "problems": problems,
            }
    return agg


def fmt(v: float | None, unit: str, problems: list[str] | None = None) -> str:
    if v is None:
        return problems[0] if problems else "-"
    if unit == "% core":
        s = f"{v:.1f}"
    elif v >= 100:
        s = f"{v:,.0f}"
    else:
        s = f"{v:.1f}"
    return s + ("*" if problems else "")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def verdict(r: float | None, better: str) -> str:
    if r is None:
        return "-"
    if 0.95 <= r <= 1.05:
        return "about equal"
    good = r < 1 if better == "lower" else r > 1
    factor = 1 / r if 0 < r < 1 else r if r >= 1 else float("inf")
    word = "better" if good else "worse"
    return f"rpcdist >100x {word}" if factor > 100 else f"rpcdist {factor:.2f}x {word}"


def render(
    rows: list[dict[str, Any]],
    agg: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    rounds: list[dict[str, Any]],
) -> str:
    header = [
        "metric",
        "unit",
        "torch",
        "rpcdist",
        "rpcdist/torch",
        "better when",
        "verdict",
        "grpc.aio raw",
        "rpcdist/raw",
    ]
    table = []
    for row in rows:
        a = agg[row["id"]]
        t, r, g = a["torch"]["median"], a["rpcdist"]["median"], a["grpc"]["median"]
        if row.get("raw_only"):
            # rpcdist/raw here: rpcdist's own 64 MB one-way rate against the chunked-stream floor
            big = agg.get(f"oneway_{meta['cfg']['stream_bytes']}", {}).get("rpcdist", {}).get("median")
            rr = ratio(big, g)
            table.append(
                [
                    row["label"],
                    row["unit"],
                    "-",
                    "-",
                    "-",
                    row["better"],
                    "-",
                    fmt(g, row["unit"], a["grpc"]["problems"]),
                    f"{rr:.2f}x" if rr is not None else "-",
                ]
            )
            continue
        rt = ratio(r, t)
        rr = ratio(r, g) if row["raw"] and row.get("raw_ratio", True) else None
        table.append(
            [
                row["label"],
                row["unit"],
                fmt(t, row["unit"], a["torch"]["problems"]),
                fmt(r, row["unit"], a["rpcdist"]["problems"]),
                f"{rt:.2f}x" if rt is not None else "-",
                row["better"],
                verdict(rt, row["better"]),
                fmt(g, row["unit"], a["grpc"]["problems"]) if row["raw"] else "-",
                f"{rr:.2f}x" if rr is not None else "-",
            ]
        )
    quick = " (--quick)" if meta["quick"] else ""
    out = [
        f"rpcdist vs torch.distributed.rpc (TensorPipe defaults) vs raw grpc.aio, 2 processes on 127.0.0.1: "
        f"medians over {meta['repeats']} interleaved round(s) per system{quick}",
        *H.table_lines(header, table, right={2, 3, 4, 7, 8}),
    ]
    out.append("")
    out.append(
        "rpcdist/torch and rpcdist/raw are ratios of the medians; 'better when' says which direction "
        "favours rpcdist. MB = 2^20 bytes. * = some rounds failed (see below)."
    )
    out.append(
        "grpc.aio raw column: the same operation as bare bytes-in/bytes-out grpc.aio unary calls "
        "(generic handler, no protobuf); on the client-stream row rpcdist/raw compares rpcdist's "
        "64 MB one-way rate with it."
    )
    # per-round values, so the noise is visible
    out.append("")
    out.append("per-round medians, in run order:")
    for row in rows:
        a = agg[row["id"]]
        parts = []
        for system in SYSTEMS:
            if row.get("raw_only") and system != "grpc":
                continue
            if not row["raw"] and system == "grpc":
                continue
            texts = [fmt(v, row["unit"]) for v in a[system]["values"]]
            parts.append(H.round_values(system, texts, a[system]["problems"]))
        out.append(f"  {row['label']:<48s} {' | '.join(parts)}")
    parts = []
    for system in SYSTEMS:
        loads = H.round_loads([r for r in rounds if r["system"] == system])
        if loads:
            parts.append(f"{system}: {' '.join(loads)}")
    out.append(f"  {'other load while measuring (cores, per round)':<48s} {' | '.join(parts)}")
    out.append(H.machine_line(meta, ["torch", "grpcio"]))
    return "\n".join(out)


def failures_text(rounds: list[dict[str, Any]]) -> str:
    lines = []
    for i, rnd in enumerate(rounds):
        for phase, err in rnd["errors"].items():
            if err.startswith("skipped"):
                continue
            head = err.strip().splitlines()
            first = head[0] if head else ""
            last = head[-1] if head else ""
            summary = first if first.startswith("HANG") else last
            lines.append(f"  round {i} ({rnd['system']}, rep {rnd['rep']}), phase {phase}: {summary}")
    if not lines:
        return ""
    return "failures (full tracebacks on stderr and in --json):\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(
        ap,
        quick_help="few iterations, 10,000 RRefs, one round: < 90 s",
        repeats_help="rounds per system (default 5; 1 with --quick)",
        systems=SYSTEMS,
        systems_help="comma-separated subset of torch,rpcdist,grpc (the table keeps every row)",
    )
    ap.add_argument("--phase-budget", type=float, default=None, help=argparse.SUPPRESS)  # harness tests
    args = ap.parse_args(argv)

    cfg = make_config(args.quick)
    if args.phase_budget is not None:
        cfg["phase_budget"] = args.phase_budget
    repeats, systems = H.repeats_and_systems(ap, args, SYSTEMS)
    H.exit_on_sigterm()
    meta = H.start_meta(args, repeats, cfg, systems, ["torch", "grpcio", "rpcdist"])
    log(
        f"start: {repeats} round(s) per system, systems {systems}, loadavg {os.getloadavg()}, "
        f"machine probe {meta['probe_start']}"
    )

    rounds: list[dict[str, Any]] = []
    hung: dict[str, set[str]] = {s: set() for s in SYSTEMS}
    try:
        for rep in range(repeats):
            # torch and rpcdist swap places every repetition; raw grpc alternates last / first
            pair = ["torch", "rpcdist"] if rep % 2 == 0 else ["rpcdist", "torch"]
            order = pair + ["grpc"] if rep % 2 == 0 else ["grpc"] + pair
            for system in order:
                if system not in systems:
                    continue
                log(f"rep {rep + 1}/{repeats}: {system} round")
                t0 = time.monotonic()
                res = run_round(system, cfg, hung[system])
                res.update(system=system, rep=rep, seconds=time.monotonic() - t0)
                if res["hung"]:
                    hung[system].add(res["hung"])  # later rounds skip the phase that hung
                rounds.append(res)
                log(
                    f"rep {rep + 1}/{repeats}: {system} round took {res['seconds']:.1f} s; while measuring, "
                    f"other load on the machine {H.load_text(res.get('load'))}"
                )
                time.sleep(0.5)  # let the exited processes' CPU settle
    finally:
        H.reap_all()

    rows = metric_rows(cfg)
    agg = collect(rows, rounds)
    H.end_meta(meta)
    print(render(rows, agg, meta, rounds))
    fails = failures_text(rounds)
    if fails:
        print()
        print(fails)
    print(f"\ntotal runtime {meta['seconds']:.1f} s")
    sys.stdout.flush()

    if args.json:
        doc = {
            "meta": meta,
            "summary": {
                rid: {s: {k: v for k, v in d.items()} for s, d in per.items()} for rid, per in agg.items()
            },
            "rows": [{k: v for k, v in row.items() if k != "get"} for row in rows],
            "rounds": rounds,
        }
        H.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    H.run_main(main)
