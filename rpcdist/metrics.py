"""Prometheus metrics of this process, served over HTTP; off unless asked for.

Turn it on with ``RpcBackendOptions(metrics_port=P)``, the environment variable
``RPCDIST_METRICS_PORT`` (plus ``LOCAL_RANK`` when set, so the workers of one host do not
collide), or ``--metrics-port`` of ``rpcdist-server``/``rpcdist-worker``; port 0 picks a free
one (see :func:`address`). Then ``GET http://HOST:PORT/metrics`` answers in Prometheus' text
format.

The layers that know record through this one module: the agent (calls made and served), the
transport (bytes per peer), the collectives (op timings) and the store service (requests).
Each hot path only reads :data:`current` and does nothing more when it is ``None`` (metrics
off). State that already exists somewhere (calls in flight, live RRefs, each peer's heartbeat
state) is not counted on the hot path at all: it is read from every live agent's
``status()`` when Prometheus scrapes.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

__all__ = [
    "ENV_PORT",
    "Metrics",
    "address",
    "current",
    "enable",
    "port_from_env",
    "release",
    "track",
]

ENV_PORT = "RPCDIST_METRICS_PORT"

# RPC round trips on one host take tens of microseconds; across hosts up to seconds.
LATENCY_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip

current: Metrics | None = None
"""The metrics of this process while its endpoint runs, else ``None`` (the hot paths' check)."""

_lock = threading.Lock()
_users = 0
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()


class StatusSource(Protocol):
    """What :func:`track` watches (an agent): its state now, as ``Agent.status()`` reports it."""

    def status(self) -> dict[str, Any]: ...


class _Histogram:
    """Observations in ``LATENCY_BUCKETS`` (non-cumulative counts, the last one is +Inf)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # le: the first bound >= it
        self.sum += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus' cumulative ``(le, count)`` pairs."""
        running, pairs = 0, []
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.counts, strict=True):
            running += count
            pairs.append((bound, running))
        return pairs


class CallStats:
    """Outgoing calls of one (function, peer)."""

    __slots__ = ("started", "finished", "failed", "seconds")

    def __init__(self) -> None:
        self.started = self.finished = 0
        self.failed: dict[str, int] = {}  # by the error's type name
        self.seconds = _Histogram()


class ServedStats:
    """Calls of one (function, caller) run for peers."""

    __slots__ = ("ok", "error", "seconds")

    def __init__(self) -> None:
        self.ok = self.error = 0
        self.seconds = _Histogram()


class CallTimer:
    """One outgoing call's metrics: started when made, finished or failed once."""

    __slots__ = ("_stats", "_started")

    def __init__(self, stats: CallStats) -> None:
        stats.started += 1
        self._stats = stats
        self._started = time.perf_counter()

    def finished(self) -> None:
        self._stats.finished += 1
        self._stats.seconds.observe(time.perf_counter() - self._started)

    def failed(self, error: BaseException) -> None:
        failed = self._stats.failed
        kind = type(error).__name__
        failed[kind] = failed.get(kind, 0) + 1
        self._stats.seconds.observe(time.perf_counter() - self._started)


class Traffic:
    """Bytes of frames to and from one peer (``sent += n``, ``received += n``)."""

    __slots__ = ("sent", "received")

    def __init__(self) -> None:
        self.sent = self.received = 0


class Metrics:
    """The metrics of one process: a registry of its own, served by :func:`enable`.

    Calls and bytes are counted in plain integers on the agents' event loops (the only threads
    that touch them) and turned into Prometheus samples when scraped: a prometheus_client child
    costs a lock per update, which is too much for the ~5 updates of every round trip within
    the 5 % budget. Collectives and store requests, far fewer, use prometheus_client's own.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collective_seconds = Histogram(
            "rpcdist_collective_duration_seconds",
            "Time of each collective operation on this rank, by op and outcome (ok/error)",
            ["op", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.store_seconds = Histogram(
            "rpcdist_store_request_duration_seconds",
            "Requests the store server answered, by method and outcome (ok/error)",
            ["method", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.calls: dict[tuple[str, str], CallStats] = {}
        self.served: dict[tuple[str, str], ServedStats] = {}
        self.peers: dict[str, Traffic] = {}
        self.registry.register(_CallCollector(self))
        self.registry.register(_StateCollector())

    def call_started(self, function: str, peer: str) -> CallTimer:
        """Count a call to ``peer`` as started; the returned timer ends it (loop only)."""
        stats = self.calls.get((function, peer))
        if stats is None:
            stats = self.calls[(function, peer)] = CallStats()
        return CallTimer(stats)

    def call_served(self, function: str, peer: str, ok: bool, seconds: float) -> None:
        """A call from ``peer`` was answered after ``seconds`` (``ok``: with a result; loop only)."""
        stats = self.served.get((function, peer))
        if stats is None:
            stats = self.served[(function, peer)] = ServedStats()
        if ok:
            stats.ok += 1
        else:
            stats.error += 1
        stats.seconds.observe(seconds)

    def traffic(self, peer: str) -> Traffic:
        """The byte counters of ``peer``'s connections."""
        found = self.peers.get(peer)
        if found is None:
            found = self.peers[peer] = Traffic()
        return found


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: _Histogram) -> None:
    family.add_metric(labels, histogram.buckets(), histogram.sum)


class _CallCollector(Collector):
    """Samples of the calls and bytes counted in :class:`Metrics`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self._metrics
        pair = ["function", "peer"]
        started = CounterMetricFamily(
            "rpcdist_rpc_calls_started", "Calls this worker made, by function and callee", labels=pair
        )
        finished = CounterMetricFamily(
            "rpcdist_rpc_calls_finished", "Calls that returned a result", labels=pair
        )
        failed = CounterMetricFamily(
            "rpcdist_rpc_calls_failed",
            "Calls that ended with an error (remote exception, timeout, lost worker), by its type",
            labels=[*pair, "error"],
        )
        seconds = HistogramMetricFamily(
            "rpcdist_rpc_call_duration_seconds",
            "Time from sending a call to its result or error, as the caller sees it",
            labels=pair,
        )
        # list(): one atomic copy, while the loop may add entries
        for (function, peer), stats in list(m.calls.items()):
            started.add_metric([function, peer], stats.started)
            finished.add_metric([function, peer], stats.finished)
            for error, count in list(stats.failed.items()):
                failed.add_metric([function, peer, error], count)
            _histogram(seconds, [function, peer], stats.seconds)
        served = CounterMetricFamily(
            "rpcdist_rpc_served",
            "Calls this worker ran for peers, by function, caller and outcome (ok/error)",
            labels=[*pair, "outcome"],
        )
        serve_seconds = HistogramMetricFamily(
            "rpcdist_rpc_serve_duration_seconds",
            "Time from a call's arrival to its answer, on the callee",
            labels=pair,
        )
        for (function, peer), stats in list(m.served.items()):
            served.add_metric([function, peer, "ok"], stats.ok)
            served.add_metric([function, peer, "error"], stats.error)
            _histogram(serve_seconds, [function, peer], stats.seconds)
        sent = CounterMetricFamily(
            "rpcdist_transport_sent_bytes",
            "Bytes of frames written to a peer's connections (shared-memory handoffs not included)",
            labels=["peer"],
        )
        received = CounterMetricFamily(
            "rpcdist_transport_received_bytes",
            "Bytes of frames read from a peer's connections (shared-memory handoffs not included)",
            labels=["peer"],
        )
        for peer, traffic in list(m.peers.items()):
            sent.add_metric([peer], traffic.sent)
            received.add_metric([peer], traffic.received)
        yield from (started, finished, failed, seconds, served, serve_seconds, sent, received)


class _StateCollector(Collector):
    """Gauges read from every tracked agent's ``status()`` at scrape time."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "rpcdist_rpc_calls_in_flight", "Calls this worker made that have not ended", labels=["worker"]
        )
        running = GaugeMetricFamily(
            "rpcdist_rpc_calls_running", "Calls from peers this worker is running now", labels=["worker"]
        )
        owned = GaugeMetricFamily(
            "rpcdist_rrefs_owned", "RRef values owned (kept alive) by this worker", labels=["worker"]
        )
        held = GaugeMetricFamily(
            "rpcdist_rrefs_held", "Live user RRefs held by this worker", labels=["worker"]
        )
        peer_up = GaugeMetricFamily(
            "rpcdist_peer_up",
            "1 while the peer answers (its link is open, or it was never needed), 0 once it is given "
            "up on (lost connection or unanswered heartbeats)",
            labels=["worker", "peer", "state"],
        )
        heard = GaugeMetricFamily(
            "rpcdist_peer_last_heard_seconds",
            "Seconds since the peer last sent anything on this worker's link to it",
            labels=["worker", "peer"],
        )
        for source in list(_tracked):
            try:
                status = source.status()
            except Exception as exc:  # noqa: BLE001 - a closing agent must not break the scrape
                log.debug("metrics: status of %r unavailable: %s", source, exc)
                continue
            worker = status["name"]
            counts = status["counts"]
            in_flight.add_metric([worker], counts.get("calls_in_flight", 0))
            running.add_metric([worker], counts.get("calls_running", 0))
            if "owned_rrefs" in counts:
                owned.add_metric([worker], counts["owned_rrefs"])
                held.add_metric([worker], counts["user_rrefs"])
            for peer in status["peers"]:
                up = peer["state"] not in ("lost", "unresponsive")
                peer_up.add_metric([worker, peer["name"], peer["state"]], 1.0 if up else 0.0)
                if peer["seconds_since_heard"] is not None:
                    heard.add_metric([worker, peer["name"]], peer["seconds_since_heard"])
        yield from (in_flight, running, owned, held, peer_up, heard)


_server: Any = None
_thread: threading.Thread | None = None
_address = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` (the programs' shared flag; read it with :func:`port_from_env` as
    the fallback)."""

    def port(text: str) -> int:
        value = int(text)
        if not 0 <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free one), not {text}")
        return value

    parser.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; default: "
        "$RPCDIST_METRICS_PORT, else off)",
    )


def port_from_env() -> int | None:
    """The port ``RPCDIST_METRICS_PORT`` asks for (``+ LOCAL_RANK`` when that is set and the
    port is not 0), or ``None`` when it is unset or empty. ValueError when it is not a port."""
    text = os.environ.get(ENV_PORT, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{ENV_PORT} must be a port number (0: any free one), not {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_PORT} must be a port number in 0..65535, not {port}")
    local_rank = os.environ.get("LOCAL_RANK", "")
    if port and local_rank.isdigit():
        port += int(local_rank)
    return port


def enable(port: int, host: str = "0.0.0.0") -> str:
    """Serve this process's metrics on ``host:port`` (0: a free port); returns ``host:port``.

    Every call must be matched by a :func:`release`; the endpoint stops with the last one.
    A process serves one endpoint: while it runs, a later call shares it whatever its port.
    Raises OSError naming the address when it cannot be bound.
    """
    global current, _users, _server, _thread, _address
    if port < 0 or port > 65535:
        raise ValueError(f"metrics port must be in 0..65535, not {port}")
    with _lock:
        if _server is None:
            metrics = Metrics()
            try:
                _server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
                ) from exc
            bound = _server.server_address[1]
            _address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
            current = metrics
            log.info("metrics on http://%s/metrics", _address)
        _users += 1
        return _address


def release() -> None:
    """Drop one :func:`enable`; the last one stops the endpoint (its port is closed)."""
    global current, _users, _server, _thread, _address
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users or _server is None:
            return
        server, thread = _server, _thread
        current, _server, _thread, _address = None, None, None, ""
    server.shutdown()
    server.server_close()
    if thread is not None:
        thread.join(timeout=5.0)


def address() -> str:
    """``host:port`` of this process's metrics endpoint, or ``""`` when metrics are off."""
    return _address


def track(source: StatusSource) -> None:
    """Report ``source``'s ``status()`` (an agent's) at every scrape while it lives (weakly held)."""
    _tracked.add(source)
