"""rpcdist-worker: a generic RPC worker that serves calls until it is told to stop.

Usage::

    rpcdist-worker --name trainer1 --rank 1 --world-size 3 --init-method tcp://10.0.0.5:29500 \\
        --import mypkg.functions [--import mypkg.models ...] [--rpc-timeout 60] [--log-level INFO] \\
        [--metrics-port 9100]
    python -m rpcdist.programs.worker ...                    # the same

The ``--import`` modules are imported first (an import that fails exits with status 2), so the
functions and classes they define can be called here by peers. The current directory is on the
import path, as with ``python -m``. ``--rank``/``--world-size`` default to the RANK/WORLD_SIZE
environment variables and ``--init-method`` to ``env://`` (MASTER_ADDR/MASTER_PORT).

Once the group has formed it prints ``rpcdist-worker NAME (rank R/N) ready`` on stdout (and
with ``--metrics-port`` then ``rpcdist-worker NAME metrics on http://HOST:PORT/metrics``) and
serves calls until either

- it receives SIGTERM or SIGINT, or
- a peer calls :func:`request_stop` on it::

      rpc.rpc_sync("trainer1", rpcdist.programs.worker.request_stop)

Then it leaves the group with a graceful ``rpc.shutdown_async()``: that waits for every other
member to shut down too (a barrier, bounded by ``--shutdown-timeout``), so a driver stops its
workers with ``request_stop`` and then calls ``rpc.shutdown()`` itself. Exit status: 0 after a
requested stop, 1 if joining the group failed, 2 for a bad command line or ``--import``. A second
signal exits at once, without waiting for the group (status 128 + signal number).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

# rpcdist.rpc (and with it torch) is imported only once the command line has been checked, so
# --help and usage errors answer at once.
if TYPE_CHECKING:
    from rpcdist.rpc import RpcBackendOptions

log = logging.getLogger("rpcdist.programs.worker")

__all__ = ["main", "parse_args", "request_stop", "serve"]

# The stop event of the worker running in this process (set by serve(), read by request_stop()).
_stop: asyncio.Event | None = None


async def request_stop() -> None:
    """Ask the rpcdist-worker this runs on to leave the group; call it over RPC.

    It returns at once (the reply goes out first); the worker then shuts down gracefully, which
    completes when every member of the group has called ``rpc.shutdown()``.
    """
    if _stop is None:
        raise RuntimeError("request_stop() stops an rpcdist-worker program, and this process is not one")
    if not _stop.is_set():
        log.info("stop requested by a peer")
        _stop.set()


def seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of rpcdist-worker."""
    parser = argparse.ArgumentParser(prog="rpcdist-worker", description="rpcdist RPC worker")
    parser.add_argument("--name", required=True, help="this worker's name in the group")
    parser.add_argument("--rank", type=int, default=-1, help="this worker's rank (default: $RANK)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="number of workers in the group (default: $WORLD_SIZE)"
    )
    parser.add_argument(
        "--init-method",
        default="env://",
        help="where the group meets: env:// (default), tcp://HOST:PORT or file:///PATH",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="module to import before joining, so peers can call its functions (repeatable)",
    )
    parser.add_argument(
        "--rpc-timeout",
        type=seconds,
        default=None,
        help="default timeout of this worker's outgoing calls, seconds; 0: none (default: 60)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=30.0,
        help="seconds the graceful shutdown may wait for the other workers (default: 30)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default: INFO)",
    )
    from rpcdist import metrics, security

    security.add_arguments(parser)
    metrics.add_arguments(parser)
    return parser.parse_args(argv)


def import_modules(names: Sequence[str]) -> bool:
    """Import every module of ``--import``; prints why and returns False at the first failure."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # a module may raise anything, even SystemExit
            if not isinstance(exc, ModuleNotFoundError):
                traceback.print_exc(file=sys.stderr)
            print(
                f"rpcdist-worker: error: cannot import --import module {name!r}: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return False
    return True


async def serve(
    name: str, rank: int, world_size: int | None, options: RpcBackendOptions, shutdown_timeout: float
) -> int:
    """Join the group, serve until asked to stop, then leave it; returns the exit status."""
    import rpcdist.rpc as rpc
    from rpcdist import metrics

    global _stop
    loop = asyncio.get_running_loop()
    stop = _stop = asyncio.Event()
    joining = loop.create_task(
        rpc.init_rpc_async(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    )

    signals: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        if len(signals) > 1:
            log.warning("%s again: exiting without waiting for the group", sig.name)
            sys.stdout.flush()
            os._exit(128 + sig.value)
        log.info("%s received: leaving the group", sig.name)
        stop.set()
        # A signal may come while the group is still forming, which can take long (or never end).
        # request_stop() cannot: a peer reaches this worker only after everyone has joined.
        joining.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-POSIX
            signal.signal(sig, lambda *_, s=sig: loop.call_soon_threadsafe(on_signal, s))
    try:
        try:
            await joining
        except asyncio.CancelledError:
            if not joining.cancelled() or not stop.is_set():
                raise  # this coroutine itself was cancelled
            log.info("stopped before the group had formed")
            return 0
        except Exception as exc:
            log.error("%s could not join the group: %s: %s", name, type(exc).__name__, exc)
            return 1
        me = rpc.get_worker_info()
        size = len(rpc.get_all_worker_infos())
        print(f"rpcdist-worker {me.name} (rank {me.id}/{size}) ready", flush=True)
        if metrics.address():
            print(f"rpcdist-worker {me.name} metrics on http://{metrics.address()}/metrics", flush=True)
        await stop.wait()
        log.info("%s leaving the group (waiting up to %g s for the others)", me.name, shutdown_timeout)
        await rpc.shutdown_async(graceful=True, timeout=shutdown_timeout)
        log.info("%s stopped", me.name)
        return 0
    finally:
        _stop = None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rpcdist-worker`` console script."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not import_modules(args.imports):
        return 2
    from rpcdist import security
    from rpcdist.rpc import RpcBackendOptions

    try:
        credentials = security.from_arguments(args)
    except ValueError as exc:
        print(f"rpcdist-worker: {exc}", file=sys.stderr)
        return 2
    options = RpcBackendOptions(
        init_method=args.init_method,
        auth_token=credentials.token,
        tls_cert=credentials.tls_cert,
        tls_key=credentials.tls_key,
        tls_ca=credentials.tls_ca,
        metrics_port=args.metrics_port,
    )
    if args.rpc_timeout is not None:
        options.rpc_timeout = args.rpc_timeout
    with contextlib.suppress(KeyboardInterrupt):  # a SIGINT before the handlers were installed
        return asyncio.run(serve(args.name, args.rank, args.world_size, options, args.shutdown_timeout))
    return 0
