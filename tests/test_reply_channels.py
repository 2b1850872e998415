"""Reply channels: a co-located callee answers ``rpc_sync`` on a socket the waiting thread
reads itself (``rpcdist.transport.reply_channel``), so the answer needs no hop through the
caller's event loop; a plain function's call goes on that socket too, run by the callee's
thread reading it, so it needs no hop through the callee's loop either — and every property
of a call holds as on the link: order with what the caller sent on the link before, timeouts
(whose late answers never reach a later call), many threads at once, results of every size,
remote errors, and answers carrying RRefs (which go on the link, decoded by the loop in order).

One launch of two co-located workers (``rpc_scenarios.reply_channels``). A callee dying with a
call in flight on a channel is covered by test_worker_death (unix-kill).
"""

from __future__ import annotations

import pytest
from _harness import GroupRun, run_group

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("reply_channels"), "reply_channels", 2, "env", timeout=200)


def test_rpc_sync_is_answered_while_the_callers_loop_is_busy(run: GroupRun) -> None:
    assert run.check("channel/answers_without_the_loop") is True


def test_a_timed_out_call_raises_and_its_late_answer_reaches_no_later_call(run: GroupRun) -> None:
    run.check("channel/timeout_then_next_answers")


def test_threads_waiting_at_once_each_get_their_own_answers(run: GroupRun) -> None:
    run.check("channel/threads_get_their_own_answers")


def test_results_of_every_size_arrive_whole(run: GroupRun) -> None:
    run.check("channel/large_results")


def test_an_answer_carrying_an_rref_takes_the_link_and_the_channel_stays(run: GroupRun) -> None:
    run.check("channel/rref_results")


def test_a_plain_call_is_run_by_the_callees_channel_thread_while_its_loop_is_busy(run: GroupRun) -> None:
    run.check("channel/requests_run_while_the_callees_loop_is_busy")


def test_a_request_on_the_channel_runs_after_what_its_caller_sent_on_the_link(run: GroupRun) -> None:
    run.check("channel/requests_keep_their_order_behind_the_link")


def test_a_busy_callee_gets_requests_on_the_link_for_a_while(run: GroupRun) -> None:
    run.check("channel/busy_callee_gets_requests_on_the_link")


def test_a_remote_error_keeps_its_type_and_traceback(run: GroupRun) -> None:
    run.check("channel/remote_error")
