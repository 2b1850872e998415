"""Scenario of ``test_rref_riding_fetch.py``: a ``to_here()`` that rides on its RRef's creating
call, run by the multi-process harness.

``remote()`` over a link only the loop writes (gRPC's stream, or any link while metrics are on)
leaves the caller a moment later, on the loop; a ``to_here()`` made before then asks the owner
for the value in the creation's answer (``Envelope.with_value``) instead of sending a fetch of
its own. w0 drives every check, w1 owns the values. Both serve metrics, so the owner's count of
served calls shows which requests it received.

Importing this module registers ``rref_riding_fetch`` on ``rpc_scenarios`` (where ``_harness``
looks scenarios up), as ``rref_scenarios`` does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import rpc_functions as rf
import rpc_scenarios
import rref_functions as rrf
import torch
from _harness import check
from rpc_scenarios import finish, init

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
import rpcdist.rpc.rref as rref_module
from rpcdist import metrics
from rpcdist.errors import RpcError, RpcTimeoutError, SerializationError

CALL_TIMEOUT = 30.0
OWNER = "w1"
MANY = 200
THREADS, PER_THREAD = 8, 60


# ============================================================================ on the owner
def served_from(peer: str) -> dict[str, int]:
    """Calls this worker answered for ``peer`` so far, by function name (metrics are on)."""
    assert metrics.current is not None, "metrics are off"
    return {
        function: stats.ok + stats.error
        for (function, caller), stats in list(metrics.current.served.items())
        if caller == peer
    }


class Locked:
    """A value that cannot be pickled (it holds a lock)."""

    def __init__(self, number: int) -> None:
        self.lock = threading.Lock()
        self._number = number

    def number(self) -> int:
        return self._number


def with_lock(i: int) -> Locked:
    return Locked(i)


def owned_count() -> int:
    return rpc.debug_info()["owned_rrefs"]


def leaf_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A new leaf tensor requiring grad (its gradient lands here, in a context)."""
    return (a + b).requires_grad_()


def has_gradient(context_id: int, rref: rpc.RRef[torch.Tensor]) -> bool:
    """Whether the backward pass of ``context_id`` reached the value of ``rref`` here."""
    return rref.local_value() in dist_autograd.get_gradients(context_id)


# ============================================================================ helpers
def _served_since(before: dict[str, int]) -> dict[str, int]:
    now = rpc.rpc_sync(OWNER, served_from, ("w0",), timeout=CALL_TIMEOUT)
    return {name: count - before.get(name, 0) for name, count in now.items() if count != before.get(name, 0)}


def _wait_owned(count: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        rpc.rpc_sync(OWNER, rrf.debug, timeout=CALL_TIMEOUT)  # (collects garbage there)
        seen = rpc.rpc_sync(OWNER, owned_count, timeout=CALL_TIMEOUT)
        if seen == count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{OWNER} owns {seen} values, expected {count}")


def _seconds_to_time_out(rref: rpc.RRef[Any], timeout: float, what: str) -> float:
    """How long ``rref.to_here(timeout)`` took to raise RpcTimeoutError (AssertionError if it
    returned: ``what`` describes the value)."""
    start = time.monotonic()
    try:
        rref.to_here(timeout)
    except RpcTimeoutError:
        return time.monotonic() - start
    raise AssertionError(f"to_here({timeout}) of {what} returned")


def _unsent() -> int:
    return len(rref_module._context().unsent_creations)


# ============================================================================ the scenario
def rref_riding_fetch(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    opts.pop("scenarios_module", None)
    init(rank, world_size, init_method, metrics_port=0, **opts)
    if rank == 0:
        _drive()
    finish(rank, world_size)


def _drive() -> None:  # noqa: C901 - a list of independent checks
    add = f"{rf.add.__module__}.{rf.add.__qualname__}"
    with check("riding/one_request_and_answer_each") as c:
        before = rpc.rpc_sync(OWNER, served_from, ("w0",), timeout=CALL_TIMEOUT)
        values = [rpc.remote(OWNER, rf.add, (i, 1)).to_here(CALL_TIMEOUT) for i in range(MANY)]
        assert values == [i + 1 for i in range(MANY)], values[:5]
        served = _served_since(before)
        c.value = served
        # The values came in their creations' answers: the owner answered (next to) no fetch.
        # (A to_here() sends one when its thread lost the interpreter to the loop between
        # remote() and to_here(): a machine too busy to run it for 5 ms, now and then.)
        assert served.get(add) == MANY, served
        assert served.get("RRef.to_here", 0) <= MANY // 20, served

    with check("riding/tensor_value"):
        for size in (100_000, 2_000_000):  # 400 KB, and 8 MB: request and answer in chunks
            x = torch.arange(size, dtype=torch.float32)
            got = rpc.remote(OWNER, rf.add, (x, 1)).to_here(CALL_TIMEOUT)
            assert torch.equal(got, x + 1), size

    with check("riding/value_that_cannot_travel") as c:
        rref = rpc.remote(OWNER, with_lock, (7,))
        try:
            rref.to_here(CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - what the caller sees is the check
            error = exc
        else:
            raise AssertionError("to_here() of a value holding a lock returned")
        c.value = f"{type(error).__name__}: {error}"
        # As a fetch of its own would have failed: the pickling error, from the owner's to_here.
        assert isinstance(error, SerializationError) and "lock" in str(error), c.value
        assert (error.remote_worker, error.remote_function) == (OWNER, "RRef.to_here"), c.value
        # The creation succeeded: the RRef is confirmed and its value usable where it lives.
        assert rref.confirmed_by_owner()
        assert rref.rpc_sync(CALL_TIMEOUT).number() == 7
        del rref, error
        _wait_owned(0)

    with check("riding/failed_creation") as c:
        rref = rpc.remote(OWNER, rf.raise_value_error, ("made to fail",))
        try:
            rref.to_here(CALL_TIMEOUT)
        except ValueError as exc:
            c.value = str(exc)
            assert str(exc) == "made to fail" and exc.remote_worker == OWNER, (str(exc), vars(exc))
            assert not rref.confirmed_by_owner() or rref._confirmed is not None  # (it failed)
        else:
            raise AssertionError("to_here() of a failed creation returned")
        del rref
        _wait_owned(0)

    with check("riding/a_shorter_fetch_timeout_holds") as c:
        # The creation may take its 30 s; a to_here() allowed 0.3 s fails after 0.3 s (riding
        # on the creation or not), and the value is there for the next one.
        rref = rpc.remote(OWNER, rrf.made_slowly, (5, 1.5), timeout=CALL_TIMEOUT)
        c.value = _seconds_to_time_out(rref, 0.3, "a value made in 1.5 s")
        assert c.value < 1.2, c.value
        assert torch.equal(rref.to_here(CALL_TIMEOUT), rrf.make_value(5))
        del rref

    with check("riding/two_fetches_before_it_leaves") as c:
        before = rpc.rpc_sync(OWNER, served_from, ("w0",), timeout=CALL_TIMEOUT)
        rref = rpc.remote(OWNER, rf.add, (40, 2))
        first, second = rref.to_here_async(CALL_TIMEOUT), rref.to_here_async(CALL_TIMEOUT)
        assert (first.wait(), second.wait()) == (42, 42)
        c.value = _served_since(before)
        del rref, first, second

    with check("riding/not_into_an_autograd_context") as c:
        # A to_here() made in a distributed autograd context is a fetch of its own, recorded in
        # the context (the backward pass reaches the owner), even right after remote().
        before = rpc.rpc_sync(OWNER, served_from, ("w0",), timeout=CALL_TIMEOUT)
        rref = rpc.remote(OWNER, leaf_sum, (torch.ones(3, 3), torch.ones(3, 3)))
        with dist_autograd.context() as context_id:
            loss = rref.to_here(CALL_TIMEOUT).sum()
            dist_autograd.backward(context_id, [loss])
            assert rpc.rpc_sync(OWNER, has_gradient, (context_id, rref), timeout=CALL_TIMEOUT)
        c.value = _served_since(before)
        assert c.value.get("RRef.to_here") == 1, c.value
        del rref, loss

    with check("riding/threads_at_once"):
        failures: list[BaseException] = []

        def run(t: int) -> None:
            try:
                for i in range(PER_THREAD):
                    got = rpc.remote(OWNER, rf.add, (t * 1000 + i, 1)).to_here(CALL_TIMEOUT)
                    assert got == t * 1000 + i + 1, (t, i, got)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures[:3]
        assert not any(thread.is_alive() for thread in threads)
        _wait_owned(0)

    with check("riding/not_for_other_functions") as c:
        # A request may ask for the value-answering variant only of a function that has one.
        agent = rref_module._agent()
        asks = agent.submit(OWNER, rf.add, (1, 2), None, CALL_TIMEOUT, asks_value=lambda: True)
        try:
            asks.wait()
        except RpcError as exc:
            c.value = str(exc)
        else:
            raise AssertionError("a with-value request of rpc_functions.add was run")
        assert "cannot answer with the value" in c.value, c.value

    with check("riding/nothing_left_behind") as c:
        c.value = _unsent()
        assert c.value == 0
        _wait_owned(0)


def rref_riding_queued(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    """With one call in flight per peer (``max_inflight_calls_per_peer=1``), a ``remote()``
    waits behind a slow call, not encoded yet: a ``to_here()`` riding on it with a shorter
    timeout fails when that timeout passes, not once the creation has left."""
    opts.pop("scenarios_module", None)
    init(rank, world_size, init_method, **opts)
    if rank == 0:
        with check("riding/queued_creation_fetch_timeout") as c:
            slow = rpc.rpc_async(OWNER, rf.sleep_blocking, (2.0,), timeout=CALL_TIMEOUT)
            rref = rpc.remote(OWNER, rf.add, (1, 1), timeout=CALL_TIMEOUT)
            c.value = _seconds_to_time_out(rref, 0.3, "a creation queued behind a 2 s call")
            assert c.value < 1.5, c.value  # (the creation leaves after 2 s)
            assert rref.to_here(CALL_TIMEOUT) == 2
            slow.wait()
            del rref
            _wait_owned(0)
    finish(rank, world_size)


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks scenarios up (``rpc_scenarios``)."""
    rpc_scenarios.rref_riding_fetch = rref_riding_fetch  # type: ignore[attr-defined]
    rpc_scenarios.rref_riding_queued = rref_riding_queued  # type: ignore[attr-defined]


_register()
