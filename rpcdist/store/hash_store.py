"""HashStore: an in-process store (tests, single-process programs).

Every operation runs on the store's loop over a :class:`~rpcdist.store.memory.KeyValueState`,
so blocked ``get``/``wait`` calls wake as soon as another task or thread sets the key::

    store = HashStore()
    store.set("a", b"1")
    assert store.add("n", 2) == 2
"""

from __future__ import annotations

from datetime import timedelta

from rpcdist.store.api import DEFAULT_TIMEOUT, Store
from rpcdist.store.memory import KeyValueState

__all__ = ["HashStore"]


class HashStore(Store):
    """A store held in this process's memory; share the object to share the data."""

    def __init__(self, timeout: float | timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self.state = KeyValueState()

    async def _set(self, key: str, value: bytes) -> None:
        self.state.set(key, value)

    async def _get(self, key: str, timeout: float) -> bytes:
        return await self.state.get(key, timeout)

    async def _add(self, key: str, amount: int) -> int:
        return self.state.add(key, amount)

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.state.compare_set(key, expected, desired)

    async def _wait(self, keys: list[str], timeout: float) -> None:
        await self.state.wait(keys, timeout)

    async def _check(self, keys: list[str]) -> bool:
        return self.state.check(keys)

    async def _delete_key(self, key: str) -> bool:
        return self.state.delete_key(key)

    async def _num_keys(self) -> int:
        return self.state.num_keys()

    def __repr__(self) -> str:
        return f"<HashStore keys={self.state.num_keys()}>"
