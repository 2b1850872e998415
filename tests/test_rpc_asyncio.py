"""The asyncio-native path: init_rpc_async / awaited calls / shutdown_async on each worker's
own loop (one asyncio.run per process), with no background rpcdist-loop thread.

One launch of two workers (``rpc_scenarios.asyncio_native``).
"""

from __future__ import annotations

import pytest
from _harness import GroupRun, run_group

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("asyncio"), "asyncio_native", 2, "env", timeout=240)


@pytest.mark.parametrize("rank", [0, 1])
def test_no_background_loop_thread(run: GroupRun, rank: int) -> None:
    run.check(f"asyncio/no_loop_thread/{rank}", rank=rank)
    assert "rpcdist-loop" not in run.value(rank)["threads_before_exit"]


def test_async_function_runs_on_callee_loop(run: GroupRun) -> None:
    run.check("asyncio/callee_loop")


def test_thousands_of_sequential_calls(run: GroupRun) -> None:
    run.check("asyncio/many_sequential")


def test_thousands_of_gathered_calls(run: GroupRun) -> None:
    run.check("asyncio/many_gathered")


def test_blocking_function_does_not_stall_other_calls(run: GroupRun) -> None:
    run.check("asyncio/blocking_does_not_stall")


def test_async_execution(run: GroupRun) -> None:
    run.check("asyncio/async_execution")


def test_future_api(run: GroupRun) -> None:
    run.check("asyncio/future_api")


def test_await_from_another_event_loop(run: GroupRun) -> None:
    run.check("asyncio/await_other_loop")


def test_blocking_calls_from_plain_threads(run: GroupRun) -> None:
    run.check("asyncio/plain_thread_blocking")


def test_blocking_call_on_the_loop_is_refused(run: GroupRun) -> None:
    run.check("asyncio/blocking_call_refused")


def test_remote_and_rref(run: GroupRun) -> None:
    run.check("asyncio/remote")


@pytest.mark.parametrize("rank", [0, 1])
def test_shutdown_async_leaves_no_rpcdist_thread(run: GroupRun, rank: int) -> None:
    run.check(f"asyncio/after_shutdown/{rank}", rank=rank)


def test_clean_exit(run: GroupRun) -> None:
    run.assert_clean_exit()
