"""The worker pool that runs blocking user functions (rpcdist.agent.threads.WorkerPool): at most
``running_limit`` jobs run at once, yet jobs that block never starve the ones queued behind them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from rpcdist.agent.threads import WorkerPool
from rpcdist.futures import Future

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in its own thread, as the agent's: it times the starvation checks."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


class Concurrency:
    """Counts how many jobs run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.done = 0
        self.all_done = threading.Event()

    def job(self, seconds: float, total: int) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
            self.done += 1
            if self.done == total:
                self.all_done.set()


def test_at_most_running_limit_jobs_run_at_once_and_all_run(loop: asyncio.AbstractEventLoop) -> None:
    pool = WorkerPool(16, "t", loop, running_limit=2, starvation_seconds=30.0)
    seen = Concurrency()
    try:
        for _ in range(40):
            pool.submit(lambda: seen.job(0.01, 40))
        assert seen.all_done.wait(20), f"{seen.done} of 40 jobs ran"
        assert seen.most == 2  # (the starvation rescue comes only after 30 s)
    finally:
        pool.shutdown()


def test_a_job_blocked_on_something_the_pool_cannot_see_does_not_starve_the_queue(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """One running place; the first job waits for an event that only the second job sets."""
    pool = WorkerPool(4, "t", loop, running_limit=1, starvation_seconds=0.05)
    released = threading.Event()
    finished = threading.Event()
    try:
        pool.submit(lambda: released.wait(30) and finished.set())
        pool.submit(released.set)
        assert finished.wait(10), "the blocked job was never released: the second job did not run"
    finally:
        pool.shutdown()


def test_a_job_waiting_for_an_rpcdist_future_lends_its_place_at_once(loop: asyncio.AbstractEventLoop) -> None:
    """No starvation rescue (it would take 30 s): the wait itself gives the place up."""
    pool = WorkerPool(4, "t", loop, running_limit=1, starvation_seconds=30.0)
    future: Future[int] = Future()
    got: list[int] = []
    finished = threading.Event()
    try:
        start = time.monotonic()
        pool.submit(lambda: (got.append(future.wait(20)), finished.set()))
        time.sleep(0.05)  # the first job is waiting now
        pool.submit(lambda: future.set_result(7))
        assert finished.wait(10)
        assert got == [7]
        assert time.monotonic() - start < 10
    finally:
        pool.shutdown()


def test_the_pool_never_starts_more_than_size_threads(loop: asyncio.AbstractEventLoop) -> None:
    pool = WorkerPool(3, "t", loop, running_limit=1, starvation_seconds=0.01)
    gate = threading.Event()
    started = threading.Semaphore(0)
    try:
        for _ in range(6):
            pool.submit(lambda: (started.release(), gate.wait(30)))
        for _ in range(3):
            assert started.acquire(timeout=10)
        time.sleep(0.2)
        assert not started.acquire(timeout=0), "a 4th job ran with 3 threads, all blocked"
        gate.set()
        for _ in range(3):
            assert started.acquire(timeout=10), "the jobs queued behind full threads never ran"
    finally:
        gate.set()
        pool.shutdown()


def test_shutdown_runs_the_jobs_already_queued(loop: asyncio.AbstractEventLoop) -> None:
    pool = WorkerPool(2, "t", loop, running_limit=1, starvation_seconds=30.0)
    ran: list[int] = []
    for i in range(10):
        pool.submit(lambda i=i: (time.sleep(0.001), ran.append(i)))
    pool.shutdown(timeout=10)
    assert sorted(ran) == list(range(10))
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_blocked_jobs_queued_from_the_loop_all_start_once_they_starve(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """One running place, 5 jobs that each wait until all 5 run: only the starvation rescue can
    run them; queued from the loop's own thread (the agent's callee), as from any other."""
    pool = WorkerPool(8, "t", loop, running_limit=1, starvation_seconds=0.05)
    together = threading.Barrier(5, timeout=20)
    finished = Concurrency()
    try:
        for _ in range(5):
            loop.call_soon_threadsafe(pool.submit, lambda: (together.wait(), finished.job(0, 5)))
        assert finished.all_done.wait(15), f"{finished.done} of 5 jobs finished"
    finally:
        pool.shutdown()


def test_a_queue_that_keeps_moving_runs_no_more_than_running_limit_jobs_at_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Jobs wait in the queue longer than ``starvation_seconds``, but a queued job starts every
    few milliseconds: nothing is stuck, so no job runs beyond the limit (extra threads would only
    take the interpreter lock from each other)."""
    pool = WorkerPool(8, "t", loop, running_limit=1, starvation_seconds=0.1)
    seen = Concurrency()
    total = 300
    try:
        for _ in range(total):  # 300 jobs of 2 ms: the last waits ~0.6 s, 6x the starvation limit
            pool.submit(lambda: seen.job(0.002, total))
        assert seen.all_done.wait(30), f"{seen.done} of {total} jobs ran"
        assert seen.most == 1
    finally:
        pool.shutdown()
