"""A worker that dies (SIGKILL) or stops answering (SIGSTOP; its host's link cut) with calls
in flight and a peer already shutting down.

- The call in flight to it fails with WorkerDiedError naming it — at once when its socket
  closes, within the heartbeat bound (1 s x (3 + 1)) when nothing closes — not at its 120 s
  timeout; on the Unix-socket path, on the gRPC stream and across network namespaces. So do
  the other waits on it: ``to_here``, a P2P recv, a collective, a distributed backward pass.
- A graceful shutdown waits for every *live* worker (w1, which asked first, still serves
  w0's call after the death) and leaves the dead one out.
- Survivors shut down in moments (no 30 s wait for the dead worker's exit), with no task
  left pending ("Task was destroyed but it is pending").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import GroupRun, InitMethod, Launch, ProcSpec, run_group

pytestmark = pytest.mark.timeout(240)


TRANSPORTS = {"unix": {}, "grpc": {"transport": "grpc", "shm_threshold_bytes": 0}}
# (transport, how w2 is lost): killed (its connections close) or frozen (SIGSTOP: they stay
# open and nothing answers, as when a host vanishes; found by heartbeats on the gRPC path,
# 1 s x (3 + 1); co-located peers' sockets need none).
RUNS = {"unix-kill": ("unix", "kill"), "grpc-kill": ("grpc", "kill"), "grpc-freeze": ("grpc", "freeze")}


@pytest.fixture(scope="module", params=list(RUNS))
def death(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    transport, how = RUNS[request.param]
    workdir = tmp_path_factory.mktemp(f"death-{request.param}")
    params = {**TRANSPORTS[transport], "death": how}
    return run_group(workdir, "worker_death", 3, "env", params=params, timeout=180)


def test_call_in_flight_fails_at_once_naming_the_dead_worker(death: GroupRun) -> None:
    report = death.value(0)
    assert report["call"] == "WorkerDiedError", report
    assert report["call_isinstance_unavailable"], report
    assert "w2" in report["call_message"] and "sleep_blocking" in report["call_message"], report
    # The socket closed with the process, or heartbeats went unanswered (4 s): far below the
    # call's 120 s timeout.
    assert report["call_failed_after"] < 30.0, report


@pytest.mark.parametrize(
    ("wait", "error", "names"),
    [
        ("to_here", "WorkerDiedError", "w2"),
        ("recv", "PeerLostError", "rank 2"),
        ("all_reduce", "PeerLostError", "rank 2"),
        ("backward", "WorkerDiedError", "w2"),
    ],
)
def test_every_other_wait_on_the_dead_worker_fails_at_once(
    death: GroupRun, wait: str, error: str, names: str
) -> None:
    """to_here of an RRef it was creating, a P2P recv from it, a collective with it and a
    distributed backward pass running on it: none waits out its timeout (120 s, the group's
    30 min, the RPC timeout)."""
    report = death.value(0)
    assert report[wait] == error, report
    assert report[f"{wait}_isinstance_unavailable"], report  # one `except` catches them all
    assert names in report[f"{wait}_message"], report
    assert report[f"{wait}_failed_after"] < 30.0, report


def test_shutdown_waits_for_live_workers_and_leaves_the_dead_out(death: GroupRun) -> None:
    assert death.value(0)["w1_answers"] == "w1"  # w1 asked to shut down first, yet served it
    assert death.outcome(2).exitcode == -9  # the dead (or frozen, then killed) worker never reached shutdown


def test_survivors_shut_down_without_waiting_out_the_dead_or_leaking_tasks(death: GroupRun) -> None:
    for rank in (0, 1):
        # Before: w0 waited out the 30 s exit barrier for the dead worker.
        assert death.value(rank)["shutdown_seconds"] < 25.0, death.report()
        assert "Task was destroyed but it is pending" not in death.outcome(rank).log, death.report()


@pytest.mark.parametrize("how", ["kill", "cut"])
def test_worker_lost_on_another_host(
    two_hosts: tuple[tuple[str, str], ...], tmp_path: Path, how: str
) -> None:
    """The same across the network: w0 (with the store) and w1 on one "host", w2 on another
    (network namespaces, each with its own /dev/shm, so every link is a gRPC stream over the
    veth pair). Killed, w2's kernel resets its connections; cut off (its host's link taken
    down, nothing closes), heartbeats find it. Either way every wait on it fails within the
    bound, and the survivors go on and shut down."""
    (host_a, addr_a), (host_b, _) = two_hosts
    launch = Launch(tmp_path, InitMethod("env", tmp_path, host=addr_a))
    params = {"death": how, "cut": f"{host_a}v"}  # the veth end on w0's host (see _netns)
    for rank in range(3):
        launch.start(ProcSpec("worker_death", rank, 3, params, host=host_a if rank < 2 else host_b))
    run = launch.finish(180)
    report = run.value(0)
    if how == "cut":
        assert "heartbeat" in report["call_message"], report
    for wait in ("call", "to_here", "recv", "all_reduce", "backward"):
        assert report[f"{wait}_isinstance_unavailable"], report
        assert report[f"{wait}_failed_after"] < 30.0, report
    assert "10.231.0.2" in report["call_message"], report  # over the network, to the other host
    assert report["w1_answers"] == "w1", report
    assert run.outcome(2).exitcode == -9
    for rank in (0, 1):
        assert run.value(rank)["shutdown_seconds"] < 25.0, run.report()
