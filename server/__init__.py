"""rpcdist-server: the standalone rendezvous/key-value store service.

Usage::

    rpcdist-server --host 127.0.0.1 --port 29500 [--log-level INFO]
    python -m rpcdist.programs.server --port 0        # an ephemeral port

When ready it prints ``rpcdist-server listening on HOST:PORT`` (the real port, also for
``--port 0``) on stdout. SIGTERM or SIGINT stops it gracefully, with exit status 0; an address
that cannot be bound exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from rpcdist.errors import StoreError
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
    return parser.parse_args(argv)


async def serve(host: str, port: int, grace: float) -> int:
    """Run the store server until SIGTERM/SIGINT; returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
    try:
        server = await StoreServer.start(host, port)
    except StoreError as exc:
        log.error("%s", exc)
        return 1
    print(f"rpcdist-server listening on {format_address(host, server.port)}", flush=True)
    try:
        await stop.wait()
        log.info("signal received, stopping (grace %g s)", grace)
    finally:
        await server.stop(grace)
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
        return asyncio.run(serve(args.host, args.port, args.grace))
    return 0
