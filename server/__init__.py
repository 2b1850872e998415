"""rpcdist-server: the standalone rendezvous/key-value store service.

Usage::

    rpcdist-server --host 127.0.0.1 --port 29500 [--log-level INFO]
    rpcdist-server --port 29500 --data-dir /var/lib/rpcdist   # keys survive a crash/restart
    rpcdist-server --port 29500 --metrics-port 9100            # Prometheus metrics of the store
    python -m rpcdist.programs.server --port 0        # an ephemeral port

When ready it prints ``rpcdist-server listening on HOST:PORT`` (the real port, also for
``--port 0``) on stdout, and with ``--metrics-port`` then ``rpcdist-server metrics on
http://HOST:PORT/metrics``. SIGTERM or SIGINT stops it gracefully, with exit status 0; an address
that cannot be bound, or a data directory that is in use or corrupt, exits with status 1.

Without ``--data-dir`` the keys live in memory only and nothing is written anywhere. With it,
every change is logged in that directory and synced to disk before it is answered (concurrent
writers share syncs), the log is compacted into a snapshot once it exceeds
``--wal-max-bytes``, and a restart (even after ``kill -9``) recovers every acknowledged key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from rpcdist import metrics
from rpcdist.errors import StoreError
from rpcdist.store.durable import DEFAULT_WAL_MAX_BYTES
from rpcdist.store.service import StoreServer, format_address

log = logging.getLogger("rpcdist.programs.server")

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of rpcdist-server."""
    parser = argparse.ArgumentParser(prog="rpcdist-server", description="rpcdist rendezvous/store server")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29500, help="port to listen on; 0 picks a free one")
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default: INFO)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds in-flight calls get to finish on shutdown (default: 2)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="keep the keys durable in this directory (created if needed; one server at a time): "
        "every change is synced to disk before it is answered and recovered on restart. "
        "Default: in memory only",
    )
    parser.add_argument(
        "--wal-max-bytes",
        type=_positive_int,
        default=DEFAULT_WAL_MAX_BYTES,
        help="with --data-dir: log size that triggers a snapshot and a fresh log "
        f"(default: {DEFAULT_WAL_MAX_BYTES}, or the last snapshot's size if larger)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; default: "
        "$RPCDIST_METRICS_PORT, else off)",
    )
    return parser.parse_args(argv)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free one), not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, not {text}")
    return value


async def serve(
    host: str,
    port: int,
    grace: float,
    data_dir: str | None = None,
    wal_max_bytes: int = DEFAULT_WAL_MAX_BYTES,
    metrics_port: int | None = None,
) -> int:
    """Run the store server until SIGTERM/SIGINT; returns the exit status.

    With ``data_dir`` the keys are durable there (see :mod:`rpcdist.store.durable`); with
    ``metrics_port`` its requests are counted and served to Prometheus on ``host``.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
    if metrics_port is not None:
        try:
            metrics.enable(metrics_port, host)
        except OSError as exc:
            log.error("%s", exc)
            return 1
    try:
        if data_dir is None:
            server = await StoreServer.start(host, port)
        else:
            server = await StoreServer.start(host, port, data_dir=data_dir, wal_max_bytes=wal_max_bytes)
    except StoreError as exc:
        log.error("%s", exc)
        if metrics_port is not None:
            metrics.release()
        return 1
    print(f"rpcdist-server listening on {format_address(host, server.port)}", flush=True)
    if metrics_port is not None:
        print(f"rpcdist-server metrics on http://{metrics.address()}/metrics", flush=True)
    try:
        await stop.wait()
        log.info("signal received, stopping (grace %g s)", grace)
    finally:
        await server.stop(grace)
        if metrics_port is not None:
            metrics.release()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rpcdist-server`` console script."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    with contextlib.suppress(KeyboardInterrupt):  # a SIGINT before the handlers were installed
        metrics_port = args.metrics_port if args.metrics_port is not None else metrics.port_from_env()
        return asyncio.run(
            serve(args.host, args.port, args.grace, args.data_dir, args.wal_max_bytes, metrics_port)
        )
    return 0
