"""A thread-safe Future in the shape of ``torch.futures.Future`` that asyncio can await.

Every asynchronous rpcdist API returns one. From plain threads use ``wait()``/``value()``;
from any running event loop simply ``await`` it::

    fut = rpc.rpc_async("worker1", torch.add, args=(t, 1))
    result = fut.wait()          # blocking, any thread but the rpcdist loop
    result = await fut           # inside async code
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar

from rpcdist.errors import BlockingCallError

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")

__all__ = ["Future", "collect_all", "wait_all"]

_PENDING = object()


class Future(Generic[T]):
    """The eventual result of an asynchronous operation.

    Completion may happen on any thread; callbacks run on the thread that completes it.
    """

    __slots__ = ("_lock", "_result", "_exception", "_callbacks", "_event", "_loop_hint")

    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._lock = threading.Lock()
        self._result: Any = _PENDING
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self._event: threading.Lock | None = None  # held while a thread waits; released on completion
        # The loop whose thread completes this future, so wait() there can refuse to deadlock.
        self._loop_hint = loop

    # -- completing ----------------------------------------------------------------------------
    def set_result(self, result: T) -> None:
        """Complete with ``result`` (an error if already complete)."""
        self._complete(result, None)

    def set_exception(self, exception: BaseException) -> None:
        """Complete with ``exception``: ``wait()``, ``value()`` and ``await`` raise it."""
        self._complete(None, exception)

    def _complete(self, result: Any, exception: BaseException | None) -> None:
        with self._lock:
            if self._result is not _PENDING or self._exception is not None:
                raise RuntimeError("this Future is already complete")
            if exception is None:
                self._result = result
            else:
                self._exception = exception
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.release()
        for callback in callbacks:
            self._run_callback(callback)

    def _try_complete(self, result: Any, exception: BaseException | None) -> bool:
        """Complete unless already complete; returns whether this call completed it."""
        try:
            self._complete(result, exception)
        except RuntimeError:
            return False
        return True

    def _run_callback(self, callback: Callable[[Future[T]], None]) -> None:
        try:
            callback(self)
        except Exception:
            log.exception("a Future callback raised")

    # -- inspecting -----------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the result (or an exception) is set."""
        return self._result is not _PENDING or self._exception is not None

    def value(self) -> T:
        """The result of a completed future (raises its exception if it failed)."""
        if self._exception is not None:
            raise self._exception
        if self._result is _PENDING:
            raise RuntimeError("Future.value() called before the future completed; use wait()")
        return self._result

    def exception(self) -> BaseException | None:
        """The exception of a completed, failed future (``None`` otherwise)."""
        return self._exception

    def wait(self, timeout: float | None = None) -> T:
        """Block until complete, then return the result or raise the exception.

        ``timeout`` (seconds) bounds the wait with a ``TimeoutError``; RPC futures also carry
        their own call timeout.
        """
        if not self.done():
            loop = self._loop_hint
            if loop is not None and _running_loop() is loop:
                raise BlockingCallError(
                    "Future.wait() on the rpcdist event loop would block it forever; use `await future`"
                )
            with self._lock:
                if not self.done() and self._event is None:
                    self._event = threading.Lock()
                    self._event.acquire()
                event = self._event
            if event is not None:
                # A plain lock is the cheapest cross-thread wake-up; pass it on to the next waiter.
                if not event.acquire(timeout=-1 if timeout is None else timeout):
                    raise TimeoutError(f"Future not complete after {timeout} s")
                event.release()
        return self.value()

    # -- chaining ---------------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Call ``callback(self)`` once complete (at once if it already is)."""
        with self._lock:
            if not self.done():
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new Future completed with ``callback(self)`` (or the exception it raises)."""
        chained: Future[S] = Future(loop=self._loop_hint)

        def run(fut: Future[T]) -> None:
            try:
                chained.set_result(callback(fut))
            except BaseException as exc:  # noqa: BLE001 - the chained future carries it
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    # -- asyncio -----------------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        if not self.done():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Future[T]) -> None:
                if _running_loop() is loop:
                    _settle(waiter)
                else:
                    loop.call_soon_threadsafe(_settle, waiter)

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.value()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exception else "done")
        return f"<rpcdist.Future {state}>"


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def collect_all(futures: Iterable[Future[Any]]) -> Future[list[Future[Any]]]:
    """A Future completed (with the list of input futures) once all of them are complete."""
    futures = list(futures)
    combined: Future[list[Future[Any]]] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        combined.set_result([])
        return combined

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result(futures)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def wait_all(futures: Iterable[Future[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every future; returns their values (raises the first failure)."""
    futures = list(futures)
    collect_all(futures).wait(timeout)
    return [fut.value() for fut in futures]
