"""rpcdist-server: the standalone rendezvous/key-value store service.

Usage::

    rpcdist-server --host 127.0.0.1 --port 29500 [--log-level INFO]
    rpcdist-server --port 29500 --data-dir /var/lib/rpcdist   # keys survive a crash/restart
    rpcdist-server --port 29500 --metrics-port 9100            # Prometheus metrics of the store
    python -m rpcdist.programs.server --port 0        # an ephemeral port
    rpcdist-server --host 0.0.0.0 --auth-token-file token --tls-cert c.pem --tls-key k.pem --tls-ca ca.pem
    rpcdist-server --max-key-bytes 4096 --max-value-bytes 1048576 --max-keys 100000

When ready it prints ``rpcdist-server listening on HOST:PORT`` (the real port, also for
``--port 0``) on stdout, and with ``--metrics-port`` then ``rpcdist-server metrics on
http://HOST:PORT/metrics``. SIGTERM or SIGINT stops it gracefully, with exit status 0; an address
that cannot be bound, or a data directory that is in use or corrupt, exits with status 1.

Without ``--data-dir`` the keys live in memory only and nothing is written anywhere. With it,
every change is logged in that directory and synced to disk before it is answered (concurrent
writers share syncs), the log is compacted into a snapshot once it exceeds
``--wal-max-bytes``, and a restart (even after ``kill -9``) recovers every acknowledged key.

``--max-key-bytes``, ``--max-value-bytes`` and ``--max-keys`` cap what clients can make it hold
(see :class:`~rpcdist.store.service.StoreLimits` for the defaults): a request above a cap is
refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the limit, and nothing is stored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from rpcdist import metrics, security
from rpcdist.errors import StoreError
from rpcdist.rendezvous import is_loopback
from rpcdist.store.durable import DEFAULT_WAL_MAX_BYTES
from rpcdist.store.service import StoreLimits, StoreServer, format_address

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
    security.add_arguments(parser)
    defaults = StoreLimits()
    parser.add_argument(
        "--max-key-bytes",
        type=_positive_int,
        default=defaults.max_key_bytes,
        help=f"longest key accepted, in bytes (default: {defaults.max_key_bytes})",
    )
    parser.add_argument(
        "--max-value-bytes",
        type=_positive_int,
        default=defaults.max_value_bytes,
        help=f"largest value accepted, in bytes (default: {defaults.max_value_bytes})",
    )
    parser.add_argument(
        "--max-keys",
        type=_positive_int,
        default=defaults.max_keys,
        help=f"keys the store may hold; requests adding more are refused (default: {defaults.max_keys})",
    )
    metrics.add_arguments(parser)
    return parser.parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


async def serve(
    host: str,
    port: int,
    grace: float,
    data_dir: str | None = None,
    wal_max_bytes: int = DEFAULT_WAL_MAX_BYTES,
    credentials: security.Security | None = None,
    limits: StoreLimits | None = None,
    metrics_port: int | None = None,
) -> int:
    """Run the store server until SIGTERM/SIGINT; returns the exit status.

    With ``data_dir`` the keys are durable there (see :mod:`rpcdist.store.durable`); with
    ``metrics_port`` its requests are counted and served to Prometheus on ``host``.
    ``credentials``: the token every call must carry and the TLS files; without a token, a
    server on loopback makes one and leaves it for this user's workers (see README: Security).
    """
    credentials = credentials or security.Security()
    job_token = credentials.token is None and is_loopback(host)
    if credentials.token is None and not job_token:
        log.warning(
            "no auth token: anyone who can reach %s can read, write and delete keys and join; "
            "pass --auth-token-file (see README: Security)",
            format_address(host, port),
        )
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
            server = await StoreServer.start(
                host, port, security=credentials, job_token=job_token, limits=limits
            )
        else:
            server = await StoreServer.start(
                host,
                port,
                data_dir=data_dir,
                wal_max_bytes=wal_max_bytes,
                security=credentials,
                job_token=job_token,
                limits=limits,
            )
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
    try:
        credentials = security.from_arguments(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    with contextlib.suppress(KeyboardInterrupt):  # a SIGINT before the handlers were installed
        limits = StoreLimits(args.max_key_bytes, args.max_value_bytes, args.max_keys)
        metrics_port = args.metrics_port if args.metrics_port is not None else metrics.port_from_env()
        return asyncio.run(
            serve(
                args.host,
                args.port,
                args.grace,
                args.data_dir,
                args.wal_max_bytes,
                credentials,
                limits,
                metrics_port,
            )
        )
    return 0
