"""The in-memory core of a c10d store: a key-value map whose waiters wake when keys appear.

:class:`KeyValueState` holds the data of :class:`~rpcdist.store.HashStore` and of the gRPC
store server. It is asyncio-based and bound to whichever loop uses it: every method must be
called on that one loop (the mutating operations are plain methods, atomic because they never
suspend; ``get`` and ``wait`` are coroutines). Waiters do not poll: each blocked ``get``/``wait``
parks a future on one missing key and is woken when that key is set.

The pure helpers :func:`apply_add` and :func:`apply_compare_set` carry torch's semantics for
``add`` and ``compare_set`` over any ``dict[str, bytes]``; the file store reuses them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Iterable

from rpcdist.errors import StoreTimeoutError, StoreValueError

log = logging.getLogger(__name__)

__all__ = ["KeyValueState", "apply_add", "apply_compare_set", "parse_counter", "timeout_error"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
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

    # -- mutations (atomic: they never suspend) ------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``, replacing any old value."""
        self._data[key] = bytes(value)
        self._notify(key)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); returns the new value.

        Raises StoreValueError (nothing changed) if the value held is not an integer.
        """
        new = apply_add(self._data, key, amount)
        self._notify(key)
        return new

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare-and-set; see :func:`apply_compare_set`."""
        result, changed = apply_compare_set(self._data, key, bytes(expected), bytes(desired))
        if changed:
            self._notify(key)
        return result

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        return self._data.pop(key, None) is not None

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
                await asyncio.wait_for(waiter, remaining)
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
