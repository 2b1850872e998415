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

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
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


class CallTimer:
    """One outgoing call's metrics: started when made, finished or failed once."""

    __slots__ = ("_children", "_started")

    def __init__(self, children: tuple[Any, ...]) -> None:
        self._children = children
        self._started = time.perf_counter()
        children[0].inc()

    def finished(self) -> None:
        _, finished, seconds, _, _, _ = self._children
        finished.inc()
        seconds.observe(time.perf_counter() - self._started)

    def failed(self, error: BaseException) -> None:
        _, _, seconds, function, peer, failed = self._children
        failed.labels(function, peer, type(error).__name__).inc()
        seconds.observe(time.perf_counter() - self._started)


class Metrics:
    """The metric objects of one process, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.calls_started = Counter(
            "rpcdist_rpc_calls_started",
            "Calls this worker made, by function and callee",
            ["function", "peer"],
            registry=reg,
        )
        self.calls_finished = Counter(
            "rpcdist_rpc_calls_finished", "Calls that returned a result", ["function", "peer"], registry=reg
        )
        self.calls_failed = Counter(
            "rpcdist_rpc_calls_failed",
            "Calls that ended with an error (remote exception, timeout, lost worker), by its type",
            ["function", "peer", "error"],
            registry=reg,
        )
        self.call_seconds = Histogram(
            "rpcdist_rpc_call_duration_seconds",
            "Time from sending a call to its result or error, as the caller sees it",
            ["function", "peer"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.served = Counter(
            "rpcdist_rpc_served",
            "Calls this worker ran for peers, by function, caller and outcome (ok/error)",
            ["function", "peer", "outcome"],
            registry=reg,
        )
        self.serve_seconds = Histogram(
            "rpcdist_rpc_serve_duration_seconds",
            "Time from a call's arrival to its answer, on the callee",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.bytes_sent = Counter(
            "rpcdist_transport_sent_bytes",
            "Bytes of frames written to a peer's connections (shared-memory handoffs not included)",
            ["peer"],
            registry=reg,
        )
        self.bytes_received = Counter(
            "rpcdist_transport_received_bytes",
            "Bytes of frames read from a peer's connections (shared-memory handoffs not included)",
            ["peer"],
            registry=reg,
        )
        self.collective_seconds = Histogram(
            "rpcdist_collective_duration_seconds",
            "Time of each collective operation on this rank, by op and outcome (ok/error)",
            ["op", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.store_seconds = Histogram(
            "rpcdist_store_request_duration_seconds",
            "Requests the store server answered, by method and outcome (ok/error)",
            ["method", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        reg.register(_StateCollector())
        # Label children by key: labels() costs a lock and a tuple build per use, these a dict get.
        self._call_children: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._served_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._traffic: dict[str, Traffic] = {}

    def call_started(self, function: str, peer: str) -> CallTimer:
        """Count a call to ``peer`` as started; the returned timer ends it."""
        children = self._call_children.get((function, peer))
        if children is None:
            children = self._call_children[(function, peer)] = (
                self.calls_started.labels(function, peer),
                self.calls_finished.labels(function, peer),
                self.call_seconds.labels(function, peer),
                function,
                peer,
                self.calls_failed,
            )
        return CallTimer(children)

    def call_served(self, function: str, peer: str, ok: bool, seconds: float) -> None:
        """A call from ``peer`` was answered after ``seconds`` (``ok``: with a result)."""
        children = self._served_children.get((function, peer))
        if children is None:
            children = self._served_children[(function, peer)] = (
                self.served.labels(function, peer, "ok"),
                self.served.labels(function, peer, "error"),
                self.serve_seconds.labels(function),
            )
        children[0 if ok else 1].inc()
        children[2].observe(seconds)

    def traffic(self, peer: str) -> Traffic:
        """The byte counters of ``peer``'s connections."""
        found = self._traffic.get(peer)
        if found is None:
            found = self._traffic[peer] = Traffic(
                self.bytes_sent.labels(peer), self.bytes_received.labels(peer)
            )
        return found


class Traffic:
    """Byte counters of one peer (``sent.inc(n)``, ``received.inc(n)``)."""

    __slots__ = ("sent", "received")

    def __init__(self, sent: Any, received: Any) -> None:
        self.sent = sent
        self.received = received


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
