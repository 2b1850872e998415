"""What authentication and TLS cost: rpcdist with no token vs a token vs a token + mTLS.

    python bench/run.py security [--quick] [--repeats N] [--path cross-host|same-host]
                                 [--cross-host-carrier grpc|tcp] [--json out.json]

The same two-process pair as ``bench/run.py rpc`` (rank 0 calls, rank 1 is called, a fresh
pair per round, rounds of the three configurations interleaved), measuring its RPC rows only:

  (a) rpc_sync round trip of a no-op (µs)
  (b) rpc_async no-op calls/s with 64 outstanding futures
  (c) MB/s of one 16 MB float32 tensor sent one way

Configurations (columns): ``plain`` (no token: the group meets through a ``file://`` store,
which generates none), ``token`` (``auth_token=...``: checked once per connection) and
``tls`` (the token plus mTLS with test certificates made by ``cryptography``). The default
path is ``cross-host`` (gRPC links, no shared memory), where TLS applies; on ``same-host``
links are Unix sockets, which carry the token but never TLS (the ``tls`` column then only adds
TLS to the store).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import tempfile
from typing import Any

from _driver import ratio, times
from _harness import MiB

from scenarios._rpc_workers import carrier_name
from scenarios.rpc import Rpc

SIZE = 16 * MiB
_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")


def _make_pki(directory: str) -> dict[str, str]:
    """The tests' certificate maker (tests/_tls.py), so both use the same PKI."""
    spec = importlib.util.spec_from_file_location("_tls", os.path.join(_TESTS, "_tls.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from pathlib import Path

    return module.make_pki(Path(directory))


class Security(Rpc):
    name = "security"
    doc = __doc__
    systems = ("plain", "token", "tls")
    peer = "plain"
    packages = ("torch", "grpcio", "rpcdist", "cryptography")
    machine_packages = ("torch", "grpcio")
    quick_help = "few iterations, one round: < 60 s"
    repeats_help = "rounds per configuration (default 5; 1 with --quick)"
    systems_help = "comma-separated subset of plain,token,tls"
    right = {2, 3, 4, 5, 6}

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        super().add_args(ap)
        ap.set_defaults(path="cross-host")

    def make_config(self, quick: bool) -> dict[str, Any]:
        cfg = super().make_config(quick)
        cfg.update(
            sizes=[SIZE],
            bulk_iters={str(SIZE): 5 if quick else 10},
            only=["sanity", "latency", "calls", f"oneway_{SIZE}"],
        )
        workdir = tempfile.mkdtemp(prefix="rpcdist-bench-security-")
        pki = _make_pki(os.path.join(workdir, "pki"))
        cfg["auth_token"] = secrets.token_urlsafe(32)
        cfg["tls_files"] = [pki["server_cert"], pki["server_key"], pki["ca"]]
        cfg["store_dir"] = workdir
        return cfg

    def init_method(self, cfg: dict[str, Any]) -> str:
        # file://: no store on loopback, so "plain" really runs without a token.
        return f"file://{cfg['store_dir']}/store-{secrets.token_hex(6)}"

    def run_round(
        self, system: str, part: dict[str, Any], cfg: dict[str, Any], skip: set[str]
    ) -> dict[str, Any]:
        return super().run_round("rpcdist", part, dict(cfg, security=system), skip)

    # ---- the table -----------------------------------------------------------------------------
    def rows(self, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        def row(rid: str, label: str, unit: str, better: str, phase: str, key: str) -> dict[str, Any]:
            return {"id": rid, "label": label, "unit": unit, "better": better, "phase": phase, "key": key}

        return [
            row("latency", "(a) rpc_sync no-op round trip", "µs", "lower", "latency", "median_us"),
            row(
                "calls",
                f"(b) rpc_async no-op, {cfg['window']} in flight",
                "calls/s",
                "higher",
                "calls",
                "calls_per_s",
            ),
            row(
                f"oneway_{SIZE}",
                "(c) float32 tensor 16 MB one way",
                "MB/s",
                "higher",
                f"oneway_{SIZE}",
                "MBps",
            ),
        ]

    def problem(self, row: dict[str, Any], rnd: dict[str, Any]) -> str | None:
        return super().problem(row, rnd) if row["phase"] in rnd["errors"] or rnd["hung"] else None

    def row_systems(self, row: dict[str, Any]) -> tuple[str, ...]:
        return self.systems

    def header(self) -> list[str]:
        return ["metric", "unit", "plain", "token", "token/plain", "tls", "tls/plain", "better when"]

    def table_row(
        self, row: dict[str, Any], a: dict[str, Any], agg: dict[str, Any], meta: dict[str, Any]
    ) -> list[str]:
        plain, token, tls = a["plain"], a["token"], a["tls"]
        return [
            row["label"],
            row["unit"],
            self.fmt(plain["median"], row, plain["problems"]),
            self.fmt(token["median"], row, token["problems"]),
            times(ratio(token["median"], plain["median"])),
            self.fmt(tls["median"], row, tls["problems"]),
            times(ratio(tls["median"], plain["median"])),
            row["better"],
        ]

    def title_lines(self, meta: dict[str, Any], agg: dict[str, Any]) -> list[str]:
        quick = " (--quick)" if meta["quick"] else ""
        cfg = meta["cfg"]
        if cfg.get("path") == "cross-host":
            links = f"{carrier_name(cfg)} links, no shared memory"
        else:
            links = "Unix-socket links and shared memory (no TLS on them)"
        return [
            f"rpcdist without auth vs with a token vs token + mTLS ({links}), 2 processes on "
            f"127.0.0.1: medians over {meta['repeats']} interleaved round(s) per configuration{quick}"
        ]

    def notes(self, meta: dict[str, Any]) -> list[str]:
        return [
            "token/plain and tls/plain are ratios of the medians; 'better when' says which direction is "
            "better. The token is checked once per connection (stream metadata or the socket's hello), "
            "never per message; TLS encrypts every byte. MB = 2^20 bytes.",
        ]

    def verdict(self, r: float | None, better: str) -> str:
        return "-"


SCENARIO = Security()
