"""Failure detection and start-up: rpcdist vs torch.distributed.rpc (TensorPipe) and torchrun.

    python bench/run.py failure [--quick] [--repeats N] [--cap S] [--idle-seconds S]
                                [--startup-worlds 4,16] [--json out.json]

Three parts; every repetition runs a round of each system per part, interleaved (which
system goes first alternates), and every measurement starts fresh processes on 127.0.0.1,
so the two systems' processes are never alive at once (idle TensorPipe processes use CPU).

  detection (3 workers w0, w1, w2, forked from a forkserver that imported both packages):
      w0 has an ``rpc_async`` call in flight on w2 (w2's function sleeps; the call's timeout
      is far beyond the cap); w0 kills w2 with SIGKILL, or stops it with SIGSTOP (nothing
      closes, as when a host vanishes), and the number is the time from the signal to w0's
      future failing (a done callback stamps it), or "> cap" when it had not failed after
      ``--cap`` seconds (60; 5 with --quick). A stopped w2 is killed afterwards. rpcdist:
      SIGKILL with the default options (co-located workers talk over Unix sockets) and with
      ``RpcBackendOptions(transport="grpc", shm_threshold_bytes=0)``; SIGSTOP on that gRPC
      path with the default heartbeat (``heartbeat_interval=1.0, heartbeat_misses=3``:
      documented bound 4 s) and with ``heartbeat_interval=0.1`` (0.4 s); the SIGSTOP comes
      after the links were quiet for 0.2 s plus a random part of two intervals (a quiet link
      is heard from every other interval). torch: SIGKILL and SIGSTOP with TensorPipe's
      defaults. One fresh group per measurement.
  heartbeat CPU (8 workers): every worker calls every other once (so every link exists),
      then the group sits idle; after a settle (1 s) the CPU each worker used over
      ``--idle-seconds`` (10; 2 with --quick) is read from /proc/<pid>/stat (utime+stime),
      as % of one core: the mean per worker and the busiest worker (the JSON adds the same
      from schedstat), and the share of the time each worker's busiest thread was runnable
      (ran or waited for a core: 100 % for a thread that spins). rpcdist with
      transport="grpc" (so heartbeats run) at the default interval and at 100 ms; torch with
      TensorPipe's defaults.
  start-up (4 and 16 workers; 4 only with --quick): ``rpcdist-run --standalone
      --nproc-per-node N prog`` vs ``python -m torch.distributed.run --standalone
      --nproc-per-node N prog`` (prog: ``scenarios/_failure_workers.py``: import, init_rpc
      from the launcher's environment, rank 0 makes one ``rpc_sync`` to the last rank, all
      shut down). The numbers: from just before the launcher is started to rank 0 having
      imported its RPC package and to its first call returning (monotonic timestamps the
      program writes to a file), and to the launcher's exit.

Failures: a phase that raises is reported with the worker's traceback; one that overruns its
budget is a HANG with every worker's stacks (skipped in that system's later rounds); either
way the group is killed and the run goes on. Progress goes to stderr, the table to stdout;
``--json`` also writes every per-round number (per-worker CPU, the error each future failed
with, the start-up timestamps) and every failure in full.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _harness as H
from _driver import Scenario, ratio
from _group import Follower, run_ranks
from _harness import log

from scenarios import _failure_workers as W

GRPC = {"transport": "grpc", "shm_threshold_bytes": 0}
HB_1S = {**GRPC, "heartbeat_interval": 1.0, "heartbeat_misses": 3}
HB_100MS = {**GRPC, "heartbeat_interval": 0.1, "heartbeat_misses": 3}


def step(how: str = "", opts: dict[str, Any] | None = None, jitter: float = 0.0) -> dict[str, Any]:
    """One measurement (a group of its own): how the victim is lost, rpcdist's backend options,
    and up to how many seconds (uniformly random) the links stay quiet before the signal."""
    return {"how": how, "opts": opts or {}, "jitter": jitter}


def bound(opts: dict[str, Any]) -> float:
    """The documented detection bound of a hung peer: interval x (misses + 1)."""
    return opts["heartbeat_interval"] * (opts["heartbeat_misses"] + 1)


# system -> part -> phase -> step. A heartbeat is sent on a link quiet for one interval and
# answered at once, so a quiet link is heard from every two intervals: the SIGSTOP lands at a
# random point of that cycle.
STEPS: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "rpcdist": {
        "detection": {
            "kill_unix": step("kill"),
            "kill_grpc": step("kill", GRPC),
            "stop_hb_1s": step("stop", HB_1S, jitter=2 * HB_1S["heartbeat_interval"]),
            "stop_hb_100ms": step("stop", HB_100MS, jitter=2 * HB_100MS["heartbeat_interval"]),
        },
        "heartbeat": {"idle_hb_1s": step(opts=HB_1S), "idle_hb_100ms": step(opts=HB_100MS)},
        "startup": {"startup": step()},
    },
    "torch": {
        "detection": {"kill": step("kill"), "stop": step("stop")},
        "heartbeat": {"idle": step()},
        "startup": {"startup": step()},
    },
}
DETECT_WORLD, IDLE_WORLD = 3, 8
PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_failure_workers.py")


class GroupFollower(Follower):
    """One detect or idle group: w0's detection result, or the idle CPU the orchestrator
    measures once every worker is ready."""

    def __init__(self, tag: str, cfg: dict[str, Any], world: int) -> None:
        super().__init__(tag, cfg, [f"w{r}" for r in range(world)])
        self.ready: set[int] = set()
        self.idle: dict[str, Any] | None = None

    def on_result(self, rank: int, phase: str, result: Any, now: float) -> None:
        if phase == "detect":
            log(f"  {self.tag} {summarize_detect(result)}")

    def on_message(self, rank: int, msg: tuple[Any, ...]) -> None:
        if msg[0] != "ready":
            return
        self.ready.add(rank)
        if len(self.ready) < self.world:
            return
        time.sleep(self.cfg["settle_idle"])  # the calls' aftermath is over
        self.idle = measure_idle([p.pid for p in self.procs], self.cfg["idle_seconds"])
        log(f"  {self.tag} {summarize_idle(self.idle)}")
        for c in self.conns:
            c.send(("go",))


def thread_stats(pid: int) -> dict[str, tuple[int, int]]:
    """Per live thread of a process: ns it ran and ns it waited runnable on a run queue
    (/proc/<pid>/task/<tid>/schedstat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            out[tid] = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            pass
    return out


def measure_idle(pids: list[int], seconds: float) -> dict[str, Any]:
    """% of one core each process used over ``seconds``: utime+stime (/proc/<pid>/stat; the
    table's numbers) and, at ns resolution, the threads' schedstat run time; and how long the
    process's busiest thread was runnable (ran, or waited for a core): a thread that spins is
    runnable all the time (100 %) however little of a core a loaded machine gives it."""

    def sample() -> list[tuple[float, dict[str, tuple[int, int]]]]:
        return [(H.cpu_seconds(p), thread_stats(p)) for p in pids]

    before = sample()
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    after = sample()
    pct, sched, spin = [], [], []
    for (cpu1, threads1), (cpu0, threads0) in zip(after, before, strict=True):
        pct.append(100.0 * (cpu1 - cpu0) / wall)
        common = [t for t in threads1 if t in threads0]
        ran = [threads1[t][0] - threads0[t][0] for t in common]
        runnable = [ran[i] + threads1[t][1] - threads0[t][1] for i, t in enumerate(common)]
        sched.append(100.0 * sum(ran) / 1e9 / wall)
        spin.append(100.0 * max(runnable, default=0) / 1e9 / wall)
    return {
        "seconds": wall,
        "per_worker_pct": pct,
        "per_worker_pct_schedstat": sched,
        "per_worker_busiest_thread_runnable_pct": spin,
        "mean_pct": statistics.fmean(pct),
        "max_pct": max(pct),
        "mean_pct_schedstat": statistics.fmean(sched),
        "busiest_thread_runnable_pct": statistics.fmean(spin),
    }


def summarize_detect(r: dict[str, Any]) -> str:
    if not r["detected"]:
        return f"{r['how']}: the call had not failed after {r['cap_s']:g} s"
    return f"{r['how']}: the call failed after {r['latency_s'] * 1e3:,.1f} ms with {r['error']}"


def summarize_idle(r: dict[str, Any]) -> str:
    per = " ".join(f"{v:.2f}" for v in r["per_worker_pct"])
    return (
        f"idle over {r['seconds']:.1f} s: mean {r['mean_pct']:.2f} %, busiest {r['max_pct']:.2f} % of a "
        f"core (schedstat {r['mean_pct_schedstat']:.2f} %; busiest thread runnable "
        f"{r['busiest_thread_runnable_pct']:.1f} % of the time); "
        f"per worker {per}"
    )


def launcher(system: str) -> list[str]:
    """The command that starts ``system``'s launcher."""
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run"]
    exe = os.path.join(os.path.dirname(sys.executable), "rpcdist-run")
    return [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "rpcdist.run"]


def _die_with_parent() -> None:
    """In the launcher, before exec: SIGKILL when the orchestrator dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:
        pass


def cpu_snapshot() -> dict[str, float]:
    """Machine busy/steal CPU and this process's CPU including its reaped descendants."""
    busy, steal = H.machine_cpu()
    return {"t": time.monotonic(), "busy": busy, "steal": steal, "ours": sum(os.times()[:4])}


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class Failure(Scenario):
    name = "failure"
    doc = __doc__
    log_name = "failure-bench"
    systems = ("torch", "rpcdist")
    part_keys = ("case", "world")
    preload = ("torch", "torch.distributed.rpc", "rpcdist.rpc")
    quick_help = "one round, 4 workers at start-up, 5 s cap, 2 s idle window: about a minute"
    repeats_help = "rounds per system and part (default 3; 1 with --quick)"
    systems_help = "comma-separated subset of torch,rpcdist (rows stay)"
    label_width = 62
    right = {2, 3, 4}

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--cap", type=float, default=None, help="seconds a future is waited for (60)")
        ap.add_argument("--idle-seconds", type=float, default=None, help="idle CPU window (10)")
        ap.add_argument(
            "--startup-worlds", default=None, help="comma-separated worker counts at start-up (4,16)"
        )

    def make_config(self, quick: bool) -> dict[str, Any]:
        cfg = {"sched_autogroup": autogroup_enabled()}
        if quick:
            return cfg | {
                "cap": 5.0,
                "settle": 0.2,
                "idle_seconds": 2.0,
                "settle_idle": 0.5,
                "startup_worlds": [4],
                "startup_budget": 90.0,
                "phase_budget": 30.0,
                "init_budget": 60.0,
                "error_grace": 5.0,
            }
        return cfg | {
            "cap": 60.0,
            "settle": 0.2,
            "idle_seconds": 10.0,
            "settle_idle": 1.0,
            "startup_worlds": [4, 16],
            "startup_budget": 300.0,
            "phase_budget": 60.0,
            "init_budget": 120.0,
            "error_grace": 10.0,
        }

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        if args.repeats is None and not args.quick:
            args.repeats = 3  # a round waits out torch's cap and starts 2 x (4 + 16) workers
        if args.cap is not None:
            cfg["cap"] = args.cap
        if args.idle_seconds is not None:
            cfg["idle_seconds"] = args.idle_seconds
        if args.startup_worlds:
            cfg["startup_worlds"] = [int(w) for w in args.startup_worlds.split(",") if w]
            if any(w < 2 for w in cfg["startup_worlds"]):
                ap.error("start-up worker counts must be >= 2")

    def parts(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"case": "detection", "world": DETECT_WORLD},
            {"case": "heartbeat", "world": IDLE_WORLD},
            *({"case": "startup", "world": w} for w in cfg["startup_worlds"]),
        ]

    def part_label(self, part: dict[str, Any]) -> str:
        return f"{part['case']}, {part['world']} workers"

    # ---- one round ----------------------------------------------------------------------------
    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"results": {}, "errors": {}, "summaries": {}, "hung": [], "load": None}
        foreign = steal = wall = 0.0
        for phase, st in STEPS[system][part["case"]].items():
            if phase in skip:
                out["errors"][phase] = "skipped: this phase hung in an earlier round"
                continue
            if part["case"] == "startup":
                g = self.run_startup(system, part["world"], cfg)
            else:
                g = self.run_group(system, part, phase, st, cfg)
            if phase not in g["results"] and not g["errors"]:
                g["errors"][phase] = "LOST: the group ended without a result"
            out["results"].update(g["results"])
            if g["errors"]:  # charged to this phase, whichever step failed (a hang first)
                steps = sorted(g["errors"].items(), key=lambda kv: not kv[1].startswith("HANG"))
                out["errors"][phase] = "\n".join(
                    f"{text.rstrip()}\n  (step {step!r})" for step, text in steps
                )
                out["summaries"][phase] = "; ".join(
                    g["summaries"].get(step) or H.last_line(text) for step, text in steps
                )
            if g["hung"]:
                out["hung"].append(phase)
            if g.get("load"):
                foreign += g["load"]["foreign_core_s"]
                steal += g["load"]["steal_core_s"]
                wall += g["load"]["seconds"]
            time.sleep(0.5)  # let the exited processes' CPU settle
        if wall > 0:
            out["load"] = {"foreign_cores": foreign / wall, "steal_cores": steal / wall, "seconds": wall}
        return out

    def run_group(
        self,
        system: str,
        part: dict[str, Any],
        phase: str,
        st: dict[str, Any],
        cfg: dict[str, Any],
    ) -> dict[str, Any]:
        """One group of ``part['world']`` workers for ``phase``; its result under ``phase``."""
        kind = "detect" if part["case"] == "detection" else "idle"
        world = part["world"]
        follower = GroupFollower(f"{system:7s} {phase:14s}", cfg, world)
        with tempfile.TemporaryDirectory(prefix="failbench-") as tmp:
            child_cfg = dict(cfg, how=st["how"], jitter=st["jitter"], tmpdir=tmp)
            opts = st["opts"]

            def args_of(rank: int, init: str, conn: Any, stack_file: str, life: Any) -> tuple[Any, ...]:
                return (system, kind, rank, world, init, opts, child_cfg, conn, stack_file, life)

            names = [f"{system}-{phase}-w{r}" for r in range(world)]
            g = run_ranks(
                self.context(), f"failbench-{system}-{phase}-", names, W.rank_main, args_of, follower
            )
        if kind == "detect":
            res = follower.reports.get("detect", {}).get(0)
        else:
            res = follower.idle if g["clean"] else None
        g["results"] = {phase: res} if res is not None else {}
        if not g["clean"]:  # a worker that died or stopped early skews the load figure
            g["load"] = None
        return g

    def run_startup(self, system: str, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
        """One launcher run of ``world`` workers; the time to rank 0's first call and to the exit."""
        out: dict[str, Any] = {"results": {}, "errors": {}, "summaries": {}, "hung": None, "load": None}
        tag = f"{system:7s} start-up {world:2d}"
        with tempfile.TemporaryDirectory(prefix=f"failbench-startup-{system}-") as outdir:
            cmd = [*launcher(system), "--standalone", "--nproc-per-node", str(world)]
            cmd += [PROG, "startup", system, outdir]
            paths = [H.BENCH_DIR, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            log_path = os.path.join(outdir, "launcher.log")
            with open(log_path, "w") as log_file:
                a = cpu_snapshot()
                t0 = time.monotonic()
                # Its own process group stays ours: a test that kills our session kills it too.
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent,  # safe: the orchestrator runs no threads
                )
                try:
                    code: int | None = proc.wait(timeout=cfg["startup_budget"])
                except subprocess.TimeoutExpired:
                    code = None
                    proc.terminate()  # both launchers pass it on to their workers
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                t1 = time.monotonic()
                b = cpu_snapshot()
            elapsed = max(1e-9, b["t"] - a["t"])
            out["load"] = {
                "foreign_core_s": max(0.0, (b["busy"] - a["busy"]) - (b["ours"] - a["ours"])),
                "steal_core_s": b["steal"] - a["steal"],
                "seconds": elapsed,
            }
            try:
                stamps = _read_json(os.path.join(outdir, "rank0.json"))
            except (OSError, ValueError):
                stamps = None
            shut_down = []
            for r in range(world):
                try:
                    shut_down.append(_read_json(os.path.join(outdir, f"rank{r}.done.json"))["shut_down"])
                except (OSError, ValueError, KeyError):
                    pass
            done = len(shut_down)
            log_tail = tail(log_path)
        if code is None:
            out["hung"] = "startup"
            out["errors"]["startup"] = (
                f"HANG: the launcher had not exited after {cfg['startup_budget']:g} s "
                f"(rank 0's first call {'returned' if stamps else 'had not returned'}); "
                f"its output:\n{log_tail}"
            )
            out["summaries"]["startup"] = out["errors"]["startup"].splitlines()[0]
        elif code != 0 or stamps is None:
            out["errors"]["startup"] = (
                f"the launcher exited with {code}; rank 0's timestamps "
                f"{'written' if stamps else 'missing'}; its output:\n{log_tail}"
            )
            out["summaries"]["startup"] = f"the launcher exited with {code}: {H.last_line(log_tail)}"
        else:
            res = {
                "first_call_s": stamps["first_call"] - t0,
                "total_s": t1 - t0,
                "rank0_started_s": stamps["start"] - t0,
                "rank0_imported_s": stamps["imported"] - t0,
                "rank0_initialized_s": stamps["initialized"] - t0,
                "ranks_shut_down": done,
                "last_shut_down_s": max(shut_down) - t0 if shut_down else None,
            }
            out["results"]["startup"] = res
            log(
                f"  {tag}: rank 0 started {res['rank0_started_s']:.2f} s, imported "
                f"{res['rank0_imported_s']:.2f} s, initialized {res['rank0_initialized_s']:.2f} s, "
                f"first call {res['first_call_s']:.2f} s, last rank shut down "
                f"{res['last_shut_down_s'] or float('nan'):.2f} s, launcher exited {res['total_s']:.2f} s "
                f"after the launch ({done}/{world} ranks shut down)"
            )
        if out["errors"]:
            log(f"  {tag} FAILED: {out['summaries']['startup']}")
        return out

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        """Each row: its part, label, unit, better direction, each system's phase and key."""

        def row(
            rid: str,
            case: str,
            world: int,
            label: str,
            unit: str,
            phases: tuple[str, str],
            key: str,
            **kw: Any,
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "case": case,
                "world": world,
                "label": label,
                "unit": unit,
                "better": "lower",
                "phases": {"torch": phases[0], "rpcdist": phases[1]},
                "key": key,
                "scale": 1e3 if unit == "ms" else 1.0,
                **kw,
            }

        d, h = ("detection", DETECT_WORLD), ("heartbeat", IDLE_WORLD)
        rows = [
            row("kill_unix", *d, "SIGKILL -> call fails, rpcdist default (Unix socket)", "ms",
                ("kill", "kill_unix"), "latency_s"),
            row("kill_grpc", *d, "SIGKILL -> call fails, rpcdist transport=grpc", "ms",
                ("kill", "kill_grpc"), "latency_s"),
            row("stop_hb_1s", *d, "SIGSTOP -> call fails, rpcdist grpc, heartbeat 1 s x 3", "s",
                ("stop", "stop_hb_1s"), "latency_s", target=bound(HB_1S)),
            row("stop_hb_100ms", *d, "SIGSTOP -> call fails, rpcdist grpc, heartbeat 0.1 s x 3", "s",
                ("stop", "stop_hb_100ms"), "latency_s", target=bound(HB_100MS)),
            row("idle_hb_1s", *h, "idle CPU per worker, 8 workers, heartbeat 1 s (default)", "% core",
                ("idle", "idle_hb_1s"), "mean_pct", target=1.0),
            row("idle_hb_1s_max", *h, "idle CPU of the busiest worker, heartbeat 1 s", "% core",
                ("idle", "idle_hb_1s"), "max_pct", target=1.0),
            row("idle_hb_1s_spin", *h, "idle, heartbeat 1 s: busiest thread runnable", "% time",
                ("idle", "idle_hb_1s"), "busiest_thread_runnable_pct"),
            row("idle_hb_100ms", *h, "idle CPU per worker, 8 workers, heartbeat 0.1 s", "% core",
                ("idle", "idle_hb_100ms"), "mean_pct"),
        ]  # fmt: skip
        for w in cfg["startup_worlds"]:
            s = ("startup", w)
            rows += [
                row(f"imported_{w}", *s, f"start-up, {w} workers: launch -> rank 0 imported", "s",
                    ("startup", "startup"), "rank0_imported_s"),
                row(f"first_call_{w}", *s, f"start-up, {w} workers: launch -> rank 0's first call", "s",
                    ("startup", "startup"), "first_call_s"),
                row(f"total_{w}", *s, f"start-up, {w} workers: launch -> launcher exits", "s",
                    ("startup", "startup"), "total_s"),
            ]  # fmt: skip
        return rows

    def value(self, row: dict[str, Any], rnd: dict[str, Any]) -> float | None:
        res = rnd["results"].get(row["phases"][rnd["system"]]) or {}
        v = res.get(row["key"])
        return None if v is None else v * row["scale"]

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        """``> cap``: the future had not failed when w0 stopped waiting (not a failure)."""
        phase = row["phases"][rnd["system"]]
        res = rnd["results"].get(phase)
        if res is not None and res.get("detected") is False:
            return f"> {res['cap_s']:g} s"
        if phase in rnd["errors"]:
            return H.problem(rnd["errors"][phase])
        return "LOST"

    def cell(self, row: dict[str, Any], values: list[float], problems: list[str]) -> dict[str, Any]:
        """The median counts rounds that reached the cap as longer than any value: when they
        are the larger half, the median is ``> cap``."""
        above = [p for p in problems if p.startswith(">")]
        failed = [p for p in problems if not p.startswith(">")]
        ranked = sorted(values) + [math.inf] * len(above)
        med = statistics.median(ranked) if ranked else None
        censored = med is not None and math.isinf(med)
        return {
            "values": values,
            "median": None if censored else med,
            "above": above[0] if censored else None,
            "problems": problems,
            "failed": failed,
        }

    def text(self, c: dict[str, Any], row: dict[str, Any]) -> str:
        """A cell: the median (``*``: some rounds failed), ``> cap``, or why there is none."""
        if c["median"] is not None:
            return self.number(c["median"], row) + ("*" if c["failed"] else "")
        return c["above"] or (c["failed"][0] if c["failed"] else "-")

    def header(self) -> list[str]:
        return [
            "metric",
            "unit",
            "torch",
            "rpcdist",
            "rpcdist/torch",
            "better when",
            "verdict",
            "target",
            "met",
        ]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        p, r = a["torch"], a["rpcdist"]
        rt, prefix = ratio(r["median"], p["median"]), ""
        if rt is None and r["median"] is not None and p["above"]:
            # torch's future never failed: rpcdist's time against the cap is an upper bound
            rt, prefix = ratio(r["median"], meta["cfg"]["cap"] * row["scale"]), "< "
        verdict = self.verdict(rt, row["better"]) if rt else "-"
        if prefix and verdict.startswith("rpcdist "):
            verdict = verdict.replace("rpcdist ", "rpcdist > ", 1)
        target, met = "-", "-"
        if "target" in row:
            target = f"<= {row['target']:g} {'%' if row['unit'] == '% core' else row['unit']}"
            if r["median"] is not None:
                met = "yes" if r["median"] <= row["target"] else "NO"
        return [
            row["label"],
            row["unit"],
            self.text(p, row),
            self.text(r, row),
            prefix + times_text(rt),
            row["better"],
            verdict,
            target,
            met,
        ]

    def number(self, v: float, row: dict[str, Any]) -> str:
        if row["unit"] == "% core":
            return f"{v:.1f}" if v >= 10 else f"{v:.2f}"
        return super().number(v, row)

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        return [
            "failure detection and start-up: rpcdist vs torch.distributed.rpc (TensorPipe defaults) and "
            f"rpcdist-run vs torchrun, 127.0.0.1: medians over {meta['repeats']} interleaved round(s) per "
            f"system and part{quick}"
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        cfg = meta["cfg"]
        out = [
            "detection: 3 workers; w0's rpc_async call is running on w2 when w2 gets SIGKILL (its "
            "connections close) or SIGSTOP (nothing closes: a hung or vanished host);",
            "    the time from the signal to w0's future failing. torch: TensorPipe, same signals; "
            f"'> {cfg['cap']:g} s': not failed when w0 stopped waiting (the call's own timeout is later).",
            "    target: the documented bound heartbeat_interval x (heartbeat_misses + 1); heartbeats are "
            "checked once per interval, so a detection can take up to one interval more.",
            f"heartbeat CPU: 8 workers (rpcdist: transport=grpc), every pair has called, then idle "
            f"{cfg['idle_seconds']:g} s; utime+stime as % of one core.",
            "    'busiest thread runnable': the share of the time a worker's busiest thread ran or waited "
            f"for a core (schedstat; 100 % = it spins, taking what it gets of the {os.cpu_count()} cores).",
            "start-up: from just before the launcher starts (rpcdist-run / python -m torch.distributed.run "
            "--standalone) to rank 0 having imported, to its first",
            "    rpc_sync to the last rank returning, and to the launcher's exit.",
        ]
        if cfg.get("sched_autogroup"):
            out.append(
                "    this kernel shares CPU between sessions (sched_autogroup_enabled=1): torchrun starts "
                "each worker in a session of its own, rpcdist-run keeps"
            )
            out.append(
                "    them in the launcher's, so under other load torchrun's workers get more of the CPU "
                "(see rank 0's import time)."
            )
        out.append(
            "rpcdist/torch is the ratio of the medians ('< x': torch's median is beyond the cap); 'target' "
            "and 'met' are rpcdist's. * = some rounds failed; ERR / HANG / SKIP / LOST = none succeeded."
        )
        return out


def times_text(r: float | None) -> str:
    """A ratio, with enough digits for small ones."""
    if r is None:
        return "-"
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def autogroup_enabled() -> bool:
    """Whether the kernel shares CPU time between sessions (``sched_autogroup_enabled``)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


SCENARIO = Failure()
