"""Loop-side helpers every module uses (rpcdist._runtime)."""

from __future__ import annotations

import asyncio

import pytest

from rpcdist._runtime import wait_for

pytestmark = pytest.mark.timeout(30)


async def test_wait_for_returns_the_result_or_times_out() -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.call_soon(ready.set_result, 7)
    assert await wait_for(ready, 5) == 7
    never = loop.create_future()
    with pytest.raises(TimeoutError):
        await wait_for(never, 0.01)
    assert never.cancelled()  # what it waited on is not left pending
    assert await wait_for(asyncio.sleep(0, "no limit"), None) == "no limit"


async def test_wait_for_keeps_a_cancellation_that_arrives_as_the_result_does() -> None:
    """A task cancelled in the instant what it waits on completes stops (Python 3.11's
    asyncio.wait_for returned the result instead, and a keep-alive loop never stopped)."""
    loop = asyncio.get_running_loop()
    for _ in range(20):
        reply = loop.create_future()
        after: list[str] = []

        async def keep_alive(reply: asyncio.Future[str] = reply, after: list[str] = after) -> None:
            after.append(await wait_for(reply, 5))
            after.append("carried on")

        task = asyncio.create_task(keep_alive())
        await asyncio.sleep(0)  # the task waits on the reply
        reply.set_result("renewed")
        task.cancel()  # in the same loop iteration as the reply
        with pytest.raises(asyncio.CancelledError):
            await task
        assert after == []


def test_waiting_for_grpc_poller_thread_ends_it_or_leaves_it_to_its_user() -> None:
    """After its last gRPC object goes, shutdown waits for grpc.aio's poller thread to end; while
    someone else's channel lives, it does not wait (the thread rightly stays). A dead weak proxy
    on the heap (as torch and the test tools leave) must not break the check."""
    import gc
    import threading
    import time
    import weakref

    import grpc

    from rpcdist._runtime import _grpc_aio_in_use, _grpc_poller_threads, wait_grpc_poller_gone

    class Anything:
        pass

    target = Anything()
    dead_proxy = weakref.proxy(target)
    del target
    gc.collect()
    assert not _grpc_aio_in_use()  # (and no ReferenceError from the dead proxy)

    async def with_channel() -> None:
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        assert _grpc_poller_threads(), "grpc.aio started no poller thread"
        started = time.monotonic()
        wait_grpc_poller_gone(timeout=5.0)  # in use: returns at once
        assert time.monotonic() - started < 1.0
        assert _grpc_poller_threads()
        await channel.close()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(with_channel())
    loop.close()
    gc.collect()  # the channel's objects go; grpc.aio shuts down and stops its poller
    wait_grpc_poller_gone(timeout=5.0)
    assert not _grpc_poller_threads(), [t.name for t in threading.enumerate()]
    assert dead_proxy is not None  # (kept on the heap until here)


def test_waiting_for_grpc_poller_collects_a_cycle_that_keeps_grpc_alive() -> None:
    """gRPC objects that only a reference cycle still holds (as an exception's traceback
    holding the frames that held them) keep grpc's poller running until a garbage collection:
    the wait runs one once the thread outlives its grace, and the thread then ends."""
    import gc
    import threading

    import grpc

    from rpcdist._runtime import _grpc_poller_threads, wait_grpc_poller_gone

    class Holder:
        pass

    async def leave_a_channel_in_a_cycle() -> None:
        holder = Holder()
        holder.channel = grpc.aio.insecure_channel("127.0.0.1:1")  # type: ignore[attr-defined]
        await holder.channel.close()  # type: ignore[attr-defined]
        holder.itself = holder  # type: ignore[attr-defined]

    gc.collect()
    gc.disable()  # (no automatic collection may free the cycle first)
    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(leave_a_channel_in_a_cycle())
        loop.close()
        assert _grpc_poller_threads(), "the cycle's channel should keep grpc's poller running"
        wait_grpc_poller_gone(timeout=5.0)
        assert not _grpc_poller_threads(), [t.name for t in threading.enumerate()]
    finally:
        gc.enable()


def test_a_task_started_while_the_loop_winds_down_is_wound_down_too() -> None:
    """A task that a task being cancelled at shutdown starts (an incoming link's finish, when
    its peer closes it during our shutdown) is cancelled and run to its end before the loop
    closes: left pending, it was destroyed with the closed loop ("Task was destroyed but it
    is pending!", then its clean-up failing on the closed loop)."""
    import threading

    from rpcdist._runtime import LoopThread

    runner = LoopThread()
    loop = runner.loop
    cleaned: list[str] = []
    started = threading.Event()
    late_tasks: list[asyncio.Task[None]] = []

    async def late() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("late")

    async def first() -> None:
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            late_tasks.append(asyncio.get_running_loop().create_task(late()))
            cleaned.append("first")

    loop.call_soon_threadsafe(lambda: loop.create_task(first()))
    assert started.wait(5)
    runner.stop()
    assert loop.is_closed()
    assert cleaned == ["first", "late"]
    assert late_tasks and late_tasks[0].done()
