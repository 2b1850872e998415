"""Joining a group: env://, tcp:// and file:// with 2 and 4 processes, and the errors of a
bad join (duplicate name or rank, rank out of range, world-size mismatch).

Every worker is a real process (see ``_harness``); scenarios are in ``rpc_scenarios``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _harness import HOST, GroupRun, Launch, ProcSpec, run_group

from rpcdist.store import GrpcStore

pytestmark = pytest.mark.timeout(240)


GROUPS = [(init, world_size) for init in ("env", "tcp", "file") for world_size in (2, 4)]


@pytest.fixture(scope="module", params=GROUPS, ids=[f"{init}-{size}" for init, size in GROUPS])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    init, world_size = request.param
    workdir = tmp_path_factory.mktemp(f"{init}{world_size}")
    return run_group(workdir, "rendezvous", world_size, init, timeout=150)


def test_rendezvous(group: GroupRun) -> None:
    world_size = len(group.outcomes)
    names = [[f"w{r}", r] for r in range(world_size)]
    for rank in range(world_size):
        value = group.value(rank)
        assert value["me"] == [f"w{rank}", rank]
        assert value["seen"] == names, "get_worker_info(name) of every worker"
        assert value["all"] == names, "get_all_worker_infos()"
        # Each worker called every worker (itself included) by name, rank and WorkerInfo.
        assert value["calls"] == {f"w{r}": [f"w{r}"] * 5 for r in range(world_size)}
    group.assert_clean_exit()


def test_first_call_after_init(group: GroupRun) -> None:
    """Calls made the moment init_rpc returns reach callees that already know the group."""
    world_size = len(group.outcomes)
    expected = [f"w{r}" for r in range(world_size)]
    for rank in range(world_size):
        assert group.value(rank)["first_calls"] == [expected] * world_size, f"calls made by w{rank}"


# -- membership errors ------------------------------------------------------------------------
# A group of 3 shares a tcp:// store. w0 and w1 start and register; then three intruders try to
# join and must each be refused with a MembershipError naming the conflict, quickly (long
# before their store_timeout of 30 s); then w2 joins and the group works normally. (A duplicate
# name is not an intruder's own mistake: as in torch it fails the whole group, see below.)
INTRUDERS = {
    # label: (name, rank, world_size)
    "duplicate-rank": ("x", 0, 3),
    "rank-out-of-range": ("y", 3, 3),
    "world-size-mismatch": ("z", 2, 4),
}


@pytest.fixture(scope="module")
def membership(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    launch = Launch(tmp_path_factory.mktemp("membership"), "tcp")
    launch.start(ProcSpec("membership_member", 0, 3))
    launch.start(ProcSpec("membership_member", 1, 3))
    try:
        store = GrpcStore(HOST, launch.init.port, timeout=60)
        try:
            store.wait(["rpc/rank/0", "rpc/rank/1"])  # the registration keys of rpcdist.rendezvous
        finally:
            store.close()
    except Exception as exc:
        run = launch.finish(timeout=5)
        raise AssertionError(f"w0 and w1 did not register: {exc}\n{run.report()}") from exc
    for label, (name, rank, world_size) in INTRUDERS.items():
        launch.start(ProcSpec("membership_intruder", rank, world_size, {"name": name}, label=label))
    launch.wait(list(INTRUDERS), timeout=90)
    launch.start(ProcSpec("membership_member", 2, 3))
    return launch.finish(timeout=90)


def refused(run: GroupRun, label: str) -> dict[str, Any]:
    outcome = run.value(label=label)
    assert not outcome["joined"], f"{label}: the intruder was let into the group"
    assert outcome["is_membership_error"], f"{label}: got {outcome['type']}: {outcome['message']}"
    assert outcome["is_value_error"], "MembershipError is a ValueError"
    assert outcome["seconds"] < 25, f"{label}: refused only after {outcome['seconds']:.1f} s"
    return outcome


@pytest.fixture(scope="module")
def duplicate_name(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    """Ranks 1 and 2 of a group of 3 both start as "w1" (rank 0, which serves the store, is
    "w0"): torch's test_duplicate_name_2 in rpcdist's terms."""
    names = {0: {"name": "w0"}, 1: {"name": "w1"}, 2: {"name": "w1"}}
    workdir = tmp_path_factory.mktemp("duplicate_name")
    return run_group(workdir, "membership_intruder", 3, "tcp", rank_params=names, timeout=90)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_duplicate_name_fails_every_worker(duplicate_name: GroupRun, rank: int) -> None:
    """As torch: every worker of the group fails at init, naming the duplicate; none of them
    (the one whose name was taken, the one that took it first, or a bystander) waits for the
    others or its store_timeout."""
    outcome = duplicate_name.value(rank)
    assert not outcome["joined"], f"rank {rank} joined a group with a duplicate name"
    assert outcome["is_membership_error"], f"rank {rank}: got {outcome['type']}: {outcome['message']}"
    message = outcome["message"]
    assert "'w1' is not unique" in message and "taken by rank" in message, message
    assert outcome["seconds"] < 25, f"rank {rank} failed only after {outcome['seconds']:.1f} s"


def test_duplicate_rank_is_refused(membership: GroupRun) -> None:
    message = refused(membership, "duplicate-rank")["message"]
    assert "rank 0" in message and "'w0'" in message, message


def test_rank_out_of_range_is_refused(membership: GroupRun) -> None:
    message = refused(membership, "rank-out-of-range")["message"]
    assert "rank 3" in message and "[0, 3)" in message, message


def test_world_size_mismatch_is_refused(membership: GroupRun) -> None:
    message = refused(membership, "world-size-mismatch")["message"]
    assert "world_size" in message and "4" in message and "3" in message, message


def test_group_works_after_refusals(membership: GroupRun) -> None:
    everyone = [["w0", 0], ["w1", 1], ["w2", 2]]
    for rank in range(3):
        value = membership.value(rank)
        assert value["all"] == everyone
        assert value["ring"] == f"w{(rank + 1) % 3}"
    membership.assert_clean_exit()


# ---------------------------------------------------------------------------- a taken store port
def _silent_listener() -> Any:
    """A program holding a port that accepts connections and never answers."""
    import socket

    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(8)
    return sock, sock.getsockname()[1]


def _http_server() -> Any:
    import http.server
    import threading

    server = http.server.HTTPServer((HOST, 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.mark.parametrize("holder", [_silent_listener, _http_server], ids=["silent", "http"])
def test_store_port_taken_by_another_program_fails_at_once(
    holder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch fails at once; rank 0 used to wait out store_timeout (300 s) instead."""
    import socket
    import time

    import rpcdist.rpc as rpc
    from rpcdist.errors import RendezvousError

    held, port = holder()
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    try:
        with pytest.raises(RendezvousError) as info:
            rpc.init_rpc("w0", rank=0, world_size=1)
    finally:
        held.close() if isinstance(held, socket.socket) else held.shutdown()
    message = str(info.value)
    assert f"port {port}" in message and "in use by another program" in message, message
    assert "MASTER_PORT" in message, message
    assert time.monotonic() - start < 30.0  # the probe's few seconds, never the 300 s store timeout
