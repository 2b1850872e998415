"""How a callee writes the answers its pool threads make while other calls of the same caller
run (``InboundSession.answer_from_thread``): every answer reaches the caller exactly once,
a few at a time rather than all at the end of a burst, and the call stops counting as running
here only once its answer is on its way."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
from _harness import run_group

from rpcdist.agent import callee as callee_module
from rpcdist.agent.callee import ANSWERS_PER_THREAD_WRITE, Callee, InboundSession
from rpcdist.agent.threads import LoopInbox
from rpcdist.transport import frames
from rpcdist.transport.writer import FrameWriter

pytestmark = pytest.mark.timeout(60)


class _Link:
    """Records frames written by the loop (the writer task) and by threads (``direct``)."""

    def __init__(self) -> None:
        self.by_loop: list[list[int]] = []
        self.by_thread: list[list[int]] = []
        self.accept_direct = True
        self.lock = threading.Lock()

    @staticmethod
    def call_ids(pieces: list[bytes | memoryview]) -> list[int]:
        return [env.call_id for env in frames.decode_frame(b"".join(bytes(p) for p in pieces))]

    async def write(self, pieces: list[bytes | memoryview]) -> None:
        if pieces:
            self.by_loop.append(self.call_ids(pieces))

    def direct(self, pieces: list[bytes | memoryview], size: int) -> bool:
        with self.lock:
            accept = self.accept_direct if not callable(self.accept_direct) else self.accept_direct()
            if accept:
                self.by_thread.append(self.call_ids(pieces))
            return accept

    def answered(self) -> list[int]:
        return [i for frame in self.by_loop + self.by_thread for i in frame]


def _session(loop: asyncio.AbstractEventLoop, link: _Link, thread_writes: bool = True) -> InboundSession:
    """A session on ``link``; ``thread_writes=False``: a link only the loop writes (gRPC's)."""
    agent = type("Agent", (), {})()
    agent.loop = loop
    agent.inbox = LoopInbox(loop)
    callee = type("CalleeStub", (), {"_served": staticmethod(Callee._served), "_finish": Callee._finish})()
    callee.agent = agent
    callee.sessions = set()
    writer = FrameWriter(link.write, "test", direct=link.direct if thread_writes else None)
    return InboundSession(callee, writer)  # type: ignore[arg-type]


def _answer(call_id: int) -> list[list[bytes | memoryview]]:
    return list(frames.encode_message(call_id, frames.RESPONSE, b"result %d" % call_id, []))


def _answering_thread(session: InboundSession, call_ids: list[int]) -> threading.Thread:
    def run() -> None:
        for call_id in call_ids:
            session.answer_from_thread(call_id, "f", _answer(call_id))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _answer_holding_the_loop(session: InboundSession, call_ids: list[int]) -> None:
    """Answer from a thread while the loop has no turn (as when a pool thread holds the
    interpreter lock through a burst)."""
    _answering_thread(session, call_ids).join(10)


async def _answer_on_a_thread(session: InboundSession, call_ids: list[int]) -> None:
    thread = _answering_thread(session, call_ids)
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)


async def _settled(session: InboundSession, link: _Link, expected: int) -> None:
    for _ in range(500):
        if len(link.answered()) >= expected and not session._answers:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(link.answered())} of {expected} answers written")


@pytest.mark.asyncio
async def test_fewer_answers_than_a_batch_wait_for_the_loop_which_writes_them_together() -> None:
    link = _Link()
    session = _session(asyncio.get_running_loop(), link)
    for call_id in range(1, 11):
        session.track(call_id, object())
    few = list(range(1, ANSWERS_PER_THREAD_WRITE))
    _answer_holding_the_loop(session, few)
    assert link.by_thread == []
    await _settled(session, link, len(few))
    assert link.by_loop == [few]  # one write
    assert sorted(session.running) == list(range(ANSWERS_PER_THREAD_WRITE, 11))


@pytest.mark.asyncio
async def test_the_thread_that_completes_a_batch_writes_it_itself() -> None:
    link = _Link()
    session = _session(asyncio.get_running_loop(), link)
    calls = list(range(1, 2 * ANSWERS_PER_THREAD_WRITE + 1))
    for call_id in calls:
        session.track(call_id, object())
    _answer_holding_the_loop(session, calls)
    assert link.by_thread == [calls[:ANSWERS_PER_THREAD_WRITE], calls[ANSWERS_PER_THREAD_WRITE:]]
    assert session.running == {}
    await asyncio.sleep(0.05)
    assert link.by_loop == []  # nothing written twice


@pytest.mark.asyncio
async def test_a_batch_the_link_does_not_take_at_once_goes_through_the_loop() -> None:
    link = _Link()
    link.accept_direct = False
    session = _session(asyncio.get_running_loop(), link)
    calls = list(range(1, ANSWERS_PER_THREAD_WRITE + 2))
    for call_id in calls:
        session.track(call_id, object())
    _answer_holding_the_loop(session, calls)
    assert link.by_thread == []
    assert sorted(session.running) == calls  # not answered yet: still running here
    await _settled(session, link, len(calls))
    assert sorted(link.answered()) == calls
    assert session.running == {}


@pytest.mark.asyncio
async def test_many_threads_answering_at_once_lose_and_repeat_nothing() -> None:
    """Four threads answer 300 calls each, the link taking a direct write or not at random,
    while the loop writes what waits for it: each answer arrives exactly once."""
    link = _Link()
    chance = random.Random(7)
    link.accept_direct = lambda: chance.random() < 0.6  # type: ignore[assignment]
    session = _session(asyncio.get_running_loop(), link)
    per_thread, threads = 300, 4
    calls = list(range(1, per_thread * threads + 1))
    for call_id in calls:
        session.track(call_id, object())
    await asyncio.gather(
        *(_answer_on_a_thread(session, calls[t::threads]) for t in range(threads)),
        _keep_turning(0.3),
    )
    await _settled(session, link, len(calls))
    assert sorted(link.answered()) == calls
    assert session.running == {}
    assert link.by_thread and link.by_loop  # both ways were taken
    # A thread writes only a full batch (more, if a refused one came back meanwhile).
    assert min(len(frame) for frame in link.by_thread) >= ANSWERS_PER_THREAD_WRITE


async def _keep_turning(seconds: float) -> None:
    """Give the loop turns while threads answer (its writes interleave with theirs)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_answers_are_counted_once_each_with_metrics_on(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[int] = []

    class _Metrics:
        def call_served(self, function: str, peer: str, ok: bool, seconds: float) -> None:
            served.append(1)

    monkeypatch.setattr(callee_module.metrics, "current", _Metrics())
    link = _Link()
    session = _session(asyncio.get_running_loop(), link)
    calls = list(range(1, 3 * ANSWERS_PER_THREAD_WRITE))
    for call_id in calls:
        session.track(call_id, object())
        session.arrivals[call_id] = 0.0
    _answer_holding_the_loop(session, calls)
    await _settled(session, link, len(calls))
    for _ in range(100):
        if len(served) == len(calls):
            break
        await asyncio.sleep(0.01)
    assert len(served) == len(calls) and session.arrivals == {}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("limit", [4, 64])
def test_a_caller_at_its_limit_is_never_refused(tmp_path: Path, limit: int) -> None:
    """Two workers with the same limit of calls in flight per peer keep that many running on
    each other (3,000 calls each way): the callee, answering from its pool threads, never
    counts a call whose answer its caller already has."""
    run = run_group(
        tmp_path, "at_the_calls_limit", 2, "env", params={"max_inflight_calls_per_peer": limit}, timeout=150
    )
    run.check("limit/never_refused/0", rank=0)
    run.check("limit/never_refused/1", rank=1)


@pytest.mark.asyncio
async def test_answers_being_written_no_longer_count_against_the_callers_limit() -> None:
    """While a thread writes a batch of answers, its caller may read them and send its next
    calls before the thread untracks them: the callee's count of that caller's running calls
    (the one its limit checks) already leaves them out."""
    link = _Link()
    session = _session(asyncio.get_running_loop(), link)
    seen: list[tuple[int, int]] = []

    def accept() -> bool:  # (during the thread's write)
        seen.append((session.calls_running(), len(session.running)))
        return True

    link.accept_direct = accept  # type: ignore[assignment]
    for call_id in range(1, 11):
        session.track(call_id, object())
    _answer_holding_the_loop(session, list(range(1, ANSWERS_PER_THREAD_WRITE + 1)))
    assert seen == [(10 - ANSWERS_PER_THREAD_WRITE, 10)]  # written before they are untracked
    assert session.calls_running() == len(session.running) == 10 - ANSWERS_PER_THREAD_WRITE


@pytest.mark.asyncio
async def test_on_a_link_only_the_loop_writes_every_answer_waits_for_the_loop() -> None:
    """gRPC's stream takes writes from the loop only: a thread never tries one, and however
    many answers wait, the loop writes them together, once."""
    link = _Link()
    session = _session(asyncio.get_running_loop(), link, thread_writes=False)
    inbox = session.callee.agent.inbox
    posted: list[object] = []
    post = inbox.post
    inbox.post = lambda item, **kw: (posted.append(item), post(item, **kw))  # type: ignore[method-assign]
    calls = list(range(1, 3 * ANSWERS_PER_THREAD_WRITE + 1))
    for call_id in calls:
        session.track(call_id, object())
    _answer_holding_the_loop(session, calls)
    assert len(posted) == 1  # one flush for the whole burst
    assert session.calls_running() == len(calls)  # nothing written yet
    await _settled(session, link, len(calls))
    assert link.by_thread == [] and link.by_loop == [calls]
    assert session.running == {}
