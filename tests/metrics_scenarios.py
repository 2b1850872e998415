"""Scenario of the metrics and status tests (``test_metrics.py``), run by the multi-process harness.

Importing this module registers ``metrics_group`` on ``rpc_scenarios`` (where ``_harness`` looks
scenarios up), as ``rref_scenarios`` does. Three workers: w0 turns metrics on with
``RpcBackendOptions(metrics_port=0)`` and drives every check, w1 with ``RPCDIST_METRICS_PORT=0``,
w2 leaves them at their default (off). Rank 0 embeds the store.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import grpc
import rpc_functions as rf
import rpc_scenarios
import torch
from _harness import check
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families
from rpc_scenarios import CALL_TIMEOUT, finish, init, wait_until

import rpcdist
import rpcdist.rpc as rpc
from rpcdist import metrics
from rpcdist import status as status_program
from rpcdist.agent import current_agent
from rpcdist.collectives import group as collectives_group

SCENARIOS = ("metrics_group",)
ECHO = "rpc_functions.echo"
RAISE = "rpc_functions.raise_value_error"
CALLS, FAILURES = 7, 2
TENSOR_BYTES = 4 * 10_000


# ============================================================================ helpers
def scrape(address: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the endpoint at ``address``: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=CALL_TIMEOUT) as answer:
        text = answer.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The value of ``name`` with exactly ``labels`` (0 when absent: a counter not yet made)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def listening_ports() -> set[int]:
    """TCP ports this process listens on (from /proc: its socket inodes in state LISTEN)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def services_listed(address: str) -> set[str]:
    """The services server reflection lists at ``address`` (a standard reflection client)."""
    with grpc.insecure_channel(address) as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def health_of(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def own_state() -> dict[str, Any]:
    """What a worker reports about its own metrics and ports (called over RPC)."""
    agents = [current_agent()]
    if collectives_group._state is not None:  # the process group's agent serves too
        agents.append(collectives_group._state.agent)
    return {
        "address": metrics.address(),
        "on": metrics.current is not None,
        "listening": sorted(listening_ports()),
        "agent_ports": sorted(p for a in agents for p in (a.transport.port, a.transport.tcp_port) if p),
        "http_threads": [t.name for t in threading.enumerate() if "serve_forever" in t.name],
    }


# ============================================================================ the scenario
def metrics_group(rank: int, world_size: int, init_method: str, **_: Any) -> dict[str, Any]:
    if rank == 1:
        os.environ[metrics.ENV_PORT] = "0"
    init(rank, world_size, init_method, **({"metrics_port": 0} if rank == 0 else {}))
    rpcdist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=init_method)
    total = torch.ones(4)
    rpcdist.all_reduce(total)
    result: dict[str, Any] = {}
    if rank == 0:
        try:
            result = _drive(world_size)
        finally:
            rpcdist.destroy_process_group()
            finish(rank, world_size)
        return result
    rpcdist.destroy_process_group()
    finish(rank, world_size)
    return result


def _drive(world_size: int) -> dict[str, Any]:
    mine = metrics.address()
    theirs = rpc.rpc_sync("w1", own_state, timeout=CALL_TIMEOUT)
    w1 = theirs["address"]
    result: dict[str, Any] = {}

    with check("off_by_default"):
        off = rpc.rpc_sync("w2", own_state, timeout=CALL_TIMEOUT)
        assert not off["on"] and off["address"] == "", off
        assert off["http_threads"] == [], off
        assert set(off["listening"]) == set(off["agent_ports"]), off  # nothing but its own server

    with check("on_by_option_and_by_env"):
        assert mine and metrics.current is not None
        assert theirs["on"] and w1, theirs
        w1_port = int(w1.rsplit(":", 1)[1])
        assert w1_port in theirs["listening"] and w1_port not in theirs["agent_ports"], theirs

    with check("calls_counted"):
        before, served_before = scrape(mine), scrape(w1)
        payload = torch.zeros(TENSOR_BYTES // 4)
        for _ in range(CALLS):
            rpc.rpc_sync("w1", rf.echo, args=(payload,), timeout=CALL_TIMEOUT)
        for _ in range(FAILURES):
            try:
                rpc.rpc_sync("w1", rf.raise_value_error, args=("metrics test",), timeout=CALL_TIMEOUT)
            except ValueError:
                pass
            else:
                raise AssertionError("the failing call did not fail")
        after, served = scrape(mine), scrape(w1)

        def delta(
            name: str, now: dict[Any, float] = after, then: dict[Any, float] = before, **labels: str
        ) -> float:
            return sample(now, name, **labels) - sample(then, name, **labels)

        moved = {
            "started": delta("rpcdist_rpc_calls_started_total", function=ECHO, peer="w1"),
            "finished": delta("rpcdist_rpc_calls_finished_total", function=ECHO, peer="w1"),
            "latency_count": delta("rpcdist_rpc_call_duration_seconds_count", function=ECHO, peer="w1"),
            "failed_started": delta("rpcdist_rpc_calls_started_total", function=RAISE, peer="w1"),
            "failed": delta("rpcdist_rpc_calls_failed_total", function=RAISE, peer="w1", error="ValueError"),
            "failed_finished": delta("rpcdist_rpc_calls_finished_total", function=RAISE, peer="w1"),
            "served_ok": delta(
                "rpcdist_rpc_served_total", served, served_before, function=ECHO, peer="w0", outcome="ok"
            ),
            "served_error": delta(
                "rpcdist_rpc_served_total", served, served_before, function=RAISE, peer="w0", outcome="error"
            ),
            "serve_count": delta(
                "rpcdist_rpc_serve_duration_seconds_count", served, served_before, function=ECHO, peer="w0"
            ),
        }
        result["moved"] = moved
        assert moved == {
            "started": CALLS,
            "finished": CALLS,
            "latency_count": CALLS,
            "failed_started": FAILURES,
            "failed": FAILURES,
            "failed_finished": 0,
            "served_ok": CALLS,
            "served_error": FAILURES,
            "serve_count": CALLS,
        }, moved
        latency = delta("rpcdist_rpc_call_duration_seconds_sum", function=ECHO, peer="w1")
        assert 0 < latency < CALLS * CALL_TIMEOUT, latency

    with check("bytes_per_peer"):
        # Each echo carries the tensor there and back: at least that many bytes both ways.
        sent = delta("rpcdist_transport_sent_bytes_total", peer="w1")
        received = delta("rpcdist_transport_received_bytes_total", peer="w1")
        w1_sent = delta("rpcdist_transport_sent_bytes_total", served, served_before, peer="w0")
        result["bytes"] = {"sent": sent, "received": received, "w1_sent": w1_sent}
        assert sent >= CALLS * TENSOR_BYTES and received >= CALLS * TENSOR_BYTES, result["bytes"]
        assert w1_sent >= CALLS * TENSOR_BYTES, result["bytes"]

    with check("in_flight_and_peers"):
        samples = scrape(mine)
        assert sample(samples, "rpcdist_rpc_calls_in_flight", worker="w0") == 0, samples
        assert sample(samples, "rpcdist_peer_up", worker="w0", peer="w1", state="connected") == 1
        assert 0 <= sample(samples, "rpcdist_peer_last_heard_seconds", worker="w0", peer="w1") < 60

    with check("collective_timed"):
        samples = scrape(mine)
        count = sample(samples, "rpcdist_collective_duration_seconds_count", op="all_reduce", outcome="ok")
        assert count >= 1, count

    with check("live_rrefs_up_and_back_to_zero"):
        rrefs = [rpc.remote("w1", torch.ones, args=(2,), timeout=CALL_TIMEOUT) for _ in range(3)]
        for rref in rrefs:
            rref.to_here(timeout=CALL_TIMEOUT)
        wait_until(lambda: sample(scrape(w1), "rpcdist_rrefs_owned", worker="w1") == 3, 30, "w1 to own 3")
        assert sample(scrape(mine), "rpcdist_rrefs_held", worker="w0") == 3
        del rrefs, rref
        gc.collect()
        wait_until(lambda: sample(scrape(w1), "rpcdist_rrefs_owned", worker="w1") == 0, 30, "w1 to own 0")
        assert sample(scrape(mine), "rpcdist_rrefs_held", worker="w0") == 0

    agent = current_agent()
    store_address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    with check("reflection_on_worker_and_store"):
        on_worker = services_listed(agent.addresses[1])
        on_store = services_listed(store_address)
        result["reflection"] = {"worker": sorted(on_worker), "store": sorted(on_store)}
        reflection = "grpc.reflection.v1alpha.ServerReflection"
        assert {"rpcdist.v1.Agent", "rpcdist.v1.Status", "grpc.health.v1.Health", reflection} <= on_worker
        assert {"rpcdist.v1.Store", "grpc.health.v1.Health", reflection} <= on_store

    with check("health_on_workers"):
        assert [health_of(agent.addresses[r]) for r in range(world_size)] == ["SERVING"] * world_size

    with check("rpcdist_status"):
        held = rpc.remote("w2", torch.ones, args=(1,), timeout=CALL_TIMEOUT)
        held.to_here(timeout=CALL_TIMEOUT)
        done = subprocess.run(
            [sys.executable, "-m", "rpcdist.status", "--store", store_address, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)["members"]
        assert [(m["rank"], m["name"], m["health"]) for m in report] == [
            (0, "w0", "SERVING"),
            (1, "w1", "SERVING"),
            (2, "w2", "SERVING"),
        ], report
        by_name = {m["name"]: m for m in report}
        assert by_name["w0"]["status"]["counts"]["user_rrefs"] == 1, by_name["w0"]
        assert by_name["w2"]["status"]["counts"]["owned_rrefs"] == 1, by_name["w2"]
        assert by_name["w0"]["status"]["metrics_address"] == mine
        assert by_name["w2"]["status"]["metrics_address"] == ""
        peers = {p["name"]: p["state"] for p in by_name["w0"]["status"]["peers"]}
        assert peers == {"w1": "connected", "w2": "connected"}, peers
        table = io.StringIO()
        with contextlib.redirect_stdout(table):  # the table, in-process (one interpreter start is enough)
            code = status_program.main(["--store", store_address])
        lines = table.getvalue().splitlines()
        assert code == 0 and lines[0] == f"store {store_address}: 3 members", lines
        assert lines[1].split() == [
            "RANK",
            "NAME",
            "ADDRESS",
            "HEALTH",
            "IN-FLIGHT",
            "RUNNING",
            "OWNED-RREFS",
            "USER-RREFS",
        ]
        assert [line.split()[:4] for line in lines[2:5]] == [
            [str(r), f"w{r}", agent.addresses[r], "SERVING"] for r in range(3)
        ], lines
        del held

    with check("status_store_unreachable"):
        started = time.monotonic()
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            code = status_program.main(["--store", "127.0.0.1:1", "--timeout", "1"])
        assert code == 1, errors.getvalue()
        assert "unreachable" in errors.getvalue() and "127.0.0.1:1" in errors.getvalue(), errors.getvalue()
        result["unreachable_seconds"] = time.monotonic() - started
    return result


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for name in SCENARIOS:
        setattr(rpc_scenarios, name, globals()[name])


_register()
