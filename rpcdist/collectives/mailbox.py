"""Matching of incoming point-to-point messages with the receives waiting for them.

Messages are keyed by (group, tag); within a key they are kept in arrival order, and
messages from one sender arrive in the order it sent them, so a receive for ``src`` always
gets that sender's oldest unclaimed message. A receive with ``src=None`` takes the oldest
message from anyone.

A sender that is gone (its link lost) fails the receives waiting for it, and later ones,
until a message from it arrives again; what it sent before it went is still delivered.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

Key = tuple[int, Any]  # (group id, tag)


class Mailbox:
    """Lives on the process's event loop; every method runs there."""

    def __init__(self) -> None:
        self._messages: dict[Key, collections.deque[tuple[int, Any]]] = {}
        self._waiters: dict[Key, collections.deque[tuple[int | None, asyncio.Future[tuple[int, Any]]]]] = {}
        self._gone: dict[int, Callable[[], BaseException]] = {}

    def sender_gone(self, src: int, error: Callable[[], BaseException]) -> None:
        """Global rank ``src`` is gone: receives waiting for it fail with ``error()`` now, and so
        do later ones that find none of its messages here."""
        self._gone[src] = error
        for waiters in self._waiters.values():
            for wanted, future in waiters:
                if wanted == src and not future.done():
                    future.set_exception(error())

    def deliver(self, key: Key, src: int, payload: Any) -> None:
        """A message from global rank ``src`` has arrived."""
        self._gone.pop(src, None)  # it is back (a new link)
        waiters = self._waiters.get(key)
        if waiters:
            for index, (wanted, future) in enumerate(waiters):
                if future.done():
                    continue
                if wanted is None or wanted == src:
                    del waiters[index]
                    future.set_result((src, payload))
                    return
        self._messages.setdefault(key, collections.deque()).append((src, payload))

    async def take(self, key: Key, src: int | None) -> tuple[int, Any]:
        """The oldest message under ``key`` from ``src`` (any sender if None): (src, payload)."""
        queue = self._messages.get(key)
        if queue:
            for index, (sender, payload) in enumerate(queue):
                if src is None or sender == src:
                    del queue[index]
                    if not queue:
                        del self._messages[key]
                    return sender, payload
        if src is not None and src in self._gone:
            raise self._gone[src]()
        future: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(key, collections.deque())
        waiters.append((src, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # arrived as we gave up: keep it
                self._messages.setdefault(key, collections.deque()).appendleft(future.result())
            raise
        finally:
            if not future.done() or future.cancelled():
                try:
                    waiters.remove((src, future))
                except ValueError:
                    pass
            if not waiters:
                self._waiters.pop(key, None)

    def pending(self) -> int:
        """Messages received and not yet claimed (for leak checks)."""
        return sum(len(q) for q in self._messages.values())
