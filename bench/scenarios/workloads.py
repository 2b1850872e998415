"""The workloads rpcdist is for (RL, pipeline-parallel, RRef-heavy, scaling) vs torch.distributed.rpc.

    python bench/run.py workloads [--quick] [--repeats N] [--path cross-host] [--json out.json]
                                  [--plot out.png] [--workloads rl,pipeline,rref,scale,ps]

Each workload is written once (``scenarios/_workload_workers.py``; the PS groups reuse
``scenarios/_autograd_workers.py``) and run with rpcdist or with torch.distributed.rpc (TensorPipe)
+ torch.distributed.autograd + torch.distributed.optim; only the imports differ.

  rl<n>        RL actor/observer: one agent, n observers. Every environment step is an observer's
               ``agent_rref.rpc_sync().select_action(...)`` (a small MLP whose autograd graph stays on
               the agent); the environment is a synthetic fixed-cost step (no gym); each episode ends
               with REINFORCE on the agent. Environment steps/s, and the p50/p99 of one step's call.
  pipeline<s>  s stages as RRef-held modules on their own workers, a driver cutting each batch into
               1, 4 and 8 micro-batches (``remote().forward`` through the stages, ``rpc_async`` on
               the last), distributed autograd + DistributedOptimizer(SGD). Samples/s.
  rref         an owner and N users: every user runs ``remote()`` -> proxy call -> ``to_here()`` ->
               drop; then the owner fans one RRef out to every user, who forks it on to the next
               user, who calls through it. Lifecycles/s, fan-outs/s, and the owner's live RRef
               count after the run (waited for, bounded): it must be 0.
  scale<w>     w workers, all-to-all ``rpc_async`` no-ops (a window in flight per worker, all
               starting together): aggregate calls/s, a curve over w; then the CPU each worker
               burns while idle (% of one core, the busiest worker).
  ps<t>        parameter-server training with t trainers (the ``autograd`` scenario's workload).

``--path cross-host`` runs both systems on what crosses a network even on one host (torch:
TensorPipe uv transport + basic channel; rpcdist: gRPC links, no shared memory), as the ``rpc``
scenario does; with ``--cross-host-carrier tcp``, rpcdist's framed TCP links (``transport="tcp"``)
instead of gRPC. ``--plot`` draws the ratio per workload and the scaling curve of both systems.

A round is one group (one system, one workload, fresh processes on 127.0.0.1, a fresh rendezvous
on an ephemeral port), reaped before the next round; the two systems' rounds alternate per
workload and which goes first swaps every repetition. One intra-op torch thread per process.
"""

from __future__ import annotations

import argparse
from typing import Any

import _harness as H
from _driver import Scenario, ratio, times
from _group import Follower, run_ranks
from _harness import log

from scenarios import _autograd_workers as AW
from scenarios import _rpc_workers as RW
from scenarios import _workload_workers as W
from scenarios import autograd as autograd_scenario

WORKLOADS = ("rl", "pipeline", "rref", "scale", "ps")
TARGET = 1.2  # every workload's throughput, as a multiple of torch's (issue 17)
IDLE_TARGET_PCT = 1.0  # an idle worker's CPU, % of one core


class WorkloadFollower(Follower):
    """One group: per-rank results; "scale" ranks start together and idle together."""

    def __init__(self, tag: str, cfg: dict[str, Any], workload: str) -> None:
        world = W.world_of(workload, cfg)
        super().__init__(tag, cfg, [W.worker_name(workload, r) for r in range(world)])
        self.workload = workload
        self.out["results"] = self.reports
        self.waiting: dict[str, set[int]] = {"ready": set(), "idle": set()}

    def on_result(self, rank: int, phase: str, result: Any, now: float) -> None:
        if phase in ("init", "shutdown", "scale_setup", "rl_warmup") or (
            W.kind_of(self.workload)[0] == "scale" and rank != 0
        ):
            return
        nums = ", ".join(f"{k} {v:,.4g}" for k, v in result.items() if isinstance(v, float))
        log(f"  {self.tag} {self.labels[rank]:9s} {phase:10s} {nums}  ({now - self.started[rank]:.1f} s)")

    def on_message(self, rank: int, msg: tuple[Any, ...]) -> None:
        if msg[0] not in self.waiting:
            return
        got = self.waiting[msg[0]]
        got.add(rank)
        self.where[rank] = f"waiting for every rank to be {msg[0]}"
        if len(got) < self.world:
            return
        if msg[0] == "ready":  # all links are up: measure from one instant on every rank
            import time

            t0 = time.monotonic() + 0.05
            for c in self.conns:
                c.send(("go", t0, self.cfg["window"]))
            return
        self.out["idle_pct"] = idle_cpu(self.procs, self.cfg["idle_seconds"])
        for c in self.conns:
            c.send(("go",))


def idle_cpu(procs: list[Any], seconds: float) -> list[float]:
    """% of one core each process burns over ``seconds`` with nothing in flight (its threads'
    run time in ns: clock ticks would quantise 2 s into steps of 0.5 %)."""
    import time

    before = [H.sched_seconds(p.pid) for p in procs]
    t0 = time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - t0
    return [100 * (H.sched_seconds(p.pid) - b) / took for p, b in zip(procs, before, strict=True)]


def round_metrics(workload: str, g: dict[str, Any], cfg: dict[str, Any]) -> dict[str, float]:
    """A group's numbers, keyed by the rows' ``metric``."""
    kind, n = W.kind_of(workload)
    res = g["results"]
    m: dict[str, float] = {}

    def rank0(phase: str) -> dict[str, Any]:
        return res.get(phase, {}).get(0) or {}

    if kind == "rl":
        m.update(
            {k: v for k, v in rank0("rl").items() if k in ("env_steps_per_s", "step_p50_us", "step_p99_us")}
        )
    elif kind == "pipeline":
        for micro in cfg["pipe_micro"]:
            if "samples_per_s" in rank0(f"mb{micro}"):
                m[f"mb{micro}_samples_per_s"] = rank0(f"mb{micro}")["samples_per_s"]
    elif kind == "rref":
        for phase, key in (
            ("lifecycles", "lifecycles_per_s"),
            ("fanout", "fanouts_per_s"),
            ("release", "owned_after"),
        ):
            if key in rank0(phase):
                m[key] = rank0(phase)[key]
    elif kind == "scale":
        per = res.get("all_to_all", {})
        if len(per) == n:
            took = max(r["end"] for r in per.values()) - min(r["start"] for r in per.values())
            m["calls_per_s"] = sum(r["calls"] for r in per.values()) / took
        if g.get("idle_pct"):
            m["idle_pct"] = max(g["idle_pct"])
    else:
        got = autograd_scenario.round_metrics("ps", res, cfg, world=n + 1)
        if "ps_steps_per_s" in got:
            m["steps_per_s"] = got["ps_steps_per_s"]
    return m


class Workloads(Scenario):
    name = "workloads"
    doc = __doc__
    log_name = "workloads-bench"
    systems = ("torch", "rpcdist")
    part_keys = ("workload",)
    preload = ("torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim")
    quick_help = "one round per system, the smallest sizes, short windows: about a minute"
    repeats_help = "rounds per system and workload (default 5; 1 with --quick)"
    systems_help = "comma-separated subset of torch,rpcdist (rows stay)"
    label_width = 52
    right = {2, 3, 4}

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--path",
            choices=("same-host", "cross-host"),
            default="same-host",
            help="same-host: each system's defaults; cross-host: torch _transports=['uv'], "
            "_channels=['basic'] vs rpcdist transport='grpc', shm_threshold_bytes=0",
        )
        RW.add_carrier_arg(ap)
        ap.add_argument(
            "--workloads",
            default=",".join(WORKLOADS),
            help=f"comma-separated subset of {','.join(WORKLOADS)}",
        )
        ap.add_argument("--window", type=float, default=None, help="seconds measured per phase")
        ap.add_argument(
            "--scale-worlds", default=None, help="worker counts of the scale curve, e.g. 2,4,8,16"
        )
        ap.add_argument("--plot", default=None, metavar="PNG", help="draw the ratios and the scaling curve")

    def make_config(self, quick: bool) -> dict[str, Any]:
        ps = autograd_scenario.SCENARIO.make_config(quick)  # the PS workload's model and data
        cfg: dict[str, Any] = {
            **{k: ps[k] for k in ("dims", "batch", "n_batches", "lr", "ps_warmup")},
            "seed": 0,
            "rl_obs_dim": 4,
            "rl_hidden": 128,
            "rl_actions": 2,
            "rl_lr": 1e-2,
            "rl_gamma": 0.99,
            "rl_env_step_us": 20.0,
            "pipe_width": 128,
            "pipe_batch": 64,
            "pipe_lr": 0.01,
            "scale_inflight": 16,
        }
        if quick:
            cfg.update(
                workloads=list(WORKLOADS),
                rl_observers=[2],
                rl_steps=10,
                rl_warmup_episodes=1,
                rl_min_episodes=2,
                pipe_stages=[2],
                pipe_micro=[1, 4],
                pipe_warmup=2,
                pipe_min_iters=2,
                rref_users=2,
                scale_worlds=[2, 3],
                ps_trainers=2,
                ps_warmup=5,
                window=0.5,
                idle_seconds=1.0,
                release_budget=10.0,
                phase_budget=40.0,
                init_budget=60.0,
                error_grace=5.0,
            )
        else:
            cfg.update(
                workloads=list(WORKLOADS),
                rl_observers=[1, 4, 8],
                rl_steps=50,
                rl_warmup_episodes=2,
                rl_min_episodes=3,
                pipe_stages=[2, 3],
                pipe_micro=[1, 4, 8],
                pipe_warmup=5,
                pipe_min_iters=5,
                rref_users=4,
                scale_worlds=[2, 4, 8, 16],
                ps_trainers=8,
                window=4.0,
                idle_seconds=2.0,
                release_budget=30.0,
                phase_budget=120.0,
                init_budget=180.0,
                error_grace=10.0,
            )
        return cfg

    def apply_args(self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        cfg["path"] = args.path
        cfg["cross_host_carrier"] = args.cross_host_carrier
        chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in chosen if w not in WORKLOADS]
        if bad or not chosen:
            ap.error(f"--workloads: unknown {bad}; choose from {','.join(WORKLOADS)}")
        cfg["workloads"] = chosen
        if args.window is not None:
            cfg["window"] = args.window
        if args.scale_worlds:
            try:
                worlds = [int(w) for w in args.scale_worlds.split(",")]
            except ValueError:
                ap.error(f"--scale-worlds: not a list of integers: {args.scale_worlds!r}")
            if any(w < 2 for w in worlds):
                ap.error("--scale-worlds: every world needs at least 2 workers")
            cfg["scale_worlds"] = worlds
        cfg["ps_window"] = cfg["window"]
        # Serving ranks wait in rpc.shutdown() while the driver works: bound the whole group.
        cfg["serve_budget"] = (
            cfg["init_budget"] + 6 * (cfg["phase_budget"] + cfg["window"]) + cfg["release_budget"]
        )

    def parts(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        sizes = {
            "rl": cfg["rl_observers"],
            "pipeline": cfg["pipe_stages"],
            "rref": [""],
            "scale": cfg["scale_worlds"],
            "ps": [cfg["ps_trainers"]],
        }
        return [{"workload": f"{kind}{n}"} for kind in cfg["workloads"] for n in sizes[kind]]

    def part_label(self, part: dict[str, Any]) -> str:
        return part["workload"]

    # ---- one round -----------------------------------------------------------------------------
    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        workload = part["workload"]
        if skip:
            return {
                "results": {},
                "errors": {"skipped": "skipped: this workload hung in an earlier round"},
                "summaries": {},
                "hung": None,
                "metrics": {},
                "load": None,
            }
        kind, n = W.kind_of(workload)
        tag = f"{system:7s} {workload:10s}"
        if kind == "ps":
            follower: Follower = autograd_scenario.GroupFollower(tag, cfg, "ps", world=n + 1)
            target: Any = AW.rank_main
            run_as = "ps"
        else:
            follower = WorkloadFollower(tag, cfg, workload)
            target, run_as = W.rank_main, workload
        world = follower.world

        def args_of(rank: int, init: str, conn: Any, stack_file: str, life: Any) -> tuple[Any, ...]:
            return (system, run_as, rank, world, init, cfg, conn, stack_file, life)

        names = [f"{system}-{label}" for label in follower.labels]
        g = run_ranks(self.context(), f"wlbench-{system}-{workload}-", names, target, args_of, follower)
        if not g["clean"]:
            g["load"] = None
        g["metrics"] = round_metrics(workload, g, cfg)
        return g

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []

        def row(rid: str, workload: str, metric: str, label: str, unit: str, better: str, **kw: Any) -> None:
            out.append(
                {
                    "id": rid,
                    "workload": workload,
                    "metric": metric,
                    "label": label,
                    "unit": unit,
                    "better": better,
                    **kw,
                }
            )

        if "rl" in cfg["workloads"]:
            top = max(cfg["rl_observers"])
            for n in cfg["rl_observers"]:
                pre = "rl" if n == top else f"rl{n}"
                what = f"RL, {n} observer{'s' if n > 1 else ''}"
                row(
                    f"{pre}_env_steps_per_s",
                    f"rl{n}",
                    "env_steps_per_s",
                    f"{what}: env steps",
                    "steps/s",
                    "higher",
                    target=TARGET,
                )
                row(
                    f"{pre}_step_p50_us",
                    f"rl{n}",
                    "step_p50_us",
                    f"{what}: one step's call, p50",
                    "µs",
                    "lower",
                )
                row(
                    f"{pre}_step_p99_us",
                    f"rl{n}",
                    "step_p99_us",
                    f"{what}: one step's call, p99",
                    "µs",
                    "lower",
                    target=1.0,
                )
        if "pipeline" in cfg["workloads"]:
            top = (max(cfg["pipe_stages"]), max(cfg["pipe_micro"]))
            for s in cfg["pipe_stages"]:
                for micro in cfg["pipe_micro"]:
                    rid = (
                        "pipeline_samples_per_s"
                        if (s, micro) == top
                        else f"pipeline{s}_mb{micro}_samples_per_s"
                    )
                    row(
                        rid,
                        f"pipeline{s}",
                        f"mb{micro}_samples_per_s",
                        f"pipeline, {s} stages, {micro} micro-batch{'es' if micro > 1 else ''}",
                        "samples/s",
                        "higher",
                        target=TARGET,
                    )
        if "rref" in cfg["workloads"]:
            users = cfg["rref_users"]
            row(
                "rref_lifecycles_per_s",
                "rref",
                "lifecycles_per_s",
                f"RRef remote/call/to_here/drop, {users} users",
                "lifecycles/s",
                "higher",
                target=TARGET,
            )
            row(
                "rref_fanouts_per_s",
                "rref",
                "fanouts_per_s",
                f"RRef fan-out to {users} users, forked on",
                "fan-outs/s",
                "higher",
                target=TARGET,
            )
            row(
                "rref_owner_live_after",
                "rref",
                "owned_after",
                "RRef: owner's live RRefs after the run",
                "RRefs",
                "lower",
                must_be=0,
            )
        if "scale" in cfg["workloads"]:
            worlds = cfg["scale_worlds"]
            for w in worlds:
                row(
                    f"scale{w}_calls_per_s",
                    f"scale{w}",
                    "calls_per_s",
                    f"scale, {w} workers: all-to-all rpc_async",
                    "calls/s",
                    "higher",
                    target=1.0,
                    world=w,
                )
            for w in worlds:
                row(
                    f"scale{w}_idle_pct",
                    f"scale{w}",
                    "idle_pct",
                    f"scale, {w} workers: idle CPU, busiest worker (% of a core)",
                    "%",
                    "lower",
                    at_most=IDLE_TARGET_PCT,
                )
        if "ps" in cfg["workloads"]:
            t = cfg["ps_trainers"]
            row(
                f"ps{t}_steps_per_s",
                f"ps{t}",
                "steps_per_s",
                f"PS training, {t} trainers",
                "steps/s",
                "higher",
                target=TARGET,
            )
        return out

    def value(self, row: dict[str, Any], rnd: dict[str, Any]) -> float | None:
        return rnd["metrics"].get(row["metric"])

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        errs = [e for e in rnd["errors"].values() if e]
        return H.problem(errs[0]) if errs else "LOST"

    def header(self) -> list[str]:
        return ["metric", "unit", "torch", "rpcdist", "rpcdist/torch", "target", "met"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        p, r = a["torch"], a["rpcdist"]
        rt = ratio(r["median"], p["median"])
        goal, met = target_of(row, r["median"], rt)
        if "at_most" in row and p["median"] is not None and p["median"] < 0.005:
            rt = None  # a ratio to a value that shows as 0.00 (an idle uv transport) says nothing
        return [
            row["label"],
            row["unit"],
            self.fmt(p["median"], row, p["problems"]),
            self.fmt(r["median"], row, r["problems"]),
            times(rt),
            goal,
            met,
        ]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        cfg = meta["cfg"]
        path = (
            f"cross-host path: rpcdist {RW.carrier_name(cfg)} links, no shared memory vs TensorPipe uv "
            "transport + basic channel"
            if cfg.get("path") == "cross-host"
            else "same-host path: each system's defaults (rpcdist; TensorPipe)"
        )
        missed = []
        for row in self.rows(cfg):
            a = agg[row["id"]]
            _, met = target_of(
                row, a["rpcdist"]["median"], ratio(a["rpcdist"]["median"], a["torch"]["median"])
            )
            if met == "NO":
                missed.append(row["id"])
        return [
            "rpcdist vs torch.distributed.rpc (+ dist autograd, DistributedOptimizer), 127.0.0.1: "
            f"medians over {meta['repeats']} interleaved round(s) per system and workload"
            + (" (--quick)" if meta["quick"] else ""),
            path,
            f"targets missed: {', '.join(missed) if missed else 'none'}",
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        cfg = meta["cfg"]
        return [
            f"RL: policy MLP {cfg['rl_obs_dim']}-{cfg['rl_hidden']}-{cfg['rl_actions']} on the agent, "
            f"{cfg['rl_steps']} steps per episode, env step {cfg['rl_env_step_us']:g} µs of CPU, "
            "REINFORCE (Adam) per episode; steps/s over all observers.",
            f"pipeline: every stage Linear {cfg['pipe_width']}x{cfg['pipe_width']} + ReLU + Linear, batch "
            f"{cfg['pipe_batch']}, SGD; samples/s. scale: {cfg['scale_inflight']} calls in flight per "
            f"worker. PS: the autograd scenario's MLP {'-'.join(map(str, cfg['dims']))}.",
            f"each measurement runs for a {cfg['window']:g} s window. target: throughput >= {TARGET:g}x "
            "torch (scale: >= 1.0x at every size), p99 <= torch's, idle <= 1 % of a core, 0 live RRefs "
            "after the run.",
            "* = some rounds failed; ERR / HANG / SKIP / LOST = no round succeeded (see failures below).",
        ]

    def finish(
        self, args: argparse.Namespace, rows: list[dict[str, Any]], agg: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        if args.plot:
            plot(args.plot, rows, agg, meta)
            log(f"plot written to {args.plot}")


def target_of(row: dict[str, Any], value: float | None, rt: float | None) -> tuple[str, str]:
    """The row's target as text, and whether rpcdist met it ("yes", "NO", or "-": no number)."""
    if "must_be" in row:
        goal, ok = f"= {row['must_be']}", None if value is None else value == row["must_be"]
    elif "at_most" in row:
        goal, ok = f"<= {row['at_most']:g}", None if value is None else value <= row["at_most"]
    elif "target" in row:
        t = row["target"]
        if row["better"] == "higher":
            goal, ok = f">= {t:.2f}x", None if rt is None else rt >= t
        else:
            goal, ok = f"<= {t:.2f}x", None if rt is None else rt <= t
    else:
        return "", ""
    return goal, "-" if ok is None else ("yes" if ok else "NO")


def plot(path: str, rows: list[dict[str, Any]], agg: dict[str, Any], meta: dict[str, Any]) -> None:
    """A PNG: rpcdist/torch per throughput row (left) and the scaling curve of both systems (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (row["label"], ratio(agg[row["id"]]["rpcdist"]["median"], agg[row["id"]]["torch"]["median"]), row)
        for row in rows
        if row["better"] == "higher"
    ]
    bars = [(label, r, row) for label, r, row in bars if r is not None]
    scale = [row for row in rows if "world" in row]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(14, max(4.0, 0.35 * len(bars) + 1.5)), gridspec_kw={"width_ratios": [3, 2]}
    )
    ys = range(len(bars))
    # green: the row's own target met; orange: ahead of torch but short of it; red: behind torch
    colors = [
        "tab:green" if r >= row.get("target", TARGET) else "tab:orange" if r >= 1 else "tab:red"
        for _, r, row in bars
    ]
    left.barh(list(ys), [r for _, r, _ in bars], color=colors)
    left.set_yticks(list(ys), [label for label, _, _ in bars], fontsize=8)
    left.invert_yaxis()
    left.axvline(1.0, color="black", lw=1)
    left.axvline(TARGET, color="tab:green", ls="--", lw=1, label=f"target {TARGET:g}x")
    left.set_xscale("log")  # ratios from well under 1x to tens of x
    left.set_xlabel("rpcdist / torch throughput, log scale (median over rounds)")
    left.legend(loc="lower right", fontsize=8)
    for y, (_, r, _) in zip(ys, bars, strict=True):
        left.text(r, y, f" {r:.2f}x", va="center", fontsize=7)
    if scale:
        for system, style in (("torch", "s--"), ("rpcdist", "o-")):
            pts = [(row["world"], agg[row["id"]][system]["median"]) for row in scale]
            pts = [(w, v) for w, v in pts if v is not None]
            if pts:
                right.plot([w for w, _ in pts], [v for _, v in pts], style, label=system)
        right.set_xscale("log", base=2)
        right.set_xticks([row["world"] for row in scale], [str(row["world"]) for row in scale])
        right.set_xlabel("workers (on this 2-core machine)")
        right.set_ylabel("all-to-all rpc_async calls/s (aggregate)")
        right.set_ylim(bottom=0)
        right.legend()
        right.grid(alpha=0.3)
    else:
        right.set_axis_off()
    path_name = meta["cfg"].get("path", "same-host")
    fig.suptitle(
        f"rpcdist vs torch.distributed.rpc, {path_name} path, medians over {meta['repeats']} round(s)"
        " (shared, loaded machine: ratios, not absolutes)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SCENARIO = Workloads()
