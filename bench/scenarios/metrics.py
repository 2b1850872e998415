"""The cost of metrics: rpcdist's RPC with the Prometheus endpoint on vs off, side by side.

    python bench/run.py metrics [--quick] [--repeats N] [--json out.json]

The rpc scenario's workload and processes (a caller and a callee on 127.0.0.1, a fresh pair
every round), in interleaved rounds of two systems: "off" (the default: no endpoint, every
hot path pays one None check) and "on" (``RpcBackendOptions(metrics_port=0)`` on both: every
call counted and timed on both sides, bytes counted per frame). Measured per round: (a) the
rpc_sync no-op round trip and (b) rpc_async no-op calls/s with 64 in flight. Target: "on"
within 5 % of "off" on (a).
"""

from __future__ import annotations

from typing import Any

from _driver import ratio, times

from scenarios.rpc import Rpc

PHASES = ("sanity", "latency", "calls")


class Metrics(Rpc):
    name = "metrics"
    doc = __doc__
    systems = ("off", "on")
    peer = "off"
    packages = ("torch", "grpcio", "prometheus_client", "rpcdist")
    machine_packages = ("torch", "rpcdist")
    quick_help = "few iterations, one round: < 60 s"
    systems_help = "comma-separated subset of off,on"
    right = {2, 3, 4}

    def add_args(self, ap: Any) -> None:
        """None of the rpc scenario's flags: both systems run the same-host path."""

    def apply_args(self, cfg: dict[str, Any], args: Any, ap: Any) -> None:
        pass

    def make_config(self, quick: bool) -> dict[str, Any]:
        return dict(super().make_config(quick), only=list(PHASES))

    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        return super().run_round("rpcdist", part, dict(cfg, metrics=system == "on"), skip)

    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        rows = [row for row in super().rows(cfg) if row["id"] in ("latency", "calls")]
        rows[0]["target"] = "on/off <= 1.05"
        return rows

    def row_systems(self, row: dict[str, Any]) -> tuple[str, ...]:
        return self.systems

    def header(self) -> list[str]:
        return ["metric", "unit", "metrics off", "metrics on", "on/off", "better when", "overhead"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        off, on = a["off"], a["on"]
        r = ratio(on["median"], off["median"])
        if r is None:
            overhead = "-"
        else:
            cost = r - 1 if row["better"] == "lower" else 1 - r  # > 0: metrics made it worse
            overhead = f"{100 * cost:+.1f} %"
        return [
            row["label"],
            row["unit"],
            self.fmt(off["median"], row, off["problems"]),
            self.fmt(on["median"], row, on["problems"]),
            times(r),
            row["better"],
            overhead,
        ]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        return [
            "rpcdist RPC with the Prometheus endpoint off vs on, 2 processes on 127.0.0.1: medians over "
            f"{meta['repeats']} interleaved round(s) per system{quick}"
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        return [
            "on/off is the ratio of the medians; overhead > 0 means metrics made it slower "
            "(target: <= +5 % on the round trip). * = some rounds failed (see below).",
        ]


SCENARIO = Metrics()
