"""The one benchmark driver: a ``Scenario`` supplies the workload, the driver does the rest.

    python bench/run.py <scenario> [--quick] [--repeats N] [--systems a,b] [--json PATH] [...]
    python bench/run.py --list

The driver parses the command line (common flags, then the scenario's own), runs the rounds
interleaved (every part of the scenario - e.g. a world size - runs one round of each system per
repetition; which system goes first alternates per part and swaps every repetition, so drift on
a noisy machine lands on all of them), skips in later rounds of a system a phase that hung,
logs each round's other load on the machine, takes the medians over rounds, prints the table
(the ratio table, per-round values, load and machine lines), the failures, and writes ``--json``.

A scenario is a ``Scenario`` subclass in ``scenarios/<name>.py``, exported as ``SCENARIO``:

    name, systems, peer, part_keys, packages     what is compared, and a round's keys
    make_config(quick), add_args / apply_args    its configuration and extra flags
    parts(cfg), run_round(system, part, cfg, skip) -> round dict
        (results, errors, summaries, hung, load; ``_group.py`` starts and follows processes)
    rows(cfg)                                    table rows: id, label, unit, better, target...
    value / problem / cell                       a row's number from a round, or why missing
    header, table_row, title_lines, notes, fmt   the table (default: the peer-vs-rpcdist layout)

Only the standard library is imported at module level.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any

import _harness as H
from _harness import log

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
# bench/scenarios/<name>.py
SCENARIOS = ("rpc", "c10d", "autograd", "failure", "security", "metrics", "ddp", "workloads")


class Scenario(abc.ABC):
    """A benchmark workload; the defaults give the standard peer-vs-rpcdist table. A scenario
    file implements the abstract methods: its configuration, one round, its rows and title."""

    name = ""
    doc = ""  # the module's docstring; its first paragraph is --help's description
    log_name = "bench"
    systems: tuple[str, ...] = ()
    peer = "torch"  # the system rpcdist is compared with
    part_keys: tuple[str, ...] = ()  # a round's keys besides system and rep (e.g. "world")
    packages: tuple[str, ...] = ("torch", "rpcdist")  # versions recorded in the metadata
    machine_packages: tuple[str, ...] = ("torch", "rpcdist")  # versions on the machine line
    preload: tuple[str, ...] = ("torch",)  # what the forkserver imports once
    warm_forkserver = True  # start the forkserver before the first round
    quick_help = repeats_help = systems_help = ""
    label_width = 48
    right = {2, 3, 4}  # right-aligned table columns
    per_round_heading = "per-round values, in run order:"
    failures_heading = "failures (tracebacks, and stacks for hangs, on stderr and in --json):"

    # ---- configuration -------------------------------------------------------------------------
    def add_args(self, ap: argparse.ArgumentParser) -> None:  # noqa: B027 - optional hook
        """The scenario's own flags (none by default)."""

    @abc.abstractmethod
    def make_config(self, quick: bool) -> dict[str, Any]:
        """The workload's sizes and counts (``quick``: a short run)."""

    def apply_args(  # noqa: B027 - optional hook
        self, cfg: dict[str, Any], args: argparse.Namespace, ap: argparse.ArgumentParser
    ) -> None:
        """Apply the scenario's own flags to ``cfg`` (after --phase-budget; none by default)."""

    def context(self) -> Any:
        return H.forkserver(list(self.preload))

    # ---- rounds --------------------------------------------------------------------------------
    def parts(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        """What one repetition runs a round of each system for (keys: ``part_keys``)."""
        return [{}]

    def part_label(self, part: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in part.items())

    @abc.abstractmethod
    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        """One round of ``system``; ``skip``: phases that hung in its earlier rounds.

        Returns at least results, errors (phase -> text), hung (a phase, a list of them, or
        None) and load (``foreign_load`` or ``load_delta`` numbers, or None)."""

    # ---- the table -----------------------------------------------------------------------------
    @abc.abstractmethod
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        """The table's rows: id, label, unit, which way is better, target."""

    def value(self, row: dict[str, Any], rnd: dict[str, Any]) -> float | None:
        return rnd["results"].get(row["phase"], {}).get(row["key"])

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        """Why ``rnd`` has no value for ``row`` (None: none expected)."""
        return H.problem(rnd["errors"].get(row["phase"], ""))

    def cell(self, row: dict[str, Any], values: list[float], problems: list[str]) -> dict[str, Any]:
        """One system's summary of a row: per-round values, their median, the problems."""
        return {
            "values": values,
            "median": statistics.median(values) if values else None,
            "problems": problems,
        }

    def header(self) -> list[str]:
        return ["metric", "unit", self.peer, "rpcdist", f"rpcdist/{self.peer}", "better when", "verdict"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        p, r = a[self.peer], a["rpcdist"]
        rt = ratio(r["median"], p["median"])
        return [
            row["label"],
            row["unit"],
            self.fmt(p["median"], row, p["problems"]),
            self.fmt(r["median"], row, r["problems"]),
            times(rt),
            row["better"],
            self.verdict(rt, row["better"]),
        ]

    def verdict(self, r: float | None, better: str) -> str:
        return verdict(r, better)

    @abc.abstractmethod
    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        """The lines above the table."""

    def notes(self, meta: dict[str, Any]) -> list[str]:
        """The lines after the table."""
        return []

    def finish(  # noqa: B027 - optional hook
        self, args: argparse.Namespace, rows: list[dict[str, Any]], agg: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """After the table and ``--json``: anything else the run writes (e.g. a plot)."""

    def row_systems(self, row: dict[str, Any]) -> tuple[str, ...]:
        """The systems in a row's per-round values."""
        return self.systems

    def number(self, v: float, row: dict[str, Any]) -> str:
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"

    def fmt(self, v: float | None, row: dict[str, Any], problems: list[str] | None = None) -> str:
        """A value (or the first problem when there is none); ``*``: some rounds failed."""
        if v is None:
            return problems[0] if problems else "-"
        return self.number(v, row) + ("*" if problems else "")


# ------------------------------------------------------------------------------------------------
# table helpers
# ------------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def times(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "-"


def verdict(r: float | None, better: str) -> str:
    """How rpcdist compares, from the ratio rpcdist/peer and the better direction."""
    if r is None or r <= 0:
        return "-"
    if 0.95 <= r <= 1.05:
        return "about equal"
    good = r < 1 if better == "lower" else r > 1
    return f"rpcdist {1 / r if r < 1 else r:.2f}x {'better' if good else 'worse'}"


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def load(name: str) -> Scenario:
    """The scenario ``name`` (one of ``SCENARIOS``)."""
    if name not in SCENARIOS:
        raise KeyError(name)
    if BENCH_DIR not in sys.path:  # children get this sys.path too, so they import these modules
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module(f"scenarios.{name}").SCENARIO


def run_rounds(sc: Scenario, cfg: dict[str, Any], repeats: int, systems: list[str]) -> list[dict[str, Any]]:
    """Every round, interleaved: per repetition and part, each system once."""
    rounds: list[dict[str, Any]] = []
    hung: dict[tuple[Any, ...], set[str]] = {}  # later rounds of a system skip what hung
    parts = sc.parts(cfg)
    try:
        for rep in range(repeats):
            for i, part in enumerate(parts):
                # which system goes first alternates per part and swaps every repetition
                order = list(sc.systems) if (rep + i) % 2 == 0 else list(reversed(sc.systems))
                for system in order:
                    if system not in systems:
                        continue
                    what = " ".join(filter(None, [system, sc.part_label(part)]))
                    log(f"rep {rep + 1}/{repeats}: {what} round")
                    t0 = time.monotonic()
                    skip = hung.setdefault((system, *part.values()), set())
                    res = sc.run_round(system, part, cfg, skip)
                    res.update(system=system, **part, rep=rep, seconds=time.monotonic() - t0)
                    h = res["hung"]
                    skip.update(h if isinstance(h, list) else [h] if h else [])
                    rounds.append(res)
                    groups = f" in {len(res['groups'])} group(s)" if "groups" in res else ""
                    log(
                        f"rep {rep + 1}/{repeats}: {what} round took {res['seconds']:.1f} s{groups}; "
                        f"other load while measuring {H.load_text(res.get('load'))}"
                    )
                    time.sleep(0.5)  # let the exited processes' CPU settle
    finally:
        H.reap_all()
    return rounds


def collect(
    sc: Scenario, rows: list[dict[str, Any]], rounds: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per row and system: the per-round values (run order), their median, and why rounds lack one."""
    agg: dict[str, dict[str, Any]] = {}
    for row in rows:
        agg[row["id"]] = {}
        for system in sc.systems:
            values, problems = [], []
            for rnd in rounds:
                if rnd["system"] != system or any(rnd[k] != row[k] for k in sc.part_keys):
                    continue
                v = sc.value(row, rnd)
                if v is not None:
                    values.append(v)
                    continue
                p = sc.problem(row, rnd)
                if p:
                    problems.append(p)
            agg[row["id"]][system] = sc.cell(row, values, problems)
    return agg


def render(
    sc: Scenario,
    rows: list[dict[str, Any]],
    agg: dict[str, Any],
    meta: dict[str, Any],
    rounds: list[dict[str, Any]],
) -> str:
    table = [sc.table_row(row, agg[row["id"]], agg, meta) for row in rows]
    out = [*sc.title_lines(meta, agg), *H.table_lines(sc.header(), table, sc.right)]
    out += ["", *sc.notes(meta), "", sc.per_round_heading]
    w = sc.label_width
    for row in rows:
        a = agg[row["id"]]
        parts = [
            H.round_values(s, [sc.fmt(v, row) for v in a[s]["values"]], a[s]["problems"])
            for s in sc.row_systems(row)
        ]
        out.append(f"  {row['label']:<{w}s} {' | '.join(parts)}")
    for part in sc.parts(meta["cfg"]):
        parts = []
        for system in sc.systems:
            loads = H.round_loads(
                [r for r in rounds if r["system"] == system and all(r[k] == v for k, v in part.items())]
            )
            if loads:
                parts.append(f"{system}: {' '.join(loads)}")
        label = sc.part_label(part)
        what = (
            f"other load while measuring, {label} (cores)"
            if label
            else "other load while measuring (cores, per round)"
        )
        out.append(f"  {what:<{w}s} {' | '.join(parts)}")
    out.append(H.machine_line(meta, list(sc.machine_packages)))
    return "\n".join(out)


def failures(sc: Scenario, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every failed phase of every round (not the ones skipped because they hung before)."""
    out = []
    for i, rnd in enumerate(rounds):
        for phase, err in rnd["errors"].items():
            if err.startswith("skipped"):
                continue
            lines = err.strip().splitlines() or [""]
            summary = rnd.get("summaries", {}).get(phase) or (
                lines[0] if lines[0].startswith("HANG") else lines[-1]
            )
            part = {k: rnd[k] for k in sc.part_keys}
            out.append(
                {
                    "round": i,
                    "system": rnd["system"],
                    **part,
                    "rep": rnd["rep"],
                    "phase": phase,
                    "summary": summary,
                    "text": err,
                }
            )
    return out


def print_failures(sc: Scenario, fails: list[dict[str, Any]]) -> None:
    """One line per failure on stdout; the full reports on stderr."""
    if not fails:
        return

    def what(f: dict[str, Any], sep: str) -> str:
        return sep.join(
            filter(None, [f["system"], sc.part_label({k: f[k] for k in sc.part_keys}), f"rep {f['rep']}"])
        )

    print()
    print(sc.failures_heading)
    for f in fails:
        print(f"  round {f['round']} ({what(f, ', ')}), phase {f['phase']}: {f['summary']}")
    print("\nfull failure reports:", file=sys.stderr)
    for f in fails:
        print(f"\n=== {what(f, ' ')} phase {f['phase']} ===\n{f['text']}", file=sys.stderr)


def main(name: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run scenario ``name`` with the command line ``argv``; the exit code."""
    sc = load(name)
    H.set_name(sc.log_name)
    ap = argparse.ArgumentParser(prog=prog, description=sc.doc.split("\n\n")[0])
    H.add_common_args(ap, sc.quick_help, sc.repeats_help, sc.systems, sc.systems_help)
    ap.add_argument("--phase-budget", type=float, default=None, help="seconds before a phase counts as hung")
    sc.add_args(ap)
    args = ap.parse_args(argv)

    cfg = sc.make_config(args.quick)
    if args.phase_budget is not None:
        cfg["phase_budget"] = args.phase_budget
    sc.apply_args(cfg, args, ap)
    repeats, systems = H.repeats_and_systems(ap, args, sc.systems)
    H.exit_on_sigterm()
    meta = H.start_meta(args, repeats, cfg, systems, list(sc.packages))
    parts = [sc.part_label(p) for p in sc.parts(cfg) if p]
    log(
        f"start: {repeats} round(s) per system{' and part' if parts else ''}, systems {systems}"
        f"{f', parts {parts}' if parts else ''}, loadavg {os.getloadavg()}, "
        f"machine probe {meta['probe_start']}"
    )
    if sc.warm_forkserver:  # the forkserver imports torch once, before the first round, not inside it
        H.reap([H.start(sc.context(), "forkserver-warmup", H.nothing, ())], cfg["init_budget"])

    rounds = run_rounds(sc, cfg, repeats, systems)
    rows = sc.rows(cfg)
    agg = collect(sc, rows, rounds)
    H.end_meta(meta)
    print(render(sc, rows, agg, meta, rounds))
    fails = failures(sc, rounds)
    print_failures(sc, fails)
    print(f"\ntotal runtime {meta['seconds']:.1f} s")
    sys.stdout.flush()
    if args.json:
        H.write_json(
            args.json, {"meta": meta, "rows": rows, "summary": agg, "rounds": rounds, "failures": fails}
        )
    sc.finish(args, rows, agg, meta)
    return 0


def entry(name: str) -> None:
    """``python bench/<name>_bench.py ...``: run one scenario, no child outliving the run."""
    H.run_main(lambda: main(name, prog=os.path.basename(sys.argv[0])))
