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
import queue
import threading
from collections.abc import Callable
from typing import Any

from rpcdist._runtime import match_torch_threads

log = logging.getLogger(__name__)


class LoopInbox:
    """Run callables on ``loop`` in the order posted, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[Callable[[], Any]] = collections.deque()
        self._scheduled = False

    def post(self, item: Callable[[], Any]) -> None:
        self._items.append(item)
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

    def _drain(self) -> None:
        self._scheduled = False
        items = self._items
        while items:
            # Left in the queue while it runs: ``pending`` stays true until it has (a thread
            # that writes its own call checks it, so as not to overtake a call being started).
            item = items[0]
            try:
                item()
            except Exception:
                log.exception("callback posted to the rpcdist loop raised")
            finally:
                items.popleft()


class WorkerPool:
    """A bounded set of threads, started on demand, that run blocking jobs in order.

    Each job reserves an idle thread at submission (or starts one while below ``size``), so
    a burst of jobs gets as many threads as it needs, up to the bound.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("worker pool is shut down")
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        self._jobs.put(job)

    def _work(self) -> None:
        match_torch_threads()
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("job in %s raised", self._name)
            del job
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the threads (after the jobs already queued); waits up to ``timeout``."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
