"""rpcdist vs torch.distributed.rpc (TensorPipe defaults), side by side, plus the raw grpc.aio floor.

    python bench/run.py rpc [--quick] [--repeats N] [--json out.json]    (or bench/rpc_bench.py)

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

``--path cross-host`` makes both systems use what crosses a network even on one host (torch:
TensorPipe's uv transport and basic channel; rpcdist: gRPC links, no shared memory).

Progress goes to stderr, the table to stdout; ``--json`` also writes every per-round number and
every failure (with tracebacks and, for hangs, all threads' stacks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import _harness as H
from _driver import Scenario, ratio, times
from _group import Launch, launched
from _harness import MiB, log

from scenarios import _rpc_workers as W

Row = dict[str, Any]

PATHS = {"same-host", "cross-host"}


class Rpc(Scenario):
    name = "rpc"
    doc = __doc__
    log_name = "bench"
    systems = ("torch", "rpcdist", "grpc")
    packages = ("torch", "grpcio", "rpcdist")
    machine_packages = ("torch", "grpcio")
    warm_forkserver = False  # the first torch round starts it
    quick_help = "few iterations, 10,000 RRefs, one round: < 90 s"
    repeats_help = "rounds per system (default 5; 1 with --quick)"
    systems_help = "comma-separated subset of torch,rpcdist,grpc (the table keeps every row)"
    right = {2, 3, 4, 7, 8}
    per_round_heading = "per-round medians, in run order:"
    failures_heading = "failures (full tracebacks on stderr and in --json):"

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--path",
            choices=sorted(PATHS),
            default="same-host",
            help="same-host: each system's defaults (torch: shm/cma channels; rpcdist: Unix socket "
            "and shared memory); cross-host: what crosses a network (torch "
            "_transports=['uv'], _channels=['basic']; rpcdist transport='grpc', "
            "shm_threshold_bytes=0)",
        )
        W.add_carrier_arg(ap)

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        cfg["path"] = args.path
        cfg["cross_host_carrier"] = args.cross_host_carrier

    def make_config(self, quick: bool) -> dict[str, Any]:
        if quick:
            return {
                "warmup": 20,
                "lat_calls": 200,
                "window": 64,
                "calls_n": 1000,
                "calls_batches": 1,
                "sizes": [1 * MiB],
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
        return {
            "warmup": 200,
            "lat_calls": 2000,
            "window": 64,
            "calls_n": 5000,
            "calls_batches": 3,
            "sizes": [1 * MiB, 16 * MiB, 64 * MiB],
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

    # ---- one round: a caller and a callee ------------------------------------------------------
    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        """torch / rpcdist pairs fork from a forkserver that has imported torch once, which saves
        every pair several seconds of ``import torch`` on a loaded 2-core machine; the raw gRPC
        pair is spawned fresh and never imports torch."""
        ctx = mp.get_context("spawn") if system == "grpc" else self.context()
        child_cfg = dict(cfg, skip=sorted(skip))
        out: dict[str, Any] = {"results": {}, "errors": {}, "summaries": {}, "hung": None, "pids": {}}

        def body(launch: Launch) -> None:
            stacks, life = launch.stack_files, launch.life_r
            parent_conn, child_conn = ctx.Pipe()
            if system in ("torch", "rpcdist"):
                init = self.init_method(cfg)
                args = (system, 1, init, None, child_cfg, stacks["callee"], life)
                callee = launch.start(f"{system}-callee", W.rpc_worker, args)
                args = (system, 0, init, child_conn, child_cfg, stacks["caller"], life)
                caller = launch.start(f"{system}-caller", W.rpc_worker, args)
            else:
                srv_parent, srv_child = ctx.Pipe()
                callee = launch.start("grpc-server", W.grpc_server, (srv_child, stacks["callee"], life))
                srv_child.close()
                if not srv_parent.poll(cfg["init_budget"]):
                    raise RuntimeError(
                        f"the raw grpc server did not report its port (exit code {callee.exitcode})"
                    )
                _, port = srv_parent.recv()
                args = (port, child_conn, child_cfg, stacks["caller"], life)
                caller = launch.start("grpc-client", W.grpc_client, args)
            launch.procs[:] = [caller, callee]
            child_conn.close()
            out["pids"] = {"caller": caller.pid, "callee": callee.pid}
            self.drive(system, parent_conn, launch, out, cfg)

        launched(ctx, f"rpcbench-{system}-", ["caller", "callee"], out, body)
        return out

    def init_method(self, cfg: dict[str, Any]) -> str:
        """The init_method of one round's pair."""
        return f"tcp://127.0.0.1:{H.free_port()}"

    def drive(self, system: str, conn: Any, launch: Launch, out: dict[str, Any], cfg: dict[str, Any]) -> None:
        """Follow the measuring child's phases until it is done, dies, or overruns a phase
        (a failing phase does not end the round: the child runs the next one)."""
        procs = launch.procs
        phase, deadline, phase_t0 = "startup", time.monotonic() + cfg["init_budget"], time.monotonic()
        start_load: dict[str, float] | None = None

        def next_phase(name: str) -> tuple[str, float, float]:
            # the gap up to the next phase is bounded too
            return name, time.monotonic() + cfg["phase_budget"], time.monotonic()

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
                        start_load = H.load_snapshot(out["pids"].values())
                elif kind == "result":
                    out["results"][msg[1]] = msg[2]
                    took = time.monotonic() - phase_t0
                    phase, deadline, phase_t0 = next_phase(f"after {msg[1]}")
                    log(f"  {system:7s} {msg[1]:16s} {summarize(msg[2])}  ({took:.1f} s)")
                elif kind == "error":
                    out["errors"][msg[1]] = msg[2]
                    phase, deadline, phase_t0 = next_phase(f"after {msg[1]}")
                    log(f"  {system:7s} {msg[1]:16s} FAILED: {H.last_line(msg[2]) or msg[2]}")
                    if not msg[2].startswith("skipped"):
                        print(msg[2], file=sys.stderr, flush=True)
                elif kind == "idle":
                    phase = "idle"
                    out["results"]["idle"] = measure_idle(out["pids"], cfg["idle_seconds"])
                    log(f"  {system:7s} {'idle':16s} {summarize(out['results']['idle'])}")
                    conn.send(("go",))
                    phase, deadline, phase_t0 = next_phase("after idle")
                elif kind == "measured":
                    # Other work competing with the measurements (from the first to the last phase):
                    # machine-wide busy CPU less what this benchmark's processes used.
                    if start_load is not None:
                        out["load"] = H.foreign_load(start_load, H.load_snapshot(out["pids"].values()))
                elif kind == "done":
                    out["clean"] = True
                    return
                continue
            now = time.monotonic()
            if now > deadline:
                stacks = H.dump_stacks(procs, launch.stack_files)
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

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        """Each row: label, unit, which direction is better, and where a round holds its number."""

        def row(
            rid: str, label: str, unit: str, better: str, phase: str, key: str, raw: bool, **kw: Any
        ) -> Row:
            return {
                "id": rid,
                "label": label,
                "unit": unit,
                "better": better,
                "phase": phase,
                "key": key,
                **kw,
                "raw": raw,
            }

        rows = [
            row("latency", "(a) rpc_sync no-op round trip", "µs", "lower", "latency", "median_us", True),
            row(
                "calls",
                f"(b) rpc_async no-op, {cfg['window']} in flight",
                "calls/s",
                "higher",
                "calls",
                "calls_per_s",
                True,
            ),
        ]
        for size in cfg["sizes"]:
            label = f"(c) float32 tensor {size // MiB} MB one way"
            rows.append(row(f"oneway_{size}", label, "MB/s", "higher", f"oneway_{size}", "MBps", True))
        held = f"{cfg['rref_count']:,} held"
        stream = (
            f"grpc.aio raw: {cfg['stream_bytes'] // MiB} MB client-stream, "
            f"{cfg['stream_chunk'] // MiB} MB chunks"
        )
        return rows + [
            row("remote", "(d) remote() + to_here()", "µs", "lower", "remote", "median_us", False),
            row(
                "idle_callee",
                "(e) idle CPU, callee process",
                "% core",
                "lower",
                "idle",
                "callee_pct",
                True,
                raw_ratio=False,
            ),
            row(
                "idle_caller",
                "(e) idle CPU, caller process",
                "% core",
                "lower",
                "idle",
                "caller_pct",
                True,
                raw_ratio=False,
            ),
            row("rref_call", "(f) RRef proxy call latency", "µs", "lower", "rref_call", "median_us", False),
            row(
                "rref_owner_mem",
                f"(g) owner memory per live RRef, {held}",
                "B/RRef",
                "lower",
                "rref_memory",
                "owner_bytes_per_rref",
                False,
            ),
            row(
                "rref_caller_mem",
                f"(g) caller memory per live RRef, {held}",
                "B/RRef",
                "lower",
                "rref_memory",
                "caller_bytes_per_rref",
                False,
            ),
            row("stream", stream, "MB/s", "higher", "stream", "MBps", True, raw_only=True),
        ]

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        if row["phase"] in rnd["errors"]:
            return H.problem(rnd["errors"][row["phase"]])
        return "LOST" if rnd["hung"] or rnd["errors"] else None  # else: not this system's row

    def header(self) -> list[str]:
        return [*super().header(), "grpc.aio raw", "rpcdist/raw"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        g = a["grpc"]
        raw = self.fmt(g["median"], row, g["problems"])
        if row.get("raw_only"):
            # rpcdist/raw here: rpcdist's own 64 MB one-way rate against the chunked-stream floor
            big = agg.get(f"oneway_{meta['cfg']['stream_bytes']}", {}).get("rpcdist", {}).get("median")
            return [
                row["label"],
                row["unit"],
                "-",
                "-",
                "-",
                row["better"],
                "-",
                raw,
                times(ratio(big, g["median"])),
            ]
        rr = ratio(a["rpcdist"]["median"], g["median"]) if row["raw"] and row.get("raw_ratio", True) else None
        return [*super().table_row(row, a, agg, meta), raw if row["raw"] else "-", times(rr)]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        if meta["cfg"].get("path") == "cross-host":
            systems = (
                f"cross-host path: rpcdist ({W.carrier_name(meta['cfg'])} links, no shared memory) vs "
                "torch.distributed.rpc (TensorPipe uv transport, basic channel)"
            )
        else:
            systems = "rpcdist vs torch.distributed.rpc (TensorPipe defaults)"
        return [
            f"{systems} vs raw grpc.aio, 2 processes on 127.0.0.1: medians over "
            f"{meta['repeats']} interleaved round(s) per system{quick}"
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        return [
            "rpcdist/torch and rpcdist/raw are ratios of the medians; 'better when' says which direction "
            "favours rpcdist. MB = 2^20 bytes. * = some rounds failed (see below).",
            "grpc.aio raw column: the same operation as bare bytes-in/bytes-out grpc.aio unary calls "
            "(generic handler, no protobuf); on the client-stream row rpcdist/raw compares rpcdist's "
            "64 MB one-way rate with it.",
        ]

    def verdict(self, r: float | None, better: str) -> str:
        """Beyond 100x, or a ratio <= 0 (e.g. no idle CPU at all): '>100x'."""
        if r is None or 0.01 <= r <= 100:
            return super().verdict(r, better)
        good = r < 1 if better == "lower" else r > 1
        return f"rpcdist >100x {'better' if good else 'worse'}"

    def row_systems(self, row: dict[str, Any]) -> tuple[str, ...]:
        if row.get("raw_only"):
            return ("grpc",)
        return self.systems if row["raw"] else ("torch", "rpcdist")

    def number(self, v: float, row: dict[str, Any]) -> str:
        return f"{v:,.0f}" if v >= 100 and row["unit"] != "% core" else f"{v:.1f}"


def measure_idle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process used over ``seconds`` with nothing in flight.

    ``<role>_pct`` comes from /proc/<pid>/stat utime+stime (clock-tick resolution);
    ``<role>_pct_schedstat`` is the same from the threads' schedstat run time, for cross-checking.
    """
    before = {role: (H.cpu_seconds(pid), H.sched_seconds(pid)) for role, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    after = {role: (H.cpu_seconds(pid), H.sched_seconds(pid)) for role, pid in pids.items()}
    res: dict[str, float] = {"seconds": wall}
    for role in pids:
        res[f"{role}_pct"] = 100.0 * (after[role][0] - before[role][0]) / wall
        res[f"{role}_pct_schedstat"] = 100.0 * (after[role][1] - before[role][1]) / wall
    return res


def summarize(r: dict[str, Any]) -> str:
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


SCENARIO = Rpc()
