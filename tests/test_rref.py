"""Remote references: the RRef API, passing RRefs between workers, reference counting (deletion
from every side, early-free races, 10,000 RRefs), errors (failed creation, owner gone),
asyncio use, and graceful shutdown while RRefs are held.

Three launches (scenarios in ``rref_scenarios``): ``rref_main`` (3 workers: rank 0 drives, w2
owns most values), ``rref_owner_gone`` (3 workers: w2 leaves while others hold RRefs) and
``rref_asyncio`` (2 workers, each in its own ``asyncio.run``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from _harness import GroupRun, ProcSpec, run_processes

pytestmark = pytest.mark.timeout(420)


class _ImportInWorker:
    """A parameter that, unpickled in the worker before its scenario starts, imports a module.

    ``_harness`` finds scenarios on ``rpc_scenarios``; ``rref_scenarios`` adds its own there
    when imported. Passing one of these in the scenario's params makes every worker import it
    (the scenario receives the module object and ignores it).
    """

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        return importlib.import_module, (self.module,)


def _launch(workdir: Path, scenario: str, world_size: int, timeout: float) -> GroupRun:
    params = {"scenarios_module": _ImportInWorker("rref_scenarios")}
    specs = [ProcSpec(scenario, rank, world_size, dict(params)) for rank in range(world_size)]
    return run_processes(workdir, specs, "env", timeout=timeout)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("rref_main"), "rref_main", 3, timeout=360)


@pytest.fixture(scope="module")
def gone(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("rref_gone"), "rref_owner_gone", 3, timeout=180)


@pytest.fixture(scope="module")
def aio(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("rref_asyncio"), "rref_asyncio", 2, timeout=180)


# ============================================================================ 1. API
@pytest.mark.parametrize(
    "name",
    [
        "identity",
        "to_here",
        "local_value_on_user_raises",
        "proxy_rpc_sync",
        "proxy_rpc_async",
        "proxy_remote",
        "local_owner_rref",
        "remote_to_self",
        "all_dropped",
    ],
)
def test_api(main: GroupRun, name: str) -> None:
    main.check(f"api/{name}")


# ============================================================================ 2. passing RRefs
@pytest.mark.parametrize(
    "name",
    [
        "nested_to_user",
        "nested_to_owner",
        "user_to_owner_is_owner_rref",
        "user_to_owner_without_a_hold",
        "three_workers",
        "returned_from_remote_function",
        "owner_forks_cost_no_message",
        "confirmed_inside_call",
        "all_dropped",
    ],
)
def test_passing(main: GroupRun, name: str) -> None:
    main.check(f"pass/{name}")


# ============================================================================ 3. deletion
@pytest.mark.parametrize(
    "name",
    [
        "creator_only",
        "creator_first_then_holder",
        "holder_first_then_creator",
        "owner_drops_first",
        "owner_rref_on_owner_last",
        "owner_rref_on_owner_first",
        "all_dropped",
    ],
)
def test_deletion_reaches_zero(main: GroupRun, name: str) -> None:
    main.check(f"delete/{name}")


def test_failed_send_releases_fork_hold(main: GroupRun) -> None:
    main.check("leak/failed_send_releases_fork_hold")


# ============================================================================ 4. races
@pytest.mark.parametrize(
    "name",
    [
        "fork_while_sender_deletes",
        "fork_while_sender_deletes/dropped",
        "use_before_confirmation",
        "use_before_confirmation/dropped",
        "made_while_fetched",
        "made_while_fetched/dropped",
        "made_while_owner_loop_stalls",
        "fetch_while_pool_blocked",
        "fork_chain_while_deleting",
        "all_dropped",
    ],
)
def test_early_free_races(main: GroupRun, name: str) -> None:
    main.check(f"race/{name}")


# ============================================================================ 5. many RRefs
@pytest.mark.parametrize("round_", [1, 2])
def test_many_rrefs_freed(main: GroupRun, round_: int) -> None:
    main.check(f"many/round{round_}")


def test_fire_and_forget_remote_is_freed(main: GroupRun) -> None:
    main.check("many/fire_and_forget_freed")


def test_many_rrefs_owner_memory_bounded(main: GroupRun) -> None:
    main.check("many/rss_bounded")


# ============================================================================ 6. errors
@pytest.mark.parametrize(
    "name", ["creator_to_here_raises", "forked_copy_to_here_raises", "remote_to_self_raises", "all_dropped"]
)
def test_failed_creation(main: GroupRun, name: str) -> None:
    main.check(f"errors/{name}")


@pytest.mark.parametrize(
    "name", ["failed_value_freed_after_owner_to_here", "failed_value_freed_after_proxy_call"]
)
def test_failed_value_freed_after_its_error_was_raised(main: GroupRun, name: str) -> None:
    main.check(f"errors/{name}")


@pytest.mark.parametrize(
    "name",
    [
        "in_flight_to_here_fails",
        "to_here_raises",
        "to_here_async_raises",
        "proxy_raises",
        "unconfirmable_argument_fails",
    ],
)
def test_owner_gone(gone: GroupRun, name: str) -> None:
    gone.check("gone/setup")
    gone.check(f"gone/{name}")


def test_owner_gone_forked_copy(gone: GroupRun) -> None:
    gone.check("gone/forked_copy_to_here_raises", rank=1)


def test_owner_gone_drop(gone: GroupRun) -> None:
    gone.check("gone/drop_after_owner_left")


def test_owner_gone_clean_exit(gone: GroupRun) -> None:
    gone.assert_clean_exit()


# ============================================================================ 7. asyncio
@pytest.mark.parametrize(
    "name",
    [
        "to_here_async",
        "proxy_rpc_async",
        "proxy_remote",
        "gathered",
        "blocking_to_here_refused",
        "local_owner",
        "errors",
        "dropped_to_zero",
    ],
)
def test_asyncio(aio: GroupRun, name: str) -> None:
    aio.check(f"asyncio/{name}")


def test_asyncio_clean_exit(aio: GroupRun) -> None:
    aio.assert_clean_exit()


# ============================================================================ 8. graceful shutdown
def test_graceful_shutdown_releases_held_rrefs(main: GroupRun) -> None:
    main.check("graceful/setup")
    main.check("graceful/owner_keeps_values_until_all_shut_down", rank=2)
    main.check("graceful/after/0")


def test_graceful_shutdown_keeps_rrefs_a_peer_may_still_fork(main: GroupRun) -> None:
    """torch's test_nested_rref_stress: a worker in shutdown still owns a value holding an RRef
    it made; a slower peer fetches that value (forking the RRef) and uses the RRef."""
    main.check("graceful/fork_from_a_worker_shutting_down")


def test_main_clean_exit(main: GroupRun) -> None:
    main.assert_clean_exit()
    for out in main.outcomes:
        for symptom in ("still outstanding", "barrier failed"):
            assert symptom not in out.log, f"{out.label} logged {symptom!r}:\n{out.log_tail()}"
