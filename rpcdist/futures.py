"""rpcdist's Future: a ``torch.futures.Future`` that asyncio can await.

Every asynchronous rpcdist API returns one, and it *is* a torch future (a subclass), so
``torch.futures.wait_all``, ``torch.futures.collect_all``, ``then`` and
``add_done_callback`` work on it exactly as on torch's own. From plain threads use
``wait()``/``value()``; from any running event loop simply ``await`` it::

    fut = rpc.rpc_async("worker1", torch.add, args=(t, 1))
    result = fut.wait()                       # blocking, any thread but the rpcdist loop
    result = await fut                        # inside async code
    torch.futures.wait_all([fut, other])      # torch's helpers accept it

What rpcdist adds to torch's Future: ``await``; ``wait(timeout)``; ``exception()``; a
``wait()`` on the event loop that completes it raises ``BlockingCallError`` instead of
deadlocking; ``then`` returns an rpcdist Future (so it stays awaitable).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import weakref
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import torch

from rpcdist.errors import BlockingCallError

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")

__all__ = ["Future", "collect_all", "wait_all"]


class _Failure:
    """What a failed future holds on torch's (C++) side: a weak reference to the future.

    The exception itself stays in the Python object (``_error``), where the garbage collector
    sees it: an exception's traceback refers to frames that refer to the future, and a cycle
    through torch's C++ side could never be collected (RRefs in those frames would leak).
    """

    __slots__ = ("future",)

    def __init__(self, future: Future[Any]) -> None:
        self.future = weakref.ref(future)


# torch's C methods, called directly: torch.futures.Future's Python layer only forwards to them,
# and RPC makes a future per call.
_C = torch._C.Future
_c_init, _c_set_result, _c_done, _c_wait = _C.__init__, _C.set_result, _C.done, _C.wait
_c_add_done_callback, _c_set_unwrap_func = _C.add_done_callback, _C._set_unwrap_func


def _unwrap(value: Any) -> Any:
    """What ``wait()``/``value()`` give for the value torch holds: a failure raises."""
    if type(value) is not _Failure:
        return value
    future = value.future()
    error = future._error if future is not None else None
    del future
    if error is None:
        raise RuntimeError("the future failed, and its exception was freed with it")
    raise _fresh(error)


_failing = threading.Lock()  # serialises the claims of failures (see Future._try_complete)
_COMPLETED_TWICE = (
    "Attempting to mark a completed Future as complete again. "
    "Note that a Future can only be marked completed once."
)


def _fresh(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise (same type, message, attributes, notes and origin).

    Raising the stored exception itself would attach the waiting frames, which refer to the
    future, to an exception the future holds: a cycle that keeps whatever those frames hold
    (RRefs, tensors) alive until the garbage collector runs. A copy belongs to the caller.
    """
    try:
        clone = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt: raise it as is
        return error
    if type(clone) is not type(error):
        return error
    clone.__cause__ = error.__cause__
    clone.__context__ = error.__context__
    clone.__suppress_context__ = error.__suppress_context__
    return clone.with_traceback(error.__traceback__)


class Future(torch.futures.Future[T]):
    """The eventual result of an asynchronous operation (a ``torch.futures.Future``).

    Completion may happen on any thread; callbacks run on the thread that completes it.
    """

    __slots__ = ("_error", "_loop_hint")  # no per-future __dict__: RPC makes one per call

    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None, devices: Any = None) -> None:
        if devices:
            super().__init__(devices=devices)
        else:
            _c_init(self, [])
        self._error: BaseException | None = None
        # The loop whose thread completes this future, so wait() there can refuse to deadlock.
        self._loop_hint = loop

    # -- completing ----------------------------------------------------------------------------
    def set_result(self, result: T) -> None:
        """Complete with ``result`` (RuntimeError if already complete, as torch)."""
        if not self._try_complete(result, None):
            raise RuntimeError(_COMPLETED_TWICE)

    def set_exception(self, result: BaseException) -> None:  # type: ignore[override]
        """Complete with an exception: ``wait()``, ``value()`` and ``await`` raise it."""
        if not isinstance(result, BaseException):
            raise AssertionError(f"{result} is of type {type(result)}, not an Exception.")
        if not self._try_complete(None, result):
            raise RuntimeError(_COMPLETED_TWICE)

    def _try_complete(self, result: Any, exception: BaseException | None) -> bool:
        """Complete unless already complete; returns whether this call completed it.

        Completions may race (a reply, a timeout and a lost link): torch completes a future
        once and refuses the rest. A failure first claims the future under a lock (failures
        are rare, values never take it), so two failures cannot mix up their errors; a value
        that wins against a claimed failure undoes the claim.
        """
        if exception is None:
            try:
                _c_set_result(self, result)
            except RuntimeError as exc:
                if "complete" not in str(exc):
                    raise
                return False
            return True
        with _failing:
            if self._error is not None or _c_done(self):
                return False
            self._error = exception
        _c_set_unwrap_func(self, _unwrap)  # passes values through: harmless if a value wins
        try:
            _c_set_result(self, _Failure(self))  # callbacks run here, outside the lock
        except RuntimeError as exc:
            if "complete" not in str(exc):
                raise
            with _failing:
                self._error = None  # a value won: this future did not fail
            return False
        return True

    # -- inspecting -----------------------------------------------------------------------------
    def value(self) -> T:
        """The result of a completed future (raises its exception if it failed)."""
        if not _c_done(self):
            raise RuntimeError("Future.value() called before the future completed; use wait()")
        return _C.value(self)

    def exception(self) -> BaseException | None:
        """The exception of a completed, failed future (``None`` otherwise)."""
        return self._error

    def wait(self, timeout: float | None = None) -> T:
        """Block until complete, then return the result or raise the exception.

        ``timeout`` (seconds) bounds the wait with a ``TimeoutError``; RPC futures also carry
        their own call timeout.
        """
        if not _c_done(self):
            loop = self._loop_hint
            if loop is not None and _running_loop() is loop:
                raise BlockingCallError(
                    "Future.wait() on the rpcdist event loop would block it forever; use `await future`"
                )
            if timeout is not None:
                finished = threading.Event()
                _c_add_done_callback(self, lambda _: finished.set())
                if not finished.wait(timeout):
                    raise TimeoutError(f"Future not complete after {timeout} s")
        return _c_wait(self)

    # -- chaining ---------------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Call ``callback(self)`` once complete (at once if it already is). An exception in
        ``callback`` is logged, never raised into whoever completed the future."""
        if not callable(callback):
            raise TypeError(f"add_done_callback() needs a callable, not {type(callback).__name__}")

        def run(fut: Any) -> None:  # ``fut`` is this future (never ``self`` here: see _Failure)
            try:
                callback(fut)
            except Exception:
                log.exception("a Future callback raised")

        _c_add_done_callback(self, run)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new Future completed with ``callback(self)`` (or the exception it raises)."""
        if not callable(callback):
            raise TypeError(f"then() needs a callable, not {type(callback).__name__}")
        chained: Future[S] = Future(loop=self._loop_hint)

        def run(fut: Any) -> None:
            try:
                chained._try_complete(callback(fut), None)
            except BaseException as exc:  # noqa: BLE001 - the chained future carries it
                chained._try_complete(None, exc)

        _c_add_done_callback(self, run)
        return chained

    # -- asyncio -----------------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        if not _c_done(self):
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Any) -> None:
                if _running_loop() is loop:
                    _settle(waiter)
                else:
                    loop.call_soon_threadsafe(_settle, waiter)

            _c_add_done_callback(self, wake)
            yield from waiter.__await__()
        return _c_wait(self)

    def __repr__(self) -> str:
        state = "pending" if not _c_done(self) else ("failed" if self._error is not None else "done")
        return f"<rpcdist.Future {state}>"


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def collect_all(futures: Iterable[torch.futures.Future[Any]]) -> Future[list[Any]]:
    """A Future completed (with the list of input futures) once all of them are complete.

    Accepts rpcdist's and torch's futures; unlike ``torch.futures.collect_all`` the result is
    awaitable.
    """
    futures = list(futures)
    combined: Future[list[Any]] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        combined.set_result([])
        return combined

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result(futures)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def wait_all(futures: Iterable[torch.futures.Future[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every future; returns their values (raises the first failure, as torch's)."""
    futures = list(futures)
    collect_all(futures).wait(timeout)
    return [fut.wait() for fut in futures]
