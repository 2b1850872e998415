"""Failures: remote exceptions, timeouts (explicit, default, cancellation of async work), and
bad input refused at the caller (unknown worker, lambdas, unpicklable values, functions the
callee cannot import, payloads above max_payload_bytes) or at the callee (malformed frames).

One launch of two workers (``rpc_scenarios.errors``); rank 1 runs with rpc_timeout=2 s and
max_payload_bytes=1 MiB.
"""

from __future__ import annotations

import pytest
from _harness import GroupRun, run_group

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(
        tmp_path_factory.mktemp("errors"),
        "errors",
        2,
        "env",
        rank_params={1: {"rpc_timeout": 2.0, "max_payload_bytes": 1 << 20}},
        timeout=240,
    )


@pytest.mark.parametrize("name", ["value_error", "custom", "async_function"])
def test_remote_exception_keeps_its_type(run: GroupRun, name: str) -> None:
    run.check(f"exc/{name}")


@pytest.mark.parametrize("name", ["unrebuildable", "unpicklable", "callee_only_type"])
def test_exception_that_cannot_be_rebuilt_becomes_remote_error(run: GroupRun, name: str) -> None:
    run.check(f"exc/{name}")


def test_explicit_timeout(run: GroupRun) -> None:
    run.check("timeout/explicit")


def test_timed_out_async_function_is_cancelled(run: GroupRun) -> None:
    assert run.check("timeout/async_cancelled") == ["started", "cancelled"]


def test_async_execution_future_not_done_at_timeout_is_dropped_by_the_callee(run: GroupRun) -> None:
    assert run.check("timeout/async_execution_answer_dropped") == "after"


def test_timeout_of_a_call_its_thread_wrote_itself(run: GroupRun) -> None:
    run.check("timeout/sent_from_this_thread")


def test_default_timeout_from_options(run: GroupRun) -> None:
    message = run.check("timeout/default", rank=1)
    assert "2 s" in message, message


def test_timeout_zero_means_no_limit(run: GroupRun) -> None:
    run.check("timeout/zero_means_none", rank=1)


def test_unknown_worker(run: GroupRun) -> None:
    run.check("bad/unknown_worker")


def test_lambda_and_local_function_refused(run: GroupRun) -> None:
    run.check("bad/lambda_and_local_function")


def test_unpicklable_arguments_refused(run: GroupRun) -> None:
    run.check("bad/unpicklable_args")


def test_unpicklable_result(run: GroupRun) -> None:
    run.check("bad/unpicklable_result")


def test_function_the_callee_cannot_import(run: GroupRun) -> None:
    run.check("bad/unimportable_function")


def test_remote_of_function_the_callee_cannot_import(run: GroupRun) -> None:
    run.check("bad/unimportable_function_remote")


def test_remote_failing_while_its_fetch_is_sent_fails_the_fetch(run: GroupRun) -> None:
    run.check("bad/unimportable_function_remote_fails_while_the_fetch_is_sent")


def test_payload_too_large_at_caller(run: GroupRun) -> None:
    run.check("bad/payload_caller", rank=1)


def test_result_too_large_at_callee(run: GroupRun) -> None:
    run.check("bad/payload_result_too_large")


def test_request_above_callee_limit_refused(run: GroupRun) -> None:
    run.check("bad/payload_incoming_too_large")


def test_malformed_frames(run: GroupRun) -> None:
    run.check("bad/malformed_frames")


def test_frame_announcing_huge_buffer(run: GroupRun) -> None:
    run.check("bad/frame_announcing_huge_buffer")


def test_clean_exit(run: GroupRun) -> None:
    run.assert_clean_exit()


def test_no_shared_memory_left_behind(run: GroupRun) -> None:
    run.assert_no_shm_leftovers()
