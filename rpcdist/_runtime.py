"""The event loop that owns a process's gRPC I/O, and the bridge from blocking code onto it.

Every loop-bound object (stores, the RPC agent) keeps its ``_loop``; its coroutine methods are
the real implementation and its blocking methods are made once, by :func:`blocking_twin`.
From synchronous programs the loop runs in one background thread, started on first use and
stopped when its last user releases it, so nothing is left running after shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import torch

from rpcdist.errors import BlockingCallError

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (much cheaper wake-ups and socket I/O), else asyncio's.

    ``RPCDIST_LOOP=asyncio`` forces the standard loop.
    """
    if os.environ.get("RPCDIST_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


def match_torch_threads() -> None:
    """Give a thread rpcdist starts the intra-op thread count ``torch.set_num_threads`` gave the
    process (call it first thing in the thread).

    OpenMP and MKL keep the team size per thread, and torch hands its setting to a new thread
    only when that thread first runs one of ATen's parallel loops: until then each matrix
    product runs with a team of one thread per core, even after ``torch.set_num_threads(1)``
    (what torchrun arranges for several processes per machine). On a busy machine every such
    op then waits for team members that are not running: a 2-layer MLP forward measured 30 µs
    on the main thread and 270-1,070 µs on another thread, 3 processes on 2 cores. torch's own
    thread pools do the same at start (``at::init_num_threads``); as theirs, a thread keeps the
    count it started with.
    """
    try:
        torch.set_num_threads(torch.get_num_threads())  # the getter reads the process's setting
    except RuntimeError as exc:  # a torch build whose pool cannot change any more
        log.debug("cannot match torch's thread count in %s: %s", threading.current_thread().name, exc)


pool_thread_of = threading.local()
"""``.pool``: on a worker-pool thread, its pool (see ``rpcdist.agent.threads.WorkerPool``)."""

channel_thread = threading.local()
"""``.serving``: True on the thread that reads a reply channel's requests and runs them (see
``rpcdist.transport.reply_channel``). It is no pool thread, and the caller on the other end
waits for its answer: a call it runs may wait right there for calls of its own."""


class blocking_wait:
    """``with blocking_wait():`` around a wait for something rpcdist completes (a Future):
    on a pool thread, its running place goes to a queued job meanwhile. Elsewhere a no-op."""

    __slots__ = ("_pool",)

    def __enter__(self) -> None:
        self._pool: Any = getattr(pool_thread_of, "pool", None)  # an agent.threads.WorkerPool
        if self._pool is not None:
            self._pool._blocked()

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool._unblocked()


_DRAIN_ROUNDS = 10  # (a task that starts another whenever it is cancelled must not hold it up)


class LoopThread:
    """An asyncio loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rpcdist-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        match_torch_threads()  # collectives reduce and inline handlers run torch ops here
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Drain what is left so nothing warns about pending tasks, then close. Again while
        # the draining starts new tasks (an incoming link's finish, when its peer closes it
        # meanwhile): one left pending would be destroyed with the closed loop.
        for _ in range(_DRAIN_ROUNDS):
            pending = asyncio.all_tasks(self.loop)
            if not pending:
                break
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is self._thread:
            # Stopped from code running on the loop (e.g. a blocking close() whose coroutine
            # releases the last use): the loop winds down once that code returns.
            return
        self._thread.join(timeout)


_shared: LoopThread | None = None
_shared_users = 0
_shared_lock = threading.Lock()


def acquire_loop() -> asyncio.AbstractEventLoop:
    """Start (or share) the background loop thread; pair every call with :func:`release_loop`."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread()
        _shared_users += 1
        return _shared.loop


def release_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Drop one use of the background loop; the last release stops its thread."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or _shared.loop is not loop:
            return
        _shared_users -= 1
        if _shared_users > 0:
            return
        thread, _shared = _shared, None
    thread.stop()


def stray_cancellation() -> bool:
    """Call in ``except asyncio.CancelledError``: whether the cancellation came from an awaited
    operation that someone else cancelled (a link's task stopped when its peer left, a call on
    a channel being closed), not from a cancellation of the running task itself — which a
    clean-up path may then treat as that operation's failure instead of giving up."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw`` for at most ``timeout`` seconds (None: no limit), else ``TimeoutError``.

    Use instead of ``asyncio.wait_for``: on Python 3.11 that one loses a cancellation of the
    waiting task that arrives as ``aw`` completes, and a task cancelled in that instant carries
    on as if nothing happened (an etcd client's keep-alive ran on forever that way, and its
    ``close()`` waited for it forever).
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # 3.10 has neither the fix nor asyncio.timeout


def current_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def call_blocking(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float | None = None
) -> T:
    """Run ``coro`` on ``loop`` and wait for it from this (non-loop) thread."""
    if current_loop() is loop:
        coro.close()
        raise BlockingCallError(
            "this blocking call would stall the event loop it needs; "
            "inside async code use the `await ..._async()` form"
        )
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the rpcdist event loop is closed (was shutdown() called?)")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on its owner ``loop`` from whatever loop is running here."""
    if current_loop() is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def blocking_twin(
    async_method: Callable[..., Awaitable[T]],
) -> Callable[..., T]:
    """Make the blocking form of a loop-bound object's ``async def x_async`` method."""

    @functools.wraps(async_method)
    def blocking(self: Any, *args: Any, **kwargs: Any) -> T:
        return call_blocking(self._loop, async_method(self, *args, **kwargs))

    blocking.__doc__ = f"Blocking form of :meth:`{async_method.__name__}`.\n\n{async_method.__doc__ or ''}"
    return blocking


def bound_twin(
    async_method: Callable[..., Awaitable[T]],
) -> Callable[..., Awaitable[T]]:
    """Wrap an ``async def`` method so it may be awaited from any loop (it runs on ``self._loop``)."""

    @functools.wraps(async_method)
    async def anywhere(self: Any, *args: Any, **kwargs: Any) -> T:
        return await run_on(self._loop, async_method(self, *args, **kwargs))

    return anywhere


def _grpc_poller_threads() -> list[threading.Thread]:
    """grpc.aio's completion-queue poller threads (named after their target by older grpcio)."""
    return [
        t for t in threading.enumerate() if t.name.endswith("(_poll_wrapper)") or t.name == "grpc-aio-poller"
    ]


def _grpc_aio_in_use() -> bool:
    """Whether any grpc.aio channel or server object still exists in this process (one that
    is not rpcdist's keeps grpc.aio, and its poller thread, running)."""
    from grpc._cython import cygrpc

    kinds = {k for k in (getattr(cygrpc, "AioChannel", None), getattr(cygrpc, "AioServer", None)) if k}
    # type(), not isinstance(): the heap holds weak proxies, and isinstance() of a dead one
    # raises ReferenceError. (Both classes are final: grpc.aio wraps them, never subclasses.)
    return any(type(obj) in kinds for obj in gc.get_objects())


POLLER_GRACE_SECONDS = 0.05
"""How long grpc's poller thread usually takes to end once grpc.aio shut down: waited for
before anything costlier (a garbage collection, a look over the heap)."""


def wait_grpc_poller_gone(timeout: float = 2.0) -> None:
    """After rpcdist dropped its last grpc.aio channel and server, wait until grpc's poller
    thread has ended.

    grpc.aio stops it as the last such object is freed, but the thread itself ends a moment
    later: a program that lists its threads right after ``shutdown()`` (or forks) saw it still
    there. When reference counting freed them, this costs that moment and nothing more. Only if
    the thread outlives it does a garbage collection run (a reference cycle, such as a
    traceback's frames, may still hold one; a full collection costs in proportion to the
    program's heap); then it gives up at once when grpc.aio is still in use by someone else
    (the thread then rightly stays)."""
    pollers = _grpc_poller_threads()
    deadline = time.monotonic() + timeout
    for thread in pollers:
        thread.join(POLLER_GRACE_SECONDS)
    if not _still_needed(pollers):
        return
    for thread in pollers:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.debug("grpc's poller thread %s still runs %.1f s after shutdown", thread.name, timeout)


async def wait_grpc_poller_gone_async(timeout: float = 2.0) -> None:
    """:func:`wait_grpc_poller_gone` for a running loop (polls; never blocks the loop, but for
    the garbage collection, when one is needed)."""
    pollers = _grpc_poller_threads()
    start = time.monotonic()
    await threads_ended(pollers, start + POLLER_GRACE_SECONDS)
    if not _still_needed(pollers):
        return
    await threads_ended(pollers, start + timeout)


async def threads_ended(threads: list[threading.Thread], until: float) -> None:
    """Return once every one of ``threads`` has ended, or at ``until`` (``time.monotonic()``),
    whichever comes first; polls, so the running loop goes on meanwhile."""
    while any(t.is_alive() for t in threads) and time.monotonic() < until:
        await asyncio.sleep(0.002)


def _still_needed(pollers: list[threading.Thread]) -> bool:
    """The poller outlived its grace: collect the garbage that may hold grpc.aio objects, and
    say whether waiting for the thread is worth it (no one else uses grpc.aio)."""
    if not any(t.is_alive() for t in pollers):
        return False
    gc.collect()
    return not _grpc_aio_in_use()
