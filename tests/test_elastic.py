"""Elastic membership: a dynamic group (``init_rpc(name, world_size=None)``) that workers join
and leave while it runs (scenarios in ``elastic_scenarios``).

One launch, in stages: the PS (rank 0, hosting the store) and trainer1 start; once trainer1
has trained alone, trainer2 joins, is called, trains a step and leaves; trainer1 notices the
leave, gets a clear error calling it, and trains on with distributed autograd; then a new
process rejoins under the name trainer2 and leaves again.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import pytest
from _harness import GroupRun, Launch, ProcSpec

pytestmark = pytest.mark.timeout(240)


class _ImportFirst:
    """Unpickled in the worker before its scenario runs: imports (registers) the scenarios."""

    def __reduce__(self) -> Any:
        return importlib.import_module, ("elastic_scenarios",)


def _wait_for(path: Path, launch: Launch, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            launch.kill_all()
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    workdir = tmp_path_factory.mktemp("elastic")
    launch = Launch(workdir, "env", fail_grace=30)

    def start(role: str, rank: int) -> str:
        params = {"role": role, "scenarios": _ImportFirst()}
        return launch.start(ProcSpec("elastic", rank, 0, params, label=role))

    start("ps", 0)
    _wait_for(workdir / "ps_up", launch, 90)
    start("trainer1", 1)
    _wait_for(workdir / "trainer1_trained", launch, 90)
    first = start("trainer2", 2)
    launch.wait([first], 90)
    _wait_for(workdir / "trainer2_may_rejoin", launch, 90)
    start("trainer2_again", 3)
    _wait_for(workdir / "victim_may_join", launch, 90)
    victim = start("victim", 4)
    launch.wait([victim], 60)
    _wait_for(workdir / "victim_may_rejoin", launch, 90)
    start("victim_again", 5)
    return launch.finish(150)


def test_a_worker_joins_a_running_group_and_is_called(group: GroupRun) -> None:
    group.check("elastic/trainer1_alone", label="trainer1")
    group.check("elastic/trainer2_joined", label="trainer2")
    group.check("elastic/sees_the_joiner", label="trainer1")


def test_a_worker_leaves_and_the_others_train_on(group: GroupRun) -> None:
    group.check("elastic/sees_the_leaver", label="trainer1")
    group.check("elastic/trains_on_after_the_leave", label="trainer1")


def test_a_name_can_rejoin_after_it_left(group: GroupRun) -> None:
    group.check("elastic/trainer2_again_joined", label="trainer2_again")
    group.check("elastic/sees_the_rejoin", label="trainer1")


def test_a_member_that_dies_is_taken_off_and_its_name_freed(group: GroupRun) -> None:
    """kill -9 says nothing: the survivors notice its lost link, find it dead, take it off the
    roster, free its name and announce that it left; a successor joins under the same name."""
    group.check("elastic/a_dead_member_is_taken_off", label="trainer1")
    group.check("elastic/victim_again_joined", label="victim_again")
    group.check("elastic/a_dead_members_name_is_free_again", label="trainer1")
    assert group.outcome(label="victim").exitcode == -9
    # One check per lost link at a time: the check's own probe of the dead member loses a
    # link again, and chaining a check on each of those flooded the store (its server shed
    # the successor's calls). Three departures (two leaves, one death): a handful of checks.
    assert group.value(label="ps")["peer_death_checks"] <= 8, group.value(label="ps")


def test_listeners_hear_every_join_and_leave_in_order(group: GroupRun) -> None:
    events = [tuple(e) for e in group.value(label="ps")["events"]]
    assert events[:9] == [
        ("joined", "trainer1"),
        ("joined", "trainer2"),
        ("left", "trainer2"),
        ("joined", "trainer2"),
        ("left", "trainer2"),
        ("joined", "victim"),
        ("left", "victim"),
        ("joined", "victim"),
        ("left", "victim"),
    ], events


def test_ranks_are_drawn_and_never_shared(group: GroupRun) -> None:
    ranks = [group.value(label=label)["rank"] for label in ("trainer1", "trainer2", "trainer2_again")]
    assert 0 not in ranks and len(set(ranks)) == 3, ranks


def test_everyone_else_leaves_cleanly(group: GroupRun) -> None:
    for label in ("ps", "trainer1", "trainer2", "trainer2_again", "victim_again"):
        out = group.outcome(label=label)
        assert out.exitcode == 0 and not out.killed, group.report()
        assert not out.result["left_initialized"], group.report()
        assert not [t for t in out.result["threads"] if t.startswith("rpcdist")], group.report()
