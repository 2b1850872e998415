"""FileStore: a store kept in one file, for processes that share a filesystem.

Layout and concurrency
----------------------
The whole store lives in the file at ``path``, rewritten on every change:

* **Writers** (set, add, compare_set, delete_key) serialise on an exclusive ``fcntl.lockf``
  lock of the sidecar file ``path + ".lock"`` (plus a per-path thread lock, because POSIX record
  locks are per process). Under the lock they read the file, apply the operation, write the
  new contents to a temporary file in the same directory and ``os.replace`` it over ``path``.
* **Readers** (get, wait, check, num_keys) take no lock: ``os.replace`` is atomic, so a reader
  always opens either the old or the new complete file.
* ``get``/``wait`` cannot be told when the file changes, so they re-read it with a short
  backoff (1 ms doubling to 50 ms) until the keys appear or the timeout passes.

All file I/O runs in worker threads (``asyncio.to_thread``), never on the event loop.
Nothing is fsync'ed: the store is for the lifetime of a job, not crash durability.

File format (all integers big-endian)::

    b"RDFS" | u16 version=1 | u16 0 | u32 n_meta | n_meta entries | u32 n_keys | n_keys entries
    entry = u32 key_len | key (UTF-8) | u64 value_len | value

A missing or empty file is an empty store. Anything else that does not parse is reported as a
StoreError. The meta section holds bookkeeping (how many stores have closed) that does not
count as keys.

With ``world_size > 0`` the file (and its lock file) is removed when ``world_size`` stores
have closed, as torch's FileStore does; with the default ``-1`` the file is left in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

from rpcdist.errors import StoreError
from rpcdist.store.api import DEFAULT_TIMEOUT, Store
from rpcdist.store.memory import apply_add, apply_compare_set, timeout_error

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["FileStore"]

_MAGIC = b"RDFS"
_VERSION = 1
_HEADER = struct.Struct(">4sHH")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_FINISHED_KEY = "finished"

_POLL_START = 0.001
_POLL_CAP = 0.05

# POSIX record locks belong to the process, so threads of one process also need a lock of
# their own per file.
_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(path: str) -> threading.Lock:
    with _thread_locks_guard:
        lock = _thread_locks.get(path)
        if lock is None:
            lock = _thread_locks[path] = threading.Lock()
        return lock


class _Contents:
    """Decoded file: user keys and bookkeeping."""

    __slots__ = ("data", "meta")

    def __init__(self, data: dict[str, bytes] | None = None, meta: dict[str, bytes] | None = None) -> None:
        self.data: dict[str, bytes] = data if data is not None else {}
        self.meta: dict[str, bytes] = meta if meta is not None else {}


def _encode(contents: _Contents) -> bytes:
    parts = [_HEADER.pack(_MAGIC, _VERSION, 0)]
    for section in (contents.meta, contents.data):
        parts.append(_U32.pack(len(section)))
        for key, value in section.items():
            raw_key = key.encode("utf-8")
            parts += [_U32.pack(len(raw_key)), raw_key, _U64.pack(len(value)), value]
    return b"".join(parts)


def _decode(raw: bytes, path: str) -> _Contents:
    if not raw:
        return _Contents()

    def corrupt(why: str) -> StoreError:
        return StoreError(f"{path!r} is not a valid rpcdist FileStore file ({why})")

    if len(raw) < _HEADER.size:
        raise corrupt("too short for the header")
    magic, version, _ = _HEADER.unpack_from(raw, 0)
    if magic != _MAGIC:
        raise corrupt(f"unknown header {raw[:8]!r}")
    if version != _VERSION:
        raise corrupt(f"format version {version}, this rpcdist reads version {_VERSION}")
    pos = _HEADER.size
    sections: list[dict[str, bytes]] = []
    try:
        for _ in range(2):
            (count,) = _U32.unpack_from(raw, pos)
            pos += _U32.size
            section: dict[str, bytes] = {}
            for _ in range(count):
                (key_len,) = _U32.unpack_from(raw, pos)
                pos += _U32.size
                key = raw[pos : pos + key_len]
                pos += key_len
                (value_len,) = _U64.unpack_from(raw, pos)
                pos += _U64.size
                value = raw[pos : pos + value_len]
                pos += value_len
                if len(key) != key_len or len(value) != value_len:
                    raise corrupt("truncated entry")
                section[key.decode("utf-8")] = value
            sections.append(section)
    except (struct.error, UnicodeDecodeError) as exc:
        raise corrupt(f"truncated or garbled: {exc}") from None
    if pos != len(raw):
        raise corrupt(f"{len(raw) - pos} unexpected trailing bytes")
    return _Contents(data=sections[1], meta=sections[0])


class FileStore(Store):
    """A store in the file ``path``, shared by every process that opens the same path.

    ``world_size > 0``: remove the file once that many stores have closed (torch's behaviour).
    """

    def __init__(
        self, path: str | os.PathLike[str], world_size: int = -1, timeout: float | timedelta = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__(timeout)
        self.path = os.path.abspath(os.fspath(path))
        self.lock_path = self.path + ".lock"
        self.world_size = world_size

    # -- file access (worker threads only) -----------------------------------------------------
    def _load(self) -> _Contents:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return _Contents()
        except OSError as exc:
            raise StoreError(f"cannot read the FileStore file {self.path!r}: {exc}") from exc
        return _decode(raw, self.path)

    def _store(self, contents: _Contents) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(_encode(contents))
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreError(f"cannot write the FileStore file {self.path!r}: {exc}") from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with _thread_lock(self.lock_path):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                raise StoreError(f"cannot open the FileStore lock file {self.lock_path!r}: {exc}") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _mutate(self, change: Callable[[_Contents], tuple[T, bool]]) -> T:
        """Apply ``change`` under the lock; it returns (result, whether to write)."""
        with self._locked():
            contents = self._load()
            result, changed = change(contents)
            if changed:
                self._store(contents)
            return result

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(fn, *args)

    async def _wait_for(self, keys: list[str], timeout: float) -> dict[str, bytes]:
        """Re-read the file with backoff until every key is present; returns the data."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if 0 < timeout < math.inf else None
        delay = _POLL_START
        while True:
            data = (await self._in_thread(self._load)).data
            missing = [k for k in keys if k not in data]
            if not missing:
                return data
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise timeout_error(missing, timeout)
            pause = delay if deadline is None else min(delay, deadline - now)
            await asyncio.sleep(pause)
            delay = min(delay * 2, _POLL_CAP)

    # -- Store ---------------------------------------------------------------------------------
    async def _set(self, key: str, value: bytes) -> None:
        def change(c: _Contents) -> tuple[None, bool]:
            c.data[key] = value
            return None, True

        await self._in_thread(self._mutate, change)

    async def _get(self, key: str, timeout: float) -> bytes:
        return (await self._wait_for([key], timeout))[key]

    async def _add(self, key: str, amount: int) -> int:
        def change(c: _Contents) -> tuple[int, bool]:
            return apply_add(c.data, key, amount), True

        return await self._in_thread(self._mutate, change)

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        def change(c: _Contents) -> tuple[bytes, bool]:
            return apply_compare_set(c.data, key, expected, desired)

        return await self._in_thread(self._mutate, change)

    async def _wait(self, keys: list[str], timeout: float) -> None:
        await self._wait_for(keys, timeout)

    async def _check(self, keys: list[str]) -> bool:
        data = (await self._in_thread(self._load)).data
        return all(k in data for k in keys)

    async def _delete_key(self, key: str) -> bool:
        def change(c: _Contents) -> tuple[bool, bool]:
            existed = c.data.pop(key, None) is not None
            return existed, existed

        return await self._in_thread(self._mutate, change)

    async def _num_keys(self) -> int:
        return len((await self._in_thread(self._load)).data)

    async def _close(self) -> None:
        if self.world_size > 0:
            await self._in_thread(self._finish)

    def _finish(self) -> None:
        """Count this store as closed; the last of ``world_size`` removes the files."""
        with self._locked():
            contents = self._load()
            finished = apply_add(contents.meta, _FINISHED_KEY, 1)
            if finished < self.world_size:
                self._store(contents)
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            log.debug("FileStore %s: all %d stores closed, file removed", self.path, self.world_size)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)

    def __repr__(self) -> str:
        return f"<FileStore path={self.path!r} world_size={self.world_size}>"
