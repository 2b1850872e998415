"""Shutdown: graceful shutdown completes calls in flight; graceful and non-graceful shutdown
leave no thread running, and the processes exit 0 promptly.
"""

from __future__ import annotations

import pytest
from _harness import GroupRun, run_group

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def graceful(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("graceful"), "shutdown_graceful", 2, "env", timeout=120)


@pytest.fixture(scope="module")
def nongraceful(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("nongraceful"), "shutdown_nongraceful", 2, "tcp", timeout=120)


def test_graceful_shutdown_waits_for_call_in_flight(graceful: GroupRun) -> None:
    graceful.check("graceful/caller", rank=1)
    assert graceful.check("graceful/callee", rank=0) == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_graceful_shutdown_runs_no_full_garbage_collection(graceful: GroupRun, rank: int) -> None:
    graceful.check(f"graceful/no-full-collection/{rank}", rank=rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_no_rpc_after_graceful_shutdown(graceful: GroupRun, rank: int) -> None:
    graceful.check(f"graceful/after/{rank}", rank=rank)


def test_graceful_shutdown_exits_cleanly(graceful: GroupRun) -> None:
    graceful.assert_clean_exit()


def test_graceful_shutdown_leaves_only_main_thread(graceful: GroupRun) -> None:
    graceful.assert_clean_exit(strict_threads=True)


def test_request_to_a_worker_shutting_down_is_refused(nongraceful: GroupRun) -> None:
    assert "is shutting down" in nongraceful.check("nongraceful/refused_while_closing", rank=1)
    nongraceful.check("nongraceful/refused_while_closing/callee", rank=0)


def test_nongraceful_shutdown_fails_outstanding_call(nongraceful: GroupRun) -> None:
    nongraceful.check("nongraceful/callee", rank=0)
    nongraceful.check("nongraceful/caller", rank=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_no_rpc_after_nongraceful_shutdown(nongraceful: GroupRun, rank: int) -> None:
    nongraceful.check(f"nongraceful/after/{rank}", rank=rank)


def test_nongraceful_shutdown_exits_cleanly(nongraceful: GroupRun) -> None:
    nongraceful.assert_clean_exit()


def test_nongraceful_shutdown_leaves_only_main_thread(nongraceful: GroupRun) -> None:
    nongraceful.assert_clean_exit(strict_threads=True)
