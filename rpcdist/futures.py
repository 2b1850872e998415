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
import concurrent.futures
import copy
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import torch

from rpcdist._runtime import blocking_wait, match_torch_threads, threads_ended
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


# torch's C methods, called directly: torch.futures.Future's Python layer only forwards to them.
_C = torch._C.Future
_c_init, _c_set_result, _c_set_unwrap_func = _C.__init__, _C.set_result, _C._set_unwrap_func


def _unwrap(value: Any) -> Any:
    """What torch's side gives for the value it holds (``wait_all`` etc.): a failure raises."""
    if type(value) is not _Failure:
        return value
    future = value.future()
    error = future._error if future is not None else None
    del future
    if error is None:
        raise RuntimeError("the future failed, and its exception was freed with it")
    raise _fresh(error)


# Serialises completions and the registration of callbacks and waiters (held for a few
# attribute writes: far cheaper than a lock per future, which RPC would make per call).
_state_lock = threading.Lock()
_PENDING, _DONE, _FAILED = 0, 1, 2
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

    Completion may happen on any thread; callbacks run on the thread that completes it (at
    once on the calling thread when added to a completed future). ``then`` callbacks of a future
    that an rpcdist event loop completes run on a pool thread instead, so they may block, as in
    torch.

    The outcome lives in Python; torch's (C++) side of the future is completed only for torch
    code that reads it there: ``torch.futures.collect_all``/``wait_all`` and ``torch.jit.wait``
    (rpcdist arranges it), or whoever called :meth:`torch_future`. Completing torch's side
    releases the GIL, and on a busy process that is a thread switch per completed call.
    """

    __slots__ = (
        "_state",
        "_result",
        "_error",
        "_callbacks",
        "_waiter",
        "_torch_side",
        "_loop_hint",
        "_pull",
        "_interrupt",
    )

    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None, devices: Any = None) -> None:
        if devices:
            super().__init__(devices=devices)
        else:
            _c_init(self, [])
        self._state = _PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] | None = None
        self._waiter: threading.Lock | None = None  # held until completion, for blocked threads
        self._torch_side = False  # torch's C++ side is completed too (see torch_future)
        # The loop whose thread completes this future, so wait() there can refuse to deadlock.
        self._loop_hint = loop
        # Set on a call answered on a reply channel: what the first wait() runs to read the
        # answer on its own thread (pull(timeout); see rpcdist.transport.reply_channel).
        self._pull: Callable[[float | None], None] | None = None
        # ... and what stops that reading when the future is completed another way.
        self._interrupt: Callable[[], None] | None = None

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

        Completions may race (a reply, a timeout and a lost link): the first one wins, as in
        torch, and the others change nothing.
        """
        with _state_lock:
            if self._state:
                return False
            if exception is None:
                self._result = result
                self._state = _DONE
            else:
                self._error = exception
                self._state = _FAILED
            callbacks, self._callbacks = self._callbacks, None
            waiter, torch_side = self._waiter, self._torch_side
            interrupt, self._interrupt = self._interrupt, None
        if interrupt is not None:
            interrupt()
        if torch_side:
            self._complete_torch_side()
        if waiter is not None:
            waiter.release()
        if callbacks:
            for callback in callbacks:
                callback(self)
        return True

    def _complete_torch_side(self) -> None:
        if self._state == _FAILED:
            _c_set_unwrap_func(self, _unwrap)
            # torch holds a weak reference: the exception stays in Python (see _Failure)
            _c_set_result(self, _Failure(self))
        else:
            _c_set_result(self, self._result)

    def torch_future(self) -> Future[T]:
        """This future, with torch's C++ side kept complete: for torch code that reads the
        future in C++ (a DDP communication hook's return value, ``torch._C`` functions).
        ``torch.futures.collect_all``/``wait_all`` and ``torch.jit.wait`` need no call."""
        with _state_lock:
            if self._torch_side:
                return self
            self._torch_side = True
            done = self._state != _PENDING
        if done:
            self._complete_torch_side()
        return self

    # -- inspecting -----------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the future is complete (with a value or an exception)."""
        return self._state != _PENDING

    def value(self) -> T:
        """The result of a completed future (raises its exception if it failed)."""
        state = self._state
        if state == _DONE:
            return self._result
        if state == _FAILED:
            raise _fresh(self._error)  # type: ignore[arg-type]
        raise RuntimeError("Future.value() called before the future completed; use wait()")

    def exception(self) -> BaseException | None:
        """The exception of a completed, failed future (``None`` otherwise)."""
        return self._error

    def wait(self, timeout: float | None = None) -> T:
        """Block until complete, then return the result or raise the exception.

        ``timeout`` (seconds) bounds the wait with a ``TimeoutError``; RPC futures also carry
        their own call timeout.
        """
        if self._state == _PENDING:
            loop = self._loop_hint
            if loop is not None and _running_loop() is loop:
                raise BlockingCallError(
                    "Future.wait() on the rpcdist event loop would block it forever; use `await future`"
                )
            if self._pull is not None:
                self._pulled(timeout)
            with _state_lock:
                waiter = self._waiter
                if waiter is None and self._state == _PENDING:
                    waiter = self._waiter = threading.Lock()
                    waiter.acquire()
            if waiter is not None:
                with blocking_wait():  # (a worker-pool thread lends its running place meanwhile)
                    acquired = waiter.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
                if not acquired:
                    raise TimeoutError(f"Future not complete after {timeout} s")
                waiter.release()  # the next blocked thread, if any, goes on too
        return self.value()

    def _pulled(self, timeout: float | None) -> None:
        """Read this future's answer on this thread, if no other thread does (see ``_pull``)."""
        with _state_lock:
            pull, self._pull = self._pull, None
        if pull is not None and self._state == _PENDING:
            pull(timeout)

    # -- chaining ---------------------------------------------------------------------------------
    def _on_done(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` once complete (now if it is); its exceptions propagate."""
        if self._state == _PENDING:
            with _state_lock:
                if self._state == _PENDING:
                    if self._callbacks is None:
                        self._callbacks = [callback]
                    else:
                        self._callbacks.append(callback)
                    return
        callback(self)

    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Call ``callback(self)`` once complete (at once if it already is). An exception in
        ``callback`` is logged, never raised into whoever completed the future."""
        if not callable(callback):
            raise TypeError(f"add_done_callback() needs a callable, not {type(callback).__name__}")

        def run(fut: Future[T]) -> None:
            try:
                callback(fut)
            except Exception:
                log.exception("a Future callback raised")

        self._on_done(run)

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new Future completed with ``callback(self)`` (or the exception it raises)."""
        if not callable(callback):  # (torch's wording: its pybind11 refusal)
            raise TypeError(
                f"then(): incompatible function arguments: needs a callable, not {type(callback).__name__}"
            )
        chained: Future[S] = Future(loop=self._loop_hint)

        def run(fut: Future[T]) -> None:
            try:
                outcome = callback(fut)
            except BaseException as exc:  # noqa: BLE001 - the chained future carries it
                chained._try_complete(None, _callback_error(exc))
            else:
                chained._try_complete(outcome, None)

        def run_off_loop(fut: Future[T]) -> None:
            # A callback may block (torch users call wait() on another RPC in it, as torch runs
            # callbacks on its pool threads): never on the rpcdist loop that completes RPCs.
            loop = self._loop_hint
            if loop is not None and _running_loop() is loop:
                _callback_pool().submit(run, fut)
            else:
                run(fut)

        self._on_done(run_off_loop)
        return chained

    # -- asyncio -----------------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, T]:
        if self._state == _PENDING:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Any) -> None:
                if _running_loop() is loop:
                    _settle(waiter)
                else:
                    loop.call_soon_threadsafe(_settle, waiter)

            self._on_done(wake)
            yield from waiter.__await__()
        return self.value()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<rpcdist.Future {state}>"


_CALLBACK_THREADS = 32  # threads for then() callbacks of futures completed on an rpcdist loop


@functools.cache
def _callback_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        _CALLBACK_THREADS, thread_name_prefix="rpcdist-then", initializer=match_torch_threads
    )


_stopping: list[concurrent.futures.ThreadPoolExecutor] = []  # told to stop, not yet waited for


def _forget_threads_in_child() -> None:
    _callback_pool.cache_clear()
    _stopping.clear()


os.register_at_fork(after_in_child=_forget_threads_in_child)  # a child has none of its threads


def stop_callback_threads(timeout: float | None = None) -> None:
    """End the threads that run ``then`` callbacks (RPC shutdown and destroy_process_group call
    it; they are made again on next use). ``timeout``: seconds to wait for running callbacks,
    also of pools an earlier call stopped without waiting (None: do not wait)."""
    stopper = _stop_callback_pools(wait=timeout is not None)
    if stopper is not None:
        stopper.join(timeout)


async def stop_callback_threads_async(timeout: float = 5.0) -> None:
    """:func:`stop_callback_threads` with a ``timeout``, for a running loop (polls; never
    blocks the loop, which a callback's own RPC may still need)."""
    stopper = _stop_callback_pools(wait=True)
    if stopper is not None:
        await threads_ended([stopper], time.monotonic() + timeout)


def _stop_callback_pools(wait: bool) -> threading.Thread | None:
    """Tell the callback pools to stop; with ``wait``, a started thread that ends once their
    threads have (None: nothing to wait for)."""
    pools = list(_stopping)
    if _callback_pool.cache_info().currsize:
        pools.append(_callback_pool())
        _callback_pool.cache_clear()
    if not pools:
        return None
    if not wait:
        for pool in pools:
            pool.shutdown(wait=False)
        _stopping[:] = pools  # a later call that waits waits for them
        return None
    _stopping.clear()

    def stop_all() -> None:
        for pool in pools:
            pool.shutdown(wait=True)

    stopper = threading.Thread(target=stop_all, name="then-callbacks-stop", daemon=True)
    stopper.start()
    return stopper


_CALLBACK_ERROR = "Got the following error when running the callback: "


@functools.cache
def _callback_error_type(kind: type[Exception]) -> type[Exception]:
    """``kind`` that is also a RuntimeError (see :func:`_callback_error`)."""
    def __reduce__(self: BaseException) -> Any:  # by its original type: it pickles (over RPC too)
        return _rebuild_callback_error, (kind, str(self))

    namespace = {"__module__": kind.__module__, "__reduce__": __reduce__}
    return type(kind.__name__, (kind, RuntimeError), namespace)


def _rebuild_callback_error(kind: type[Exception], message: str) -> BaseException:
    return _callback_error_type(kind)(message)


def _callback_error(exc: BaseException) -> BaseException:
    """What a chained future holds when its ``then`` callback raised ``exc``.

    torch raises every callback error as a RuntimeError ("Got the following error when running
    the callback: TypeError: ..."), and torch users catch that; rpcdist keeps the original type
    too, so ``except TypeError`` works as well. RuntimeErrors (rpcdist's errors) stay as they are.
    """
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    message = f"{_CALLBACK_ERROR}{type(exc).__name__}: {exc}"
    try:
        wrapped: BaseException = _callback_error_type(type(exc))(message)
    except Exception:  # noqa: BLE001 - a type that cannot be subclassed or built from a message
        wrapped = RuntimeError(message)
    wrapped.__cause__ = exc
    return wrapped.with_traceback(exc.__traceback__)


def _failure_of(fut: torch.futures.Future[Any]) -> BaseException | None:
    """The exception of a completed future (rpcdist's or torch's), None if it succeeded."""
    if isinstance(fut, Future):
        return fut.exception()
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001 - torch's future holds it
        return exc
    return None


def _collect_all_failing_early(futures: list[Any]) -> Future[list[Any]]:
    """``torch._C._collect_all`` for lists with rpcdist futures: complete with the list once
    all are complete, or with the first failure as soon as it happens (as torch's does, so
    ``torch.futures.wait_all`` raises it without waiting for the others)."""
    combined: Future[list[Any]] = Future()
    if not futures:
        combined.set_result([])
        return combined
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(fut: Any) -> None:
        failure = _failure_of(fut)
        if failure is not None:
            combined._try_complete(None, failure)
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined._try_complete(futures, None)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def _install_torch_hooks() -> None:
    """Make torch's C++ readers of futures see rpcdist futures complete.

    ``torch.futures.collect_all``/``wait_all`` and ``torch.jit.wait`` look ``torch._C``'s
    functions up at each call, so wrapping those two covers every import of them.
    """
    if getattr(torch._C._collect_all, "_rpcdist_wrapped", False):
        return
    collect_all_c, wait_c = torch._C._collect_all, torch._C.wait

    def collect_all_hook(futures: Any) -> Any:
        futures = list(futures)
        if any(isinstance(fut, Future) for fut in futures):
            return _collect_all_failing_early(futures).torch_future()  # C++ may read it too
        return collect_all_c(futures)

    def wait_hook(future: Any) -> Any:
        if isinstance(future, Future):
            return future.wait()  # torch's C wait keeps the GIL: whoever completes it could not
        return wait_c(future)

    for hook, name in ((collect_all_hook, "_collect_all"), (wait_hook, "wait")):
        hook._rpcdist_wrapped = True  # type: ignore[attr-defined]
        setattr(torch._C, name, hook)


_install_torch_hooks()


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
    deadline = None if timeout is None else time.monotonic() + timeout
    for fut in futures:  # answers this thread reads itself (rpcdist's internal waits)
        if type(fut) is Future and fut._pull is not None:
            fut._pulled(None if deadline is None else deadline - time.monotonic())
    if not all(fut.done() for fut in futures):  # (all done already: the common case above)
        collect_all(futures).wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
    return [fut.wait() for fut in futures]
