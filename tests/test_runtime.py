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
