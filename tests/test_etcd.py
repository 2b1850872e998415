"""The etcd store beyond the conformance suite it shares with the other backends
(``test_store.py``): ``etcd://`` init methods, a dead job's keys expiring with its lease, a job
that loses one member of a 3-node etcd cluster, URLs and errors. Real etcd servers (``_etcd``);
the job's workers are real processes (``_harness``, scenarios in ``rpc_scenarios``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import _etcd
import pytest
from _harness import InitMethod, Launch, ProcSpec, free_port

from rpcdist.errors import RendezvousError, StoreConnectionError, StoreError
from rpcdist.rendezvous import rendezvous
from rpcdist.store import EtcdStore
from rpcdist.store.etcd_store import parse_endpoints, parse_etcd_url

pytestmark = pytest.mark.timeout(180)


class EtcdInit(InitMethod):
    """An ``etcd://`` init method for the harness's workers."""

    def __init__(self, url: str) -> None:
        self.kind = "etcd"
        self.port = 0
        self.env: dict[str, str] = {}
        self.url = url


def test_etcd_urls_and_endpoints() -> None:
    assert parse_etcd_url("etcd://h1:2379,h2,[::1]:23/jobs/j7/?lease_ttl=5") == (
        ["h1:2379", "h2:2379", "[::1]:23"],
        "jobs/j7",
        {"lease_ttl": "5"},
    )
    assert parse_endpoints(["http://10.0.0.1:2379/", "10.0.0.2"]) == ["10.0.0.1:2379", "10.0.0.2:2379"]
    for bad in ("etcd://h1:2379", "etcd://h1:2379/", "etcd:///prefix", "tcp://h:1/p"):
        with pytest.raises(StoreError):
            parse_etcd_url(bad)
    with pytest.raises(StoreError, match="host:port"):
        parse_endpoints("h1:port")


async def test_a_bad_etcd_init_method_says_what_is_missing() -> None:
    with pytest.raises(RendezvousError, match="prefix"):
        await rendezvous("etcd://127.0.0.1:2379", 0, 1, 5.0)
    with pytest.raises(RendezvousError, match="unknown option"):
        await rendezvous("etcd://127.0.0.1:2379/job?ttl=3", 0, 1, 5.0)


def test_unreachable_etcd_fails_within_connect_timeout() -> None:
    endpoints = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    store = EtcdStore(endpoints, "nobody", timeout=60, connect_timeout=1)
    start = time.monotonic()
    try:
        with pytest.raises(StoreConnectionError) as info:
            store.set("k", b"v")
    finally:
        store.close()
    assert time.monotonic() - start < 30, "gave up long after connect_timeout"
    assert all(endpoint in str(info.value) for endpoint in endpoints)
    assert "'k'" in str(info.value)


@pytest.mark.timeout(150)
def test_init_rpc_over_etcd(tmp_path: Path, etcd_server: _etcd.EtcdCluster) -> None:
    """Three workers meet through ``etcd://`` and call each other (the same scenario as the
    env://, tcp:// and file:// rendezvous tests)."""
    url = f"etcd://{etcd_server.url_hosts}/rdzv-{uuid.uuid4().hex[:8]}"
    launch = Launch(tmp_path, EtcdInit(url))
    for rank in range(3):
        launch.start(ProcSpec("rendezvous", rank, 3))
    run = launch.finish(timeout=120)
    names = [[f"w{r}", r] for r in range(3)]
    for rank in range(3):
        value = run.value(rank)
        assert value["seen"] == value["all"] == names
        assert value["calls"] == {f"w{r}": [f"w{r}"] * 5 for r in range(3)}
    run.assert_clean_exit()


# A job's process: writes keys (set, add, compare_set) with a short lease, then lives on.
DEAD_JOB = r"""
import sys, time
from rpcdist.store import EtcdStore

endpoints, prefix = sys.argv[1:3]
store = EtcdStore(endpoints, prefix, timeout=60, lease_ttl=4)  # renewed every 1.3 s
store.set("a", b"1")
store.add("n", 3)
store.compare_set("c", b"", b"x")
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_dead_jobs_keys_go_with_its_lease(etcd_server: _etcd.EtcdCluster) -> None:
    """While a job's process lives, its keys outlive the lease's TTL (the store keeps the lease
    alive); once it is killed, etcd removes every key under the job's prefix."""
    prefix = f"dead-{uuid.uuid4().hex[:8]}"
    job = subprocess.Popen(
        [sys.executable, "-c", DEAD_JOB, etcd_server.url_hosts, prefix], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "ready"
        written = etcd_server.count_keys(prefix + "/")
        assert written >= 4  # three keys and the job's lease record (and the add's marker)
        time.sleep(5.0)  # past the TTL: kept alive all along
        assert etcd_server.count_keys(prefix + "/") == written
    finally:
        job.kill()
        job.wait(30)
    deadline = time.monotonic() + 60
    while etcd_server.count_keys(prefix + "/"):
        assert time.monotonic() < deadline, "the dead job's keys are still there after 60 s"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_a_job_survives_losing_an_etcd_member(tmp_path: Path) -> None:
    """Three workers meet on a 3-member etcd cluster (RPC and a process group, both through
    ``etcd://``) and go on calling each other, all-reducing and adding to a counter in the
    job's store while the test kills the cluster's leader, the member every worker talks to
    first. Nothing fails; every add is applied exactly once across the failover; a get watching
    through the victim is answered; the graceful shutdown (a barrier in the store) goes through
    the two members left."""
    reason = _etcd.unavailable()
    if reason:
        pytest.skip(reason)
    with _etcd.EtcdCluster(tmp_path / "etcd", size=3) as cluster:
        victim = cluster.leader()
        order = [victim] + [i for i in range(3) if i != victim]
        hosts = ",".join(cluster.endpoints[i] for i in order)
        job = f"job-{uuid.uuid4().hex[:8]}"
        launch = Launch(tmp_path / "job", EtcdInit(f"etcd://{hosts}/{job}"))
        params = {"c10d_init_method": f"etcd://{hosts}/{job}", "rounds_after": 20}  # one job, one prefix
        for rank in range(3):
            launch.start(ProcSpec("etcd_job_through_member_loss", rank, 3, params))
        observer = EtcdStore([cluster.endpoints[i] for i in order[1:]], job, timeout=120)
        # A get waiting (watching) through the victim when it dies is answered through another.
        waiter = EtcdStore(hosts, job, timeout=120)
        waited: list[bytes] = []
        waiting = threading.Thread(target=lambda: waited.append(waiter.get("app/after-kill")))
        waiting.start()
        try:
            try:
                observer.wait([f"app/looping/{r}" for r in range(3)])
            except BaseException:
                launch.kill_all()
                raise
            cluster.kill(victim)
            observer.set("app/killed", b"1")
            observer.set("app/after-kill", b"seen")
            waiting.join(60)
            assert waited == [b"seen"]
            run = launch.finish(timeout=180)
            values = [run.value(r) for r in range(3)]
            run.assert_clean_exit()
            assert all(v["rounds_after_kill"] >= 20 for v in values), values
            total = sum(v["rounds"] for v in values)
            assert sorted(a for v in values for a in v["adds"]) == list(range(1, total + 1))
            assert observer.get("app/counter") == str(total).encode()
        finally:
            observer.close()
            waiting.join(60)
            waiter.close()

