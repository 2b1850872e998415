"""rpcdist's Future is a torch.futures.Future: torch's helpers and semantics work on it, and it
stays awaitable and safe to wait on from any thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from rpcdist.errors import BlockingCallError
from rpcdist.futures import Future, collect_all, wait_all


def _complete_later(fut: Future, value: object, delay: float = 0.05) -> None:
    threading.Timer(delay, fut.set_result, (value,)).start()


def test_is_a_torch_future_that_torch_helpers_accept() -> None:
    futs = [Future() for _ in range(3)]
    assert all(isinstance(f, torch.futures.Future) for f in futs)
    for i, fut in enumerate(futs):
        _complete_later(fut, i * 10, 0.02 * (i + 1))
    assert torch.futures.wait_all(futs) == [0, 10, 20]
    assert [f.wait() for f in torch.futures.collect_all(futs).wait()] == [0, 10, 20]


def test_set_exception_raises_from_wait_value_and_torch_wait_all() -> None:
    fut: Future[int] = Future()
    fut.set_exception(ValueError("boom"))
    assert fut.done() and isinstance(fut.exception(), ValueError)
    for get in (fut.wait, fut.value, lambda: torch.futures.wait_all([fut])):
        with pytest.raises(ValueError, match="boom"):
            get()


def test_completing_twice_raises_torchs_error() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="completed once"):
        fut.set_result(2)
    with pytest.raises(RuntimeError, match="completed once"):
        fut.set_exception(ValueError("late"))
    assert fut.wait() == 1 and fut.exception() is None


def test_racing_completions_keep_exactly_one_outcome() -> None:
    for _ in range(200):
        fut: Future[object] = Future()
        barrier = threading.Barrier(2)
        outcomes: list[bool] = []

        def complete(
            fut: Future[object], barrier: threading.Barrier, outcomes: list[bool], value: object, error: Any
        ) -> None:
            barrier.wait()
            outcomes.append(fut._try_complete(value, error))  # type: ignore[arg-type]

        threads = [
            threading.Thread(target=complete, args=(fut, barrier, outcomes, 1, None)),
            threading.Thread(target=complete, args=(fut, barrier, outcomes, None, ValueError("x"))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == [False, True]
        if fut.exception() is None:
            assert fut.wait() == 1
        else:
            with pytest.raises(ValueError):
                fut.wait()


def test_then_returns_an_awaitable_rpcdist_future_and_carries_errors() -> None:
    fut: Future[int] = Future()
    doubled = fut.then(lambda f: f.value() * 2)
    failing = fut.then(lambda f: 1 / 0)
    assert isinstance(doubled, Future)
    fut.set_result(21)
    assert doubled.wait() == 42
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    with pytest.raises(TypeError):
        fut.then(None)  # type: ignore[arg-type]


def test_a_then_callback_error_is_torchs_runtime_error_and_keeps_its_type() -> None:
    """torch raises a callback's error as RuntimeError("Got the following error when running the
    callback: ..."); rpcdist's is that RuntimeError and the original type at once."""
    fut: Future[int] = Future()
    failing = fut.then(lambda f: f + 1)  # a Future + 1: TypeError
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="running the callback: TypeError: unsupported operand") as caught:
        failing.wait()
    assert isinstance(caught.value, TypeError) and isinstance(caught.value.__cause__, TypeError)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        fut.then(None)  # type: ignore[arg-type]


def test_a_then_callback_may_block_on_a_future_the_loop_completes() -> None:
    """A future completed on its rpcdist loop runs then() callbacks off that loop, so one may
    wait() for another future the loop completes (as torch users do inside callbacks)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        first: Future[int] = Future(loop=loop)
        second: Future[int] = Future(loop=loop)
        chained = first.then(lambda f: f.value() + second.wait(timeout=30))
        first.set_result(1)  # on the loop: the callback must not run (and block) here
        second.set_result(2)
        return await chained

    assert asyncio.run(main()) == 3


def test_callbacks_get_the_future_itself_and_a_raising_callback_is_contained() -> None:
    fut: Future[int] = Future()
    seen: list[object] = []
    fut.add_done_callback(lambda f: 1 / 0)
    fut.add_done_callback(seen.append)
    fut.set_result(5)  # the first callback's error is logged, not raised here
    assert seen == [fut]
    late: list[object] = []
    fut.add_done_callback(late.append)
    assert late == [fut], "a callback added to a completed future runs at once"


def test_await_from_any_loop_and_wait_timeout() -> None:
    fut: Future[str] = Future()

    async def main() -> str:
        _complete_later(fut, "done")
        return await fut

    assert asyncio.run(main()) == "done"
    never: Future[str] = Future()
    with pytest.raises(TimeoutError):
        never.wait(0.05)


def test_wait_on_the_completing_loop_is_refused() -> None:
    async def main() -> None:
        fut: Future[int] = Future(loop=asyncio.get_running_loop())
        with pytest.raises(BlockingCallError):
            fut.wait()
        fut.set_result(3)
        assert await fut == 3

    asyncio.run(main())


def test_collect_all_and_wait_all_accept_torch_and_rpcdist_futures() -> None:
    ours: Future[int] = Future()
    theirs: torch.futures.Future[int] = torch.futures.Future()
    combined = collect_all([ours, theirs])
    _complete_later(ours, 1)
    threading.Timer(0.05, theirs.set_result, (2,)).start()
    assert [f.wait() for f in combined.wait(10)] == [1, 2]
    assert wait_all([ours, theirs], timeout=10) == [1, 2]


def test_a_failed_future_and_what_its_traceback_holds_are_collected() -> None:
    """The raised exception's traceback refers back to the future (and its caller's locals):
    that cycle must stay visible to the garbage collector, or RRefs in those frames leak."""
    import gc
    import weakref

    class Held:
        pass

    def fail_and_catch() -> weakref.ref[Held]:
        held = Held()  # a local of a frame the traceback keeps
        fut: Future[int] = Future()
        fut.set_exception(ValueError("collected?"))
        try:
            fut.wait()
        except ValueError as exc:
            fut.kept_error = exc  # type: ignore[attr-defined]  # future -> error -> frames -> future
        return weakref.ref(held)

    held_ref = fail_and_catch()
    gc.collect()
    assert held_ref() is None, "a failed future's traceback cycle was not collected"


def test_a_losing_completion_never_changes_the_outcome() -> None:
    failed: Future[int] = Future()
    assert failed._try_complete(None, ValueError("first"))
    assert not failed._try_complete(None, KeyError("second"))
    assert not failed._try_complete(5, None)
    with pytest.raises(ValueError, match="first"):
        failed.wait()
    assert isinstance(failed.exception(), ValueError)
    done: Future[int] = Future()
    assert done._try_complete(5, None)
    assert not done._try_complete(None, KeyError("late"))
    assert done.wait() == 5 and done.exception() is None


def test_racing_failures_keep_one_error() -> None:
    for _ in range(200):
        fut: Future[object] = Future()
        barrier = threading.Barrier(2)
        errors = [ValueError("a"), KeyError("b")]
        threads = [
            threading.Thread(target=lambda e=e, b=barrier, f=fut: (b.wait(), f._try_complete(None, e)))
            for e in errors
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        error = fut.exception()
        assert any(error is e for e in errors)
        with pytest.raises(type(error)):
            fut.wait()


@pytest.mark.filterwarnings("ignore:`torch.jit.wait` is deprecated:DeprecationWarning")
def test_torch_code_reading_the_future_in_cpp_sees_it_complete() -> None:
    """torch's C++ side is completed when torch code reads it there: collect_all/wait_all and
    torch.jit.wait (before or after completion), and torch._C readers through torch_future()."""
    pending: Future[int] = Future()
    collected = torch.futures.collect_all([pending])  # taken before completion
    _complete_later(pending, 7)
    assert [f.wait() for f in collected.wait()] == [7]
    assert torch.jit.wait(pending) == 7

    early: Future[int] = Future()
    early.set_result(3)
    assert torch.futures.wait_all([early]) == [3]  # taken after completion
    later: Future[int] = Future()
    _complete_later(later, 4)
    assert torch.jit.wait(later) == 4

    chained_in_cpp: Future[int] = Future()
    doubled = torch._C.Future.then(chained_in_cpp.torch_future(), lambda f: f.wait() * 2)
    chained_in_cpp.set_result(21)
    assert doubled.wait() == 42

    failing: Future[int] = Future()
    in_cpp = torch._C.Future.then(failing.torch_future(), lambda f: f.wait())
    failing.set_exception(ValueError("seen by torch"))
    with pytest.raises(RuntimeError, match="ValueError: seen by torch"):  # torch's wording
        in_cpp.wait()
    with pytest.raises(ValueError, match="seen by torch"):
        torch.futures.wait_all([failing])


def test_many_threads_waiting_on_one_future_all_wake() -> None:
    fut: Future[int] = Future()
    results: list[int] = []
    waiters = [threading.Thread(target=lambda: results.append(fut.wait(10))) for _ in range(8)]
    for t in waiters:
        t.start()
    fut.set_result(9)
    for t in waiters:
        t.join(10)
    assert results == [9] * 8
