"""The in-memory core of a c10d store: a key-value map whose waiters wake when keys appear.

:class:`KeyValueState` holds the data of :class:`~rpcdist.store.HashStore` and of the gRPC
store server. It is asyncio-based and bound to whichever loop uses it: every method must be
called on that one loop (the mutating operations are plain methods, atomic because they never
suspend; ``get`` and ``wait`` are coroutines). Waiters do not poll: each blocked ``get``/``wait``
parks a future on one missing key and is woken when that key is set.

The pure helpers :func:`apply_add` and :func:`apply_compare_set` carry torch's semantics for
``add`` and ``compare_set`` over any ``dict[str, bytes]``; the file store reuses them.

``add`` may carry a :class:`RequestId` (client id + sequence number): the state remembers the
result of each identified add, so a client that retries an add whose reply it never received
gets the original result back instead of adding twice. The memory this takes is bounded: a
client tells, with each add, the lowest sequence number it still has in flight
(:attr:`RequestId.low`), and every result below it is forgotten; at most
:data:`MAX_REQUESTS_PER_CLIENT` results per client and :data:`MAX_CLIENTS` clients (least
recently seen dropped first) are kept.

Subclasses can make the state durable: every change calls :meth:`KeyValueState._journal` after
it is applied, every change first asks :meth:`KeyValueState._writable`, and
:meth:`KeyValueState.flushed` waits until what has been changed so far is safe
(:class:`rpcdist.store.durable.DurableKeyValueState` logs to disk; here it returns at once).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from rpcdist._runtime import wait_for
from rpcdist.errors import StoreTimeoutError, StoreValueError

log = logging.getLogger(__name__)

__all__ = [
    "KeyValueState",
    "RequestId",
    "apply_add",
    "apply_compare_set",
    "parse_counter",
    "timeout_error",
    "MAX_CLIENTS",
    "MAX_REQUESTS_PER_CLIENT",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Bounds of the table of remembered add results (see the module docstring).
MAX_CLIENTS = 16384
MAX_REQUESTS_PER_CLIENT = 4096
CLIENT_ID_BYTES = 16


@dataclass(frozen=True)
class RequestId:
    """Identifies one ``add`` of one client, so that a retry of it is recognised.

    ``client`` is the client's random 16-byte id, ``seq`` the add's sequence number (unique per
    client) and ``low`` the lowest sequence number the client still awaits a reply for (the
    results of its adds below ``low`` may be forgotten).
    """

    client: bytes
    seq: int
    low: int

    def __post_init__(self) -> None:
        if len(self.client) != CLIENT_ID_BYTES:
            raise StoreValueError(
                f"a request's client id must be {CLIENT_ID_BYTES} bytes, not {len(self.client)}"
            )
        if not 0 <= self.low <= self.seq < 2**64:
            raise StoreValueError(f"bad request sequence numbers: seq={self.seq} low={self.low}")


_INTEGER = re.compile(rb"[+-]?[0-9]+")


def parse_counter(key: str, value: bytes) -> int:
    """The integer a counter value holds (decimal ASCII, as torch writes it).

    Raises StoreValueError naming ``key`` when ``value`` is not a decimal integer.
    """
    if _INTEGER.fullmatch(value) is None:
        shown = value if len(value) <= 32 else value[:32] + b"..."
        raise StoreValueError(f"cannot add to store key {key!r}: its value {shown!r} is not an integer")
    return int(value)


def apply_add(data: dict[str, bytes], key: str, amount: int) -> int:
    """Add ``amount`` to the counter at ``key`` in ``data`` (0 when absent); returns the new value.

    The value is stored as decimal ASCII bytes. On error (non-integer value, int64 overflow)
    ``data`` is left unchanged and StoreValueError is raised.
    """
    old = data.get(key)
    current = 0 if old is None else parse_counter(key, old)
    new = current + int(amount)
    if not INT64_MIN <= new <= INT64_MAX:
        raise StoreValueError(f"cannot add {amount} to store key {key!r}: the result overflows int64")
    data[key] = str(new).encode("ascii")
    return new


def apply_compare_set(
    data: dict[str, bytes], key: str, expected: bytes, desired: bytes
) -> tuple[bytes, bool]:
    """torch's ``compare_set`` over ``data``; returns ``(result, changed)``.

    - key absent and ``expected`` empty: set ``desired``, return it;
    - key absent and ``expected`` non-empty: change nothing, return ``expected`` (as torch does);
    - value equals ``expected``: set ``desired``, return it;
    - otherwise: change nothing, return the current value.
    """
    current = data.get(key)
    if (current is None and not expected) or (current is not None and current == expected):
        data[key] = desired
        return desired, True
    if current is None:
        return expected, False
    return current, False


def timeout_error(missing: Iterable[str], timeout: float) -> StoreTimeoutError:
    """The StoreTimeoutError for keys that did not appear within ``timeout`` seconds."""
    missing = list(missing)
    noun = "key" if len(missing) == 1 else "keys"
    return StoreTimeoutError(
        f"timed out after {timeout:g} s waiting for store {noun} {', '.join(map(repr, missing))}"
    )


class KeyValueState:
    """Keys to bytes, with waiters that wake when keys are set.

    Timeouts are in seconds; ``None``, a value ``<= 0`` (torch's ``kNoTimeout`` is 0) or an
    infinite/NaN one waits without limit.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        # client id -> {seq: (key, result)}, least recently seen client first
        self._requests: OrderedDict[bytes, dict[int, tuple[str, int]]] = OrderedDict()

    # -- mutations (atomic: they never suspend) ------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``, replacing any old value."""
        self._writable()
        value = bytes(value)
        self._data[key] = value
        self._journal("set", key, value)
        self._notify(key)

    def add(self, key: str, amount: int, request: RequestId | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); returns the new value.

        With a ``request`` id already seen, nothing is added and the first result is returned
        (a retried add applies once). Raises StoreValueError (nothing changed) if the value
        held is not an integer, or if ``request`` was first used for another key.
        """
        if request is not None:
            known = self._recall(request)
            if known is not None:
                first_key, result = known
                if first_key != key:
                    raise StoreValueError(
                        f"add request {request.seq} of client {request.client.hex()} was first made "
                        f"for key {first_key!r}, now for {key!r}"
                    )
                log.debug("add %d of client %s is a retry: %d", request.seq, request.client.hex(), result)
                return result
        self._writable()
        new = apply_add(self._data, key, amount)
        if request is not None:
            self._remember(request, key, new)
        self._journal("add", key, self._data[key], request)
        self._notify(key)
        return new

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare-and-set; see :func:`apply_compare_set`."""
        self._writable()
        result, changed = apply_compare_set(self._data, key, bytes(expected), bytes(desired))
        if changed:
            self._journal("set", key, result)
            self._notify(key)
        return result

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        self._writable()
        if self._data.pop(key, None) is None:
            return False
        self._journal("delete", key)
        return True

    # -- durability hooks ----------------------------------------------------------------------
    async def flushed(self) -> None:
        """Return once every change made so far is safe (durable states: on disk).

        Call it before answering anyone, so that no answer reveals a change that a crash could
        still undo. In memory there is nothing to wait for.
        """

    async def close(self) -> None:
        """Release what the state holds besides memory (durable states: their files)."""

    def _writable(self) -> None:
        """Raise instead of changing anything when changes can no longer be kept (hook)."""

    def _journal(
        self, op: str, key: str, value: bytes | None = None, request: RequestId | None = None
    ) -> None:
        """Called after each change is applied (hook): ``op`` is ``"set"`` (``key`` now holds
        ``value``), ``"add"`` (likewise, made by the add ``request``) or ``"delete"``."""

    # -- remembered add results ----------------------------------------------------------------
    def _recall(self, request: RequestId) -> tuple[str, int] | None:
        """The (key, result) of an add already made under ``request``; forgets the client's
        results below ``request.low``."""
        done = self._requests.get(request.client)
        if done is None:
            return None
        self._requests.move_to_end(request.client)
        for seq in [s for s in done if s < request.low]:
            del done[seq]
        return done.get(request.seq)

    def _remember(self, request: RequestId, key: str, result: int) -> None:
        done = self._requests.get(request.client)
        if done is None:
            done = self._requests[request.client] = {}
            while len(self._requests) > MAX_CLIENTS:
                self._requests.popitem(last=False)
        else:
            self._requests.move_to_end(request.client)
        for seq in [s for s in done if s < request.low]:
            del done[seq]
        done[request.seq] = (key, result)
        while len(done) > MAX_REQUESTS_PER_CLIENT:
            del done[min(done)]

    def requests(self) -> dict[bytes, dict[int, tuple[str, int]]]:
        """A copy of the remembered add results: client id -> {seq: (key, result)}."""
        return {client: dict(done) for client, done in self._requests.items()}

    # -- reads ---------------------------------------------------------------------------------
    def check(self, keys: Iterable[str]) -> bool:
        """Whether every key in ``keys`` is set."""
        return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        """How many keys are set."""
        return len(self._data)

    def get_nowait(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it is not set."""
        return self._data.get(key)

    def snapshot(self) -> dict[str, bytes]:
        """A copy of every key and value (for inspection and tests)."""
        return dict(self._data)

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it is set; StoreTimeoutError after ``timeout``."""
        await self.wait([key], timeout)
        # wait() returned without suspending after seeing the key, so it is still there.
        return self._data[key]

    async def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; StoreTimeoutError (naming the missing keys)
        after ``timeout`` seconds."""
        keys = list(keys)
        loop = asyncio.get_running_loop()
        limited = timeout is not None and 0 < timeout < math.inf
        deadline = loop.time() + timeout if limited else None
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise timeout_error(missing, float(timeout or 0))
            # Park on the first missing key; re-check everything when it is set.
            key = missing[0]
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(key, set()).add(waiter)
            try:
                await wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass  # the loop re-checks the keys, then raises with the ones still missing
            finally:
                self._forget(key, waiter)

    # -- internals -----------------------------------------------------------------------------
    def _notify(self, key: str) -> None:
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _forget(self, key: str, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters is None:
            return
        waiters.discard(waiter)
        if not waiters:
            del self._waiters[key]

    def __repr__(self) -> str:
        return f"<KeyValueState keys={len(self._data)} waiting_on={len(self._waiters)}>"
