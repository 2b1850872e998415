"""The Store interface (c10d semantics) shared by every backend, and PrefixStore.

A store is a small key-value service that workers use to find each other. Each backend
implements the ``*_async`` coroutines; the blocking methods with torch's names
(``set``, ``get``, ``add``, ...) are made from them once, here::

    store = HashStore()
    store.set("answer", b"42")
    assert store.get("answer") == b"42"          # blocking, from plain code
    value = await store.get_async("answer")       # from async code, any loop

Values are bytes (``str`` is encoded as UTF-8 on the way in). ``get`` and ``wait`` block until
the keys exist or the timeout passes (:class:`~rpcdist.errors.StoreTimeoutError`).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable
from datetime import timedelta

from rpcdist._runtime import (
    acquire_loop,
    blocking_twin,
    bound_twin,
    call_blocking,
    current_loop,
    release_loop,
)

DEFAULT_TIMEOUT = 300.0

__all__ = ["Store", "PrefixStore", "DEFAULT_TIMEOUT", "to_bytes", "to_seconds"]


def to_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """Store values are bytes; text is UTF-8."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, not {type(value).__name__}")


def to_seconds(timeout: float | timedelta | None, default: float) -> float:
    """Accept seconds or a ``timedelta`` (torch's form); ``None`` means ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class Store(abc.ABC):
    """A c10d-style key-value store bound to one event loop (``self._loop``).

    Subclasses implement the ``_*`` coroutines; they always run on ``self._loop``.
    """

    def __init__(self, timeout: float | timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = to_seconds(timeout, DEFAULT_TIMEOUT)
        running = current_loop()
        self._owns_loop = running is None
        self._loop: asyncio.AbstractEventLoop = acquire_loop() if running is None else running
        self._closed = False

    # -- what a backend implements (runs on self._loop) -------------------------------------
    @abc.abstractmethod
    async def _set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    async def _get(self, key: str, timeout: float) -> bytes: ...

    @abc.abstractmethod
    async def _add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    @abc.abstractmethod
    async def _wait(self, keys: list[str], timeout: float) -> None: ...

    @abc.abstractmethod
    async def _check(self, keys: list[str]) -> bool: ...

    @abc.abstractmethod
    async def _delete_key(self, key: str) -> bool: ...

    @abc.abstractmethod
    async def _num_keys(self) -> int: ...

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Release connections/files (optional)."""

    # -- public coroutine API (awaitable from any loop) --------------------------------------
    @property
    def timeout(self) -> timedelta:
        """Default timeout of ``get``/``wait``."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: float | timedelta) -> None:
        self._timeout = to_seconds(timeout, self._timeout)

    @bound_twin
    async def set_async(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``, replacing any old value."""
        await self._set(key, to_bytes(value))

    @bound_twin
    async def get_async(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """The value of ``key``, waiting until it is set (raises StoreTimeoutError after timeout)."""
        return await self._get(key, to_seconds(timeout, self._timeout))

    @bound_twin
    async def add_async(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); returns the new value.

        Raises StoreValueError if ``key`` holds something that is not an integer.
        """
        return await self._add(key, int(amount))

    @bound_twin
    async def compare_set_async(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it currently holds ``expected``; returns the value now held.

        An empty ``expected`` matches an absent key (torch's semantics).
        """
        return await self._compare_set(key, to_bytes(expected), to_bytes(desired))

    @bound_twin
    async def wait_async(self, keys: Iterable[str], timeout: float | timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set (raises StoreTimeoutError after timeout)."""
        await self._wait(_key_list(keys), to_seconds(timeout, self._timeout))

    @bound_twin
    async def check_async(self, keys: Iterable[str]) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        return await self._check(_key_list(keys))

    @bound_twin
    async def delete_key_async(self, key: str) -> bool:
        """Delete ``key``; returns whether it existed."""
        return await self._delete_key(key)

    @bound_twin
    async def num_keys_async(self) -> int:
        """How many keys the store holds."""
        return await self._num_keys()

    async def close_async(self) -> None:
        """Release this client's resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if current_loop() is self._loop or self._loop.is_closed():
            await self._close()
        else:
            await bound_twin(Store._close)(self)
        if self._owns_loop and current_loop() is not self._loop:
            release_loop(self._loop)
        # On its own loop thread the loop cannot stop itself here: close() releases it
        # from the calling thread once this has run.

    # -- blocking twins, torch's names --------------------------------------------------------
    set = blocking_twin(set_async)
    get = blocking_twin(get_async)
    add = blocking_twin(add_async)
    compare_set = blocking_twin(compare_set_async)
    wait = blocking_twin(wait_async)
    check = blocking_twin(check_async)
    delete_key = blocking_twin(delete_key_async)
    num_keys = blocking_twin(num_keys_async)

    def close(self) -> None:
        """Blocking form of :meth:`close_async`."""
        if self._closed:
            return
        if self._loop.is_closed():
            self._closed = True
            return
        call_blocking(self._loop, self.close_async())
        if self._owns_loop:
            release_loop(self._loop)  # from this thread, so the loop thread is joined

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key_list(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, str):
        return [keys]
    return list(keys)


class PrefixStore(Store):
    """A view of ``store`` in which every key is prefixed with ``prefix + "/"``.

    ``num_keys`` counts the whole underlying store, as torch's PrefixStore does.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.underlying_store = store
        self._timeout = store._timeout
        self._loop = store._loop
        self._owns_loop = False
        self._closed = False

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    async def _set(self, key: str, value: bytes) -> None:
        await self.underlying_store._set(self._k(key), value)

    async def _get(self, key: str, timeout: float) -> bytes:
        return await self.underlying_store._get(self._k(key), timeout)

    async def _add(self, key: str, amount: int) -> int:
        return await self.underlying_store._add(self._k(key), amount)

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return await self.underlying_store._compare_set(self._k(key), expected, desired)

    async def _wait(self, keys: list[str], timeout: float) -> None:
        await self.underlying_store._wait([self._k(k) for k in keys], timeout)

    async def _check(self, keys: list[str]) -> bool:
        return await self.underlying_store._check([self._k(k) for k in keys])

    async def _delete_key(self, key: str) -> bool:
        return await self.underlying_store._delete_key(self._k(key))

    async def _num_keys(self) -> int:
        return await self.underlying_store._num_keys()
