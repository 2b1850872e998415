"""Metrics and status: the Prometheus endpoint of real workers (counters move by the calls
made, failures and bytes counted, live RRefs up and back to 0, collectives timed), off by
default, ``rpcdist-status`` against a running group, reflection and health on every server.

One launch of three workers (``metrics_scenarios.metrics_group``): w0 turns metrics on by
option and drives, w1 by ``RPCDIST_METRICS_PORT``, w2 leaves them off.
"""

from __future__ import annotations

import importlib
import signal
import socket
import subprocess
import urllib.request
from typing import Any

import pytest
from _harness import GroupRun, ProcSpec, run_processes
from test_store import free_port, server_command, stop_process
from test_worker_program import start_worker  # noqa: F401 - the fixture, used below

from rpcdist import metrics
from rpcdist.agent.options import RpcBackendOptions

pytestmark = pytest.mark.timeout(300)


class _ImportInWorker:
    """Unpickled in the worker before its scenario starts, imports the scenarios' module."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        return importlib.import_module, (self.module,)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    params = {"scenarios_module": _ImportInWorker("metrics_scenarios")}
    specs = [ProcSpec("metrics_group", rank, 3, dict(params)) for rank in range(3)]
    return run_processes(tmp_path_factory.mktemp("metrics"), specs, "env", timeout=240)


@pytest.mark.parametrize(
    "name",
    [
        "off_by_default",
        "on_by_option_and_by_env",
        "calls_counted",
        "bytes_per_peer",
        "in_flight_and_peers",
        "collective_timed",
        "live_rrefs_up_and_back_to_zero",
    ],
)
def test_metrics_of_real_workers(group: GroupRun, name: str) -> None:
    group.check(name)


def test_reflection_lists_the_services_of_worker_and_store(group: GroupRun) -> None:
    group.check("reflection_on_worker_and_store")


def test_health_on_workers(group: GroupRun) -> None:
    group.check("health_on_workers")


def test_rpcdist_status_against_a_running_group(group: GroupRun) -> None:
    group.check("rpcdist_status")


def test_rpcdist_status_names_an_unreachable_store(group: GroupRun) -> None:
    group.check("status_store_unreachable")


def test_every_worker_exits_cleanly(group: GroupRun) -> None:
    for outcome in group.outcomes:
        assert outcome.exitcode == 0 and not outcome.killed, outcome.log_tail()


def test_metrics_port_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        RpcBackendOptions(metrics_port=70000)
    monkeypatch.setenv(metrics.ENV_PORT, "nine")
    with pytest.raises(ValueError, match=metrics.ENV_PORT):
        RpcBackendOptions().resolved_metrics_port()
    monkeypatch.setenv(metrics.ENV_PORT, "9100")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert RpcBackendOptions().resolved_metrics_port() == 9102  # workers of one host do not collide
    assert RpcBackendOptions(metrics_port=0).resolved_metrics_port() == 0
    monkeypatch.delenv(metrics.ENV_PORT)
    assert RpcBackendOptions().resolved_metrics_port() is None  # off by default


def test_endpoint_is_shared_and_closed_by_its_last_user() -> None:
    address = metrics.enable(0, "127.0.0.1")
    try:
        assert metrics.enable(0, "127.0.0.1") == address  # one endpoint per process
        metrics.release()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
            assert b"rpcdist_rpc_calls_in_flight" in answer.read()
    finally:
        metrics.release()
    assert metrics.current is None and metrics.address() == ""
    host, port = address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), timeout=30):
        pass


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.enable(port, "127.0.0.1")
    assert metrics.current is None


def _scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read().decode()


@pytest.mark.timeout(180)
def test_programs_take_metrics_port(start_worker: Any) -> None:  # noqa: F811 - the imported fixture
    """rpcdist-server --metrics-port counts the store's requests; rpcdist-worker --metrics-port
    serves the worker's own metrics; both print where."""
    store_port = free_port()
    command = [*server_command(), "--host", "127.0.0.1", "--port", str(store_port), "--metrics-port", "0"]
    server = subprocess.Popen([*command, "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    try:
        # The store first: a worker of rank 0 that finds the port free serves a store itself.
        assert server.stdout is not None
        listening, serving = server.stdout.readline(), server.stdout.readline()
        assert listening.startswith("rpcdist-server listening on "), listening
        assert serving.startswith("rpcdist-server metrics on http://"), serving
        worker = start_worker(
            "--name", "lone", "--rank", "0", "--world-size", "1",
            "--init-method", f"tcp://127.0.0.1:{store_port}", "--metrics-port", "0",
        )  # fmt: skip
        worker.wait_for("rpcdist-worker lone metrics on http://")
        worker_url = worker.stdout().split("metrics on ", 1)[1].split()[0]
        assert 'rpcdist_rpc_calls_in_flight{worker="lone"} 0.0' in _scrape_text(worker_url)
        store_text = _scrape_text(serving.split("metrics on ", 1)[1].strip())
        assert 'rpcdist_store_request_duration_seconds_count{method="CompareSet",outcome="ok"}' in store_text
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.exit_code() == 0, worker.stderr()
    finally:
        assert stop_process(server) == 0
