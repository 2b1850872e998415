#!/usr/bin/env python
"""rpcdist's distributed autograd + DistributedOptimizer vs torch's, on the same workload.

    python bench/autograd_bench.py [--quick] [--repeats N] [--json out.json]

The workload is written once (``_autograd_workers.py``) and run with either
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

import _autograd_workers as W  # noqa: E402
import _harness as H  # noqa: E402
from _harness import free_port, load_delta, load_snapshot, log, reap, start  # noqa: E402

SYSTEMS = ("torch", "rpcdist")
SCENARIOS = ("ps", "pipeline")
WORLD = {"ps": 3, "pipeline": 2}
TARGET = 1.0  # rpcdist's PS training throughput, as a multiple of torch's, aimed for
H.set_name("autograd-bench")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def make_config(quick: bool) -> dict[str, Any]:
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
    # The server ranks wait in rpc.shutdown() while the others work: bound the whole group.
    cfg["serve_budget"] = cfg["init_budget"] + 3 * cfg["phase_budget"] + cfg["ps_window"]
    return cfg


def _context() -> Any:
    """A forkserver that has imported torch and torch's RPC / autograd / optim modules
    (``torch.distributed.optim`` alone takes seconds), nothing else: no thread, no gRPC state."""
    return H.forkserver(
        ["torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"]
    )


# ------------------------------------------------------------------------------------------------
# one group: one system, one scenario
# ------------------------------------------------------------------------------------------------
def run_group(system: str, scenario: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Start the scenario's ranks, follow them to the end (or a failure / hang) and reap them."""
    ctx = _context()
    world = WORLD[scenario]
    out: dict[str, Any] = {
        "results": {},  # phase -> rank -> result
        "errors": {},  # phase -> text (every failing rank's traceback, stacks for a hang)
        "summaries": {},  # phase -> one line
        "hung": None,
        "clean": False,
        "load": None,
    }
    procs: list[Any] = []
    conns: dict[Any, int] = {}
    with tempfile.TemporaryDirectory(prefix=f"agbench-{system}-{scenario}-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        life_r, life_w = ctx.Pipe(duplex=False)  # only this process holds life_w
        try:
            init = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(world):
                parent, child = ctx.Pipe()
                p = start(
                    ctx,
                    f"{system}-{W.worker_name(scenario, rank)}",
                    W.rank_main,
                    (system, scenario, rank, world, init, cfg, child, stack_files[rank], life_r),
                )
                child.close()
                procs.append(p)
                conns[parent] = rank
            out["pids"] = [p.pid for p in procs]
            drive(system, scenario, procs, conns, out, cfg, stack_files)
            if not out["clean"]:  # a rank that died or stopped early skews the load figure
                out["load"] = None
        except BaseException as exc:
            out["errors"].setdefault("orchestrator", traceback.format_exc())
            out["summaries"].setdefault("orchestrator", f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            for c in conns:  # a rank waiting after a failure (or for "go"): stop now
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


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def drive(
    system: str,
    scenario: str,
    procs: list[Any],
    conns: dict[Any, int],
    out: dict[str, Any],
    cfg: dict[str, Any],
    stack_files: list[str],
) -> None:
    """Follow every rank until all are done, one fails (plus a grace period for the others to
    report), one dies, or one overruns its phase's budget."""
    world = len(procs)
    names = [W.worker_name(scenario, r) for r in range(world)]
    trainers = [r for r in range(world) if names[r].startswith("trainer")]
    now = time.monotonic()
    where = ["init"] * world
    deadline = [now + cfg["init_budget"]] * world
    started = [now] * world
    done = [False] * world
    gone = [False] * world
    ready: set[int] = set()
    errors: dict[str, dict[int, str]] = {}
    failed_at: tuple[str, float] | None = None
    load_start: dict[str, float] | None = None
    pids = [p.pid for p in procs]
    tag = f"{system:7s} {scenario:8s}"

    def finish() -> None:
        for phase, per_rank in errors.items():
            out["errors"][phase] = "\n".join(
                f"{names[r]}: {tb.rstrip()}" for r, tb in sorted(per_rank.items())
            )
            out["summaries"][phase] = "; ".join(
                f"{names[r]}: {_last_line(tb)}" for r, tb in sorted(per_rank.items())
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
                        f"the process went away during phase {where[rank]!r} "
                        f"(exit code {procs[rank].exitcode})",
                    )
                    if failed_at is None:
                        failed_at = (where[rank], time.monotonic())
                continue
            kind = msg[0]
            now = time.monotonic()
            if kind == "phase":
                where[rank], deadline[rank], started[rank] = msg[1], now + msg[2], now
                if load_start is None and msg[1] not in ("init", "shutdown"):
                    load_start = load_snapshot(pids)
            elif kind == "result":
                out["results"].setdefault(msg[1], {})[rank] = msg[2]
                if msg[1] != "init":
                    took = now - started[rank]
                    log(f"  {tag} {names[rank]:8s} {msg[1]:10s} {summarize(msg[1], msg[2])}  ({took:.1f} s)")
                # the gap up to the rank's next phase is bounded too
                where[rank], deadline[rank], started[rank] = f"after {msg[1]}", now + cfg["phase_budget"], now
            elif kind == "error":
                errors.setdefault(msg[1], {})[rank] = msg[2]
                log(f"  {tag} {msg[1]:10s} FAILED on {names[rank]}: {_last_line(msg[2])}")
                if failed_at is None:
                    failed_at = (msg[1], now)
            elif kind == "ready":
                ready.add(rank)
                where[rank] = "waiting for the other trainers"
                if ready == set(trainers):
                    t0 = time.monotonic() + 0.05
                    for cc, rr in conns.items():
                        if rr in trainers:
                            cc.send(("go", t0, cfg["ps_window"]))
            elif kind == "measured":
                if load_start is not None:  # the last rank to finish measuring sets it
                    out["load"] = load_delta(load_start, load_snapshot(pids))
            elif kind == "done":
                done[rank] = True

        now = time.monotonic()
        if all(done):
            out["clean"] = True
            finish()
            return
        if failed_at is not None:
            phase, t_fail = failed_at
            settled = all(gone[r] or done[r] or any(r in e for e in errors.values()) for r in range(world))
            if settled or now > t_fail + cfg["error_grace"]:
                finish()
                silent = [
                    r
                    for r in range(world)
                    if not (gone[r] or done[r] or any(r in e for e in errors.values()))
                ]
                if silent:  # show where the others wait
                    waiting = ", ".join(f"{names[r]} in {where[r]!r}" for r in silent)
                    stacks = H.dump_stacks(
                        [procs[r] for r in silent], {names[r]: stack_files[r] for r in silent}
                    )
                    out["errors"][phase] += (
                        f"\nstill running {cfg['error_grace']:g} s after the first error: {waiting}\n{stacks}"
                    )
                return
            continue
        late = [r for r in range(world) if not done[r] and not gone[r] and now > deadline[r]]
        if late:
            # Name the hang after a working rank's phase if one is late (a server waiting in
            # shutdown is late only because of them).
            workers = [r for r in late if not W._serves(scenario, r)] or late
            stuck = where[workers[0]]
            stacks = H.dump_stacks(procs, {names[r]: stack_files[r] for r in range(world)})
            waiting = ", ".join(
                f"{names[r]} in {where[r]!r} for {now - started[r]:.0f} s" for r in range(world)
            )
            finish()
            text = f"HANG: phase {stuck!r} did not finish within its budget ({waiting})\n{stacks}"
            out["errors"][stuck] = text + ("\n" + out["errors"][stuck] if out["errors"].get(stuck) else "")
            out["summaries"][stuck] = text.splitlines()[0]
            out["hung"] = stuck
            log(f"  {tag} HANG in phase {stuck!r} ({waiting}); stacks:\n{stacks}")
            return
        dead = [r for r in range(world) if not done[r] and procs[r].exitcode not in (None, 0)]
        if dead:
            for r in dead:
                errors.setdefault(where[r], {}).setdefault(
                    r, f"the process died during phase {where[r]!r} (exit code {procs[r].exitcode})"
                )
            failed_at = (where[dead[0]], now)  # give the others error_grace to report


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


# ------------------------------------------------------------------------------------------------
# one round
# ------------------------------------------------------------------------------------------------
def round_metrics(scenario: str, results: dict[str, dict[int, Any]], cfg: dict[str, Any]) -> dict[str, float]:
    """The table's numbers from one group's per-rank results."""
    m: dict[str, float] = {}
    if scenario == "ps":
        per = results.get("ps_train", {})
        if len(per) == cfg["trainers"]:
            begin = min(r["start"] for r in per.values())
            end = max(r["end"] for r in per.values())
            m["ps_steps_per_s"] = sum(r["steps"] for r in per.values()) / (end - begin)
            m["ps_step_ms"] = statistics.fmean(r["step"]["median_us"] for r in per.values()) / 1e3
    else:
        r = results.get("pipeline", {}).get(0)
        if r is not None:
            m["pipe_autograd_us"] = r["autograd"]["median_us"]
            m["pipe_plain_us"] = r["plain"]["median_us"]
            m["pipe_overhead_us"] = r["overhead_us"]
    return m


def run_round(system: str, scenario: str, cfg: dict[str, Any], skip: bool) -> dict[str, Any]:
    if skip:
        return {
            "results": {},
            "errors": {"skipped": "skipped: this scenario hung in an earlier round"},
            "summaries": {},
            "hung": None,
            "metrics": {},
            "load": None,
        }
    g = run_group(system, scenario, cfg)
    g["metrics"] = round_metrics(scenario, g["results"], cfg)
    return g


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def metric_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": "ps_steps_per_s",
            "scenario": "ps",
            "label": f"(a) PS training, {cfg['trainers']} trainers: aggregate rate",
            "unit": "steps/s",
            "better": "higher",
            "target": TARGET,
        },
        {
            "id": "ps_step_ms",
            "scenario": "ps",
            "label": "(a) PS training: time per step, per trainer",
            "unit": "ms",
            "better": "lower",
        },
        {
            "id": "pipe_autograd_us",
            "scenario": "pipeline",
            "label": "(b) 2-stage iteration with dist autograd",
            "unit": "µs",
            "better": "lower",
        },
        {
            "id": "pipe_plain_us",
            "scenario": "pipeline",
            "label": "(b) same forward, plain RPC, no autograd",
            "unit": "µs",
            "better": "lower",
        },
        {
            "id": "pipe_overhead_us",
            "scenario": "pipeline",
            "label": "(b) distributed autograd overhead per iteration",
            "unit": "µs",
            "better": "lower",
        },
    ]


def collect(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row and system: the per-round values (run order), their median, and why rounds lack one."""
    agg: dict[str, dict[str, Any]] = {}
    for row in rows:
        agg[row["id"]] = {}
        for system in SYSTEMS:
            vals, problems = [], []
            for rnd in rounds:
                if rnd["system"] != system or rnd["scenario"] != row["scenario"]:
                    continue
                v = rnd["metrics"].get(row["id"])
                if v is not None:
                    vals.append(v)
                    continue
                errs = [e for e in rnd["errors"].values() if e]
                problems.append(H.problem(errs[0]) if errs else "LOST")
            agg[row["id"]][system] = {
                "values": vals,
                "median": statistics.median(vals) if vals else None,
                "problems": problems,
            }
    return agg


def fmt(v: float | None, problems: list[str] | None = None) -> str:
    if v is None:
        return problems[0] if problems else "-"
    if abs(v) >= 100:
        s = f"{v:,.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return s + ("*" if problems else "")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def verdict(r: float | None, better: str) -> str:
    if r is None:
        return "-"
    if r <= 0:
        return "-"
    if 0.95 <= r <= 1.05:
        return "about equal"
    good = r < 1 if better == "lower" else r > 1
    factor = 1 / r if r < 1 else r
    return f"rpcdist {factor:.2f}x {'better' if good else 'worse'}"


def render(
    rows: list[dict[str, Any]],
    agg: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    rounds: list[dict[str, Any]],
) -> str:
    cfg = meta["cfg"]
    header = ["metric", "unit", "torch", "rpcdist", "rpcdist/torch", "better when", "verdict"]
    table = []
    for row in rows:
        a = agg[row["id"]]
        t, r = a["torch"]["median"], a["rpcdist"]["median"]
        rt = ratio(r, t)
        table.append(
            [
                row["label"],
                row["unit"],
                fmt(t, a["torch"]["problems"]),
                fmt(r, a["rpcdist"]["problems"]),
                f"{rt:.2f}x" if rt is not None else "-",
                row["better"],
                verdict(rt, row["better"]),
            ]
        )
    head = agg["ps_steps_per_s"]
    got = ratio(head["rpcdist"]["median"], head["torch"]["median"])
    met = "-" if got is None else ("yes" if got >= TARGET else "NO")
    quick = " (--quick)" if meta["quick"] else ""
    arch = "-".join(str(d) for d in cfg["dims"])
    out = [
        "rpcdist vs torch.distributed.rpc + torch.distributed.autograd + torch.distributed.optim."
        f"DistributedOptimizer (TensorPipe defaults), 127.0.0.1: medians over {meta['repeats']} "
        f"interleaved round(s) per system and scenario{quick}",
        f"target: rpcdist's PS training throughput (a) at least {TARGET:.1f}x torch's -> "
        f"{f'{got:.2f}x' if got is not None else 'no number'}, met: {met}",
        *H.table_lines(header, table, right={2, 3, 4}),
        "",
        f"(a) 3 processes (ps + {cfg['trainers']} trainers), MLP {arch} on the PS, batch {cfg['batch']}, SGD "
        f"lr {cfg['lr']}; a step = context, rpc_sync forward, cross-entropy, dist_autograd.backward, "
        f"DistributedOptimizer.step;",
        f"    both trainers train for one {cfg['ps_window']:g} s window after {cfg['ps_warmup']} warm-up "
        "steps each; aggregate = all steps / (last end - common start).",
        f"(b) 2 processes; stage 1 Linear {cfg['dims'][0]}-{cfg['dims'][1]} + ReLU local, stage 2 Linear "
        f"{cfg['dims'][1]}-{cfg['dims'][2]} remote (rpc_sync), batch {cfg['batch']}; with dist autograd = "
        "context + forward + backward + get_gradients;",
        "    plain = the same forward under torch.no_grad(), no context; "
        f"overhead = median(with) - median(plain), {cfg['pipe_blocks']} alternating blocks "
        f"of {cfg['pipe_block_iters']} iterations each.",
        "rpcdist/torch is the ratio of the medians; 'better when' says which direction favours rpcdist. "
        "One intra-op torch thread per process. * = some rounds failed; ERR / HANG / SKIP / LOST = no "
        "round succeeded (see failures below).",
        "",
        "per-round values, in run order:",
    ]
    for row in rows:
        a = agg[row["id"]]
        parts = [H.round_values(s, [fmt(v) for v in a[s]["values"]], a[s]["problems"]) for s in SYSTEMS]
        out.append(f"  {row['label']:<48s} {' | '.join(parts)}")
    for scenario in SCENARIOS:
        parts = []
        for system in SYSTEMS:
            rs = [r for r in rounds if r["system"] == system and r["scenario"] == scenario]
            loads = [
                f"{r['load']['foreign_core_s'] / r['load']['seconds']:.2f}" if r.get("load") else "?"
                for r in rs
            ]
            if loads:
                parts.append(f"{system}: {' '.join(loads)}")
        out.append(f"  {f'other load while measuring, {scenario} (cores)':<48s} {' | '.join(parts)}")
    out.append(H.machine_line(meta, ["torch", "rpcdist"]))
    return "\n".join(out)


def failures(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, rnd in enumerate(rounds):
        for phase, err in rnd["errors"].items():
            if err.startswith("skipped"):
                continue
            summary = rnd["summaries"].get(phase) or err.strip().splitlines()[0]
            out.append(
                {
                    "round": i,
                    "system": rnd["system"],
                    "scenario": rnd["scenario"],
                    "rep": rnd["rep"],
                    "phase": phase,
                    "summary": summary,
                    "text": err,
                }
            )
    return out


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(
        ap,
        quick_help="one round per system and scenario, short windows: < 90 s",
        repeats_help="rounds per system and scenario (default 5; 1 with --quick)",
        systems=SYSTEMS,
        systems_help="comma-separated subset of torch,rpcdist (rows stay)",
    )
    ap.add_argument("--window", type=float, default=None, help="seconds of PS training measured per round")
    ap.add_argument("--phase-budget", type=float, default=None, help="seconds before a phase counts as hung")
    args = ap.parse_args(argv)

    cfg = make_config(args.quick)
    if args.window is not None:
        cfg["ps_window"] = args.window
    if args.phase_budget is not None:
        cfg["phase_budget"] = args.phase_budget
    cfg["serve_budget"] = cfg["init_budget"] + 3 * cfg["phase_budget"] + cfg["ps_window"]
    repeats, systems = H.repeats_and_systems(ap, args, SYSTEMS)
    H.exit_on_sigterm()
    meta = H.start_meta(args, repeats, cfg, systems, ["torch", "rpcdist"])
    log(
        f"start: {repeats} round(s) per system and scenario, systems {systems}, "
        f"loadavg {os.getloadavg()}, machine probe {meta['probe_start']}"
    )

    # Start the forkserver (it imports torch once) before the first round, not inside it.
    warm = start(_context(), "forkserver-warmup", W.nothing, ())
    reap([warm], cfg["init_budget"])

    rounds: list[dict[str, Any]] = []
    hung: set[tuple[str, str]] = set()
    try:
        for rep in range(repeats):
            for si, scenario in enumerate(SCENARIOS):
                # which system goes first alternates per scenario and swaps every repetition
                order = list(SYSTEMS) if (rep + si) % 2 == 0 else list(reversed(SYSTEMS))
                for system in order:
                    if system not in systems:
                        continue
                    log(f"rep {rep + 1}/{repeats}: {system} {scenario} round")
                    t0 = time.monotonic()
                    res = run_round(system, scenario, cfg, (system, scenario) in hung)
                    res.update(system=system, scenario=scenario, rep=rep, seconds=time.monotonic() - t0)
                    if res["hung"]:
                        hung.add((system, scenario))  # later rounds skip it
                    rounds.append(res)
                    load = res.get("load")
                    other = (
                        f"{load['foreign_core_s'] / load['seconds']:.2f} cores, "
                        f"steal {load['steal_core_s'] / load['seconds']:.2f}"
                        if load
                        else "?"
                    )
                    log(
                        f"rep {rep + 1}/{repeats}: {system} {scenario} round took {res['seconds']:.1f} s; "
                        f"other load while measuring {other}"
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
        print("failures (tracebacks, and stacks for hangs, on stderr and in --json):")
        for f in fails:
            print(
                f"  round {f['round']} ({f['system']}, {f['scenario']}, rep {f['rep']}), "
                f"phase {f['phase']}: {f['summary']}"
            )
        print("\nfull failure reports:", file=sys.stderr)
        for f in fails:
            print(
                f"\n=== {f['system']} {f['scenario']} rep {f['rep']} phase {f['phase']} ===\n{f['text']}",
                file=sys.stderr,
            )
    print(f"\ntotal runtime {meta['seconds']:.1f} s")
    sys.stdout.flush()

    if args.json:
        doc = {"meta": meta, "rows": rows, "summary": agg, "rounds": rounds, "failures": fails}
        H.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    H.run_main(main)
