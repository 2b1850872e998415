"""Threads around the agent's event loop: an inbox that runs callables on the loop, and the pool
that runs blocking user functions.

Both coalesce wake-ups: under load, many items cost one ``call_soon_threadsafe``. Every thread
rpcdist starts runs torch ops with the process's intra-op thread count
(:func:`rpcdist._runtime.match_torch_threads`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sized
from typing import Any

from rpcdist._runtime import match_torch_threads, pool_thread_of

log = logging.getLogger(__name__)


class LoopInbox:
    """Run callables on ``loop`` in the order posted, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[tuple[Callable[[], Any], bool]] = collections.deque()
        self._sending: collections.deque[None] = collections.deque()  # one mark per item that sends
        self._scheduled = False

    def post(self, item: Callable[[], Any], sends: bool = True) -> None:
        """Run ``item`` on the loop after everything posted before it. ``sends=False``: it
        sends no call or notice on this worker's own links (bookkeeping, an answer), so a
        thread may write its own call meanwhile (see :attr:`sending`)."""
        if sends:
            self._sending.append(None)
        self._items.append((item, sends))
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # loop closed: nothing will run it
                self._scheduled = False
                raise

    @property
    def pending(self) -> bool:
        """Whether posted callables are waiting to run."""
        return bool(self._items)

    @property
    def sending(self) -> bool:
        """Whether posted callables that may send calls or notices are waiting to run: a thread
        that writes its own call checks it, so as not to overtake a call being started."""
        return bool(self._sending)

    def _drain(self) -> None:
        self._scheduled = False
        items = self._items
        while items:
            # Left in the queue while it runs: ``pending`` and ``sending`` stay true until it
            # has (so that a call it starts is on its way before a thread may write its own).
            item, sends = items[0]
            try:
                item()
            except Exception:
                log.exception("callback posted to the rpcdist loop raised")
            finally:
                items.popleft()
                if sends:
                    self._sending.popleft()


class EmptyWaiter:
    """Lets the loop wait until a container that other code (any thread) empties is empty:
    a session's running calls before it closes, the calls in flight before shutdown."""

    __slots__ = ("_container", "_waiter")

    def __init__(self, container: Sized) -> None:
        self._container = container
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Return once the container is empty (loop only)."""
        loop = asyncio.get_running_loop()
        while True:
            # The waiter exists before the container is looked at: whoever empties it after
            # this look sees the waiter and wakes it.
            waiter = self._waiter = loop.create_future()
            if not self._container:
                break
            await waiter
        self._waiter = None

    def wake_if_empty(self) -> None:
        """Call after taking something out of the container (any thread)."""
        waiter = self._waiter
        if waiter is None or self._container:
            return
        loop = waiter.get_loop()
        if asyncio._get_running_loop() is loop:
            settle(waiter)
        else:
            loop.call_soon_threadsafe(settle, waiter)


def settle(waiter: asyncio.Future[None]) -> None:
    """Complete a loop-side waiter with None, unless it is done already (loop only)."""
    if not waiter.done():
        waiter.set_result(None)


class WorkerPool:
    """The threads that run blocking user functions: up to ``size`` threads, started on
    demand, of which at most ``running_limit`` (the machine's cores) run at once.

    Why a limit: Python threads share one interpreter lock, and torch releases it around
    every op, so N threads running small torch functions at once hand the lock back and forth
    at each op. With 8 concurrent calls on 2 cores, an RL agent spent 1.5x the CPU per call
    with 16 threads running as with 2, and served 1.4x as many calls with 2. A thread that
    finishes its job takes the next one queued itself (no wake-up of another thread).

    Jobs may block, so the limit cannot be strict:
    - a job waiting for an rpcdist future (a nested ``rpc_sync``, ``to_here()``, a distributed
      backward pass) gives its place up while it waits (:func:`blocking_wait`);
    - a job queued for ``starvation_seconds`` while no job started starts anyway (the running
      ones are long, or block on something the pool cannot see: a lock, a sleep, I/O), up to
      ``size`` threads. No job waits long behind jobs that cannot finish.

    That check is a timer on ``loop`` (the agent's event loop), armed while jobs are queued: a
    busy loop runs it between its I/O at no wake-up of its own. A watchdog thread polling every
    ``starvation_seconds`` cost 0.6-0.9 thread switches per call with 16 workers on 2 cores, and
    ran the queue's jobs on extra threads whenever the process had merely not been scheduled.
    """

    def __init__(
        self,
        size: int,
        name: str,
        loop: asyncio.AbstractEventLoop,
        running_limit: int | None = None,
        starvation_seconds: float = 0.01,
    ) -> None:
        self._size = size
        self._name = name
        self._loop = loop
        self._limit = max(1, min(size, running_limit if running_limit is not None else _cores()))
        self._starvation = starvation_seconds
        self._jobs: collections.deque[tuple[float, Callable[[], Any]]] = collections.deque()  # (since, job)
        self._lock = threading.Lock()
        self._idle: list[_PoolThread] = []  # parked threads, the most recent last (warm caches)
        self._threads: list[threading.Thread] = []
        self._running = 0  # threads running a job and not in a blocking_wait
        self._last_start = 0.0  # (monotonic) when a queued job last started (the queue moved)
        self._check_armed = False  # a starvation check is scheduled on the loop
        self._closed = False

    def submit(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("worker pool is shut down")
            if self._running < self._limit and not self._jobs and self._start_locked(job):
                return
            self._jobs.append((time.monotonic(), job))
            self._watch_locked()

    def enter(self) -> bool:
        """A thread outside the pool (a reply channel's: see ``rpcdist.agent.callee``) takes a
        running place to run a job itself, if one is free and no job is queued; until
        :meth:`leave`, a :func:`blocking_wait` on it gives the place up as on a pool thread."""
        with self._lock:
            if self._closed or self._running >= self._limit or self._jobs:
                return False
            self._running += 1
        pool_thread_of.pool = self
        return True

    def leave(self) -> None:
        """The thread that :meth:`enter`-ed is done: its place goes to a queued job, if any."""
        pool_thread_of.pool = None
        with self._lock:
            self._give_place_locked()

    def _give_place_locked(self) -> None:
        """A running place is free: queued jobs take the free places."""
        self._running -= 1
        while self._jobs and self._running < self._limit and self._capacity_locked():
            self._start_queued_locked()

    def _start_queued_locked(self) -> None:
        """Start the oldest queued job (there is one, and a thread for it)."""
        self._last_start = time.monotonic()
        self._start_locked(self._jobs.popleft()[1])

    def _capacity_locked(self) -> bool:
        return bool(self._idle) or len(self._threads) < self._size

    def _start_locked(self, job: Callable[[], Any]) -> bool:
        """Run ``job`` on an idle thread, or a new one; False if all ``size`` are busy."""
        if self._idle:
            worker = self._idle.pop()
        elif len(self._threads) < self._size:
            worker = _PoolThread(self)
            thread = threading.Thread(
                target=worker.run, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        else:
            return False
        self._running += 1
        worker.give(job)
        return True

    def _next_locked(self, worker: _PoolThread) -> Callable[[], Any] | None:
        """A thread finished a job: its next one, or None (it parks)."""
        self._running -= 1
        if self._jobs and (self._running < self._limit or self._closed):
            self._running += 1
            self._last_start = time.monotonic()
            return self._jobs.popleft()[1]
        if self._closed:
            return _STOP
        self._idle.append(worker)
        return None

    def _blocked(self) -> None:
        """The calling pool thread waits for something rpcdist completes: its place goes."""
        with self._lock:
            self._give_place_locked()

    def _unblocked(self) -> None:
        with self._lock:
            self._running += 1  # (may be above the limit for a while: no new job starts)

    def _watch_locked(self) -> None:
        """Jobs are queued: make sure a starvation check is due on the loop."""
        if self._check_armed:
            return
        self._check_armed = True
        delay = self._jobs[0][0] + self._starvation - time.monotonic()
        try:
            if asyncio._get_running_loop() is self._loop:
                self._loop.call_later(delay, self._check)
            else:
                self._loop.call_soon_threadsafe(self._loop.call_later, delay, self._check)
        except RuntimeError:  # the loop is closed: the agent is going; running jobs drain the queue
            self._check_armed = False

    def _check(self) -> None:
        """The starvation check (loop only): start the jobs that waited ``starvation_seconds``
        while no queued job started; then check again while jobs are queued."""
        with self._lock:
            self._check_armed = False
            if self._closed:
                return
            now = time.monotonic()
            last_start = self._last_start  # (before this check starts any)
            while self._jobs:
                due = max(self._jobs[0][0], last_start) + self._starvation - now
                if due > 0:
                    break
                if not self._capacity_locked():
                    due = self._starvation  # all ``size`` threads are busy
                    break
                self._start_queued_locked()
            else:
                return
            self._check_armed = True
        self._loop.call_later(due, self._check)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the threads (after the jobs already queued); waits up to ``timeout``."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.give(_STOP)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _stop() -> None:
    """Marks the end of a pool thread."""


_STOP: Callable[[], Any] = _stop


class _PoolThread:
    """One pool thread: parks on its own lock until handed a job (no shared queue to contend)."""

    __slots__ = ("_pool", "_wake", "_job")

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._wake = threading.Lock()
        self._wake.acquire()
        self._job: Callable[[], Any] | None = None

    def give(self, job: Callable[[], Any]) -> None:
        self._job = job
        self._wake.release()

    def run(self) -> None:
        match_torch_threads()
        pool = self._pool
        pool_thread_of.pool = pool  # (blocking_wait finds it)
        while True:
            self._wake.acquire()
            job, self._job = self._job, None
            while job is not None:
                if job is _STOP:
                    return
                try:
                    job()
                except Exception:
                    log.exception("job in %s raised", pool._name)
                del job
                with pool._lock:
                    job = pool._next_locked(self)
