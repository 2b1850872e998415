"""A key-value state that survives a crash: a write-ahead log with group commit, plus snapshots.

:class:`DurableKeyValueState` is what ``rpcdist-server --data-dir DIR`` (and
``StoreServer.start(data_dir=...)``) serves. Every change (``set``, ``add``, a ``compare_set``
that changed the value, a ``delete_key`` that deleted) is appended to a log file and the
server answers only after :meth:`~DurableKeyValueState.flushed`, i.e. once the log is
``fdatasync``-ed. Writers arriving while a sync runs share the next one (group commit), so many
concurrent writers cost far fewer than one sync each. Answers to reads wait the same way when
they could reveal a change that is not on disk yet, so nothing a client has seen can be lost.

The directory holds::

    LOCK                   flock-ed by the server using the directory (a second one is refused)
    snapshot               every key, plus the remembered add results, as of the start of log N
    wal-<N>.log ...        the changes since, in order (the newest is being appended to)

A log record is ``<u32 length><u32 CRC32 of payload><payload>``. When the newest log grows
past ``max(wal_max_bytes, size of the last snapshot)`` the log is rotated and a snapshot is
written in the background (temporary file, fsync, atomic rename, fsync of the directory),
after which the older logs are deleted. On start the snapshot is loaded and the logs replayed;
a torn last record (a write cut short by the crash: the record runs past the end of the file,
or the rest of the file is zeros) is ignored with a warning, while a bad record anywhere else
is an error naming the file and offset. Recovery then writes a fresh snapshot and starts a new
log, so replay never grows across restarts.

Usage::

    state = DurableKeyValueState.open("/var/lib/rpcdist")   # blocking: recovery
    server = await StoreServer.start("0.0.0.0", 29500, state=state)
    ...
    await server.stop(); await state.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rpcdist.errors import StoreError
from rpcdist.store.memory import CLIENT_ID_BYTES, KeyValueState, RequestId

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

__all__ = ["DurableKeyValueState", "WriteAheadLog", "DEFAULT_WAL_MAX_BYTES", "read_log"]

DEFAULT_WAL_MAX_BYTES = 64 * 1024 * 1024

LOG_MAGIC = b"RPCDWAL1"
SNAPSHOT_MAGIC = b"RPCDSNP1"
SNAPSHOT = "snapshot"
SNAPSHOT_TMP = "snapshot.tmp"
LOCK = "LOCK"
_LOG_NAME = re.compile(r"wal-([0-9]{16})\.log")

_RECORD_HEADER = struct.Struct("<II")  # payload length, CRC32 of the payload
_SNAPSHOT_HEADER = struct.Struct("<8sQQI")  # magic, first log index, payload length, CRC32
_U32 = struct.Struct("<I")
_ADD = struct.Struct("<q16sQQ")  # result, client id, seq, low
_ENTRY = struct.Struct("<QqI")  # seq, result, key length
MAX_RECORD_BYTES = 1 << 30

_fdatasync = getattr(os, "fdatasync", os.fsync)


def log_path(directory: Path, index: int) -> Path:
    """The path of log number ``index`` in ``directory``."""
    return directory / f"wal-{index:016d}.log"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- records ---------------------------------------------------------------------------------------
def _encode_set(key: str, value: bytes) -> bytes:
    k = key.encode()
    return b"S" + _U32.pack(len(k)) + k + value


def _encode_add(key: str, value: bytes, request: RequestId) -> bytes:
    k = key.encode()
    return b"A" + _U32.pack(len(k)) + k + _ADD.pack(int(value), request.client, request.seq, request.low)


def _encode_delete(key: str) -> bytes:
    return b"D" + key.encode()


def _frame(payload: bytes) -> bytes:
    return _RECORD_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class _Malformed(ValueError):
    pass


def _apply_record(state: KeyValueState, payload: bytes) -> None:
    """Replay one logged change onto ``state`` (not logged again)."""
    op = payload[:1]
    try:
        if op == b"D":
            state._data.pop(payload[1:].decode(), None)
            return
        if op not in (b"S", b"A"):
            raise _Malformed(f"unknown record type {op!r}")
        (klen,) = _U32.unpack_from(payload, 1)
        key = payload[5 : 5 + klen].decode()
        if len(key.encode()) != klen:
            raise _Malformed("key runs past the end of the record")
        rest = payload[5 + klen :]
        if op == b"S":
            state._data[key] = bytes(rest)
            return
        if len(rest) != _ADD.size:
            raise _Malformed(f"add record of {len(payload)} bytes")
        result, client, seq, low = _ADD.unpack(rest)
        state._data[key] = str(result).encode("ascii")
        state._remember(RequestId(client, seq, low), key, result)
    except (struct.error, UnicodeDecodeError, StoreError) as exc:
        raise _Malformed(str(exc)) from exc


@dataclass
class LogContents:
    """What :func:`read_log` found in one log file."""

    records: list[bytes] = field(default_factory=list)
    end: int = 0  # offset just past the last good record
    torn: str | None = None  # why the bytes from ``end`` on were ignored (a torn tail)


def read_log(path: Path, newest: bool) -> LogContents:
    """The records of log file ``path``.

    A bad record in the ``newest`` log is a torn tail (ignored) when it is the last thing in
    the file: it runs to or past the end of the file, or only zeros follow it, and no good
    record starts anywhere after it. Any other bad record raises StoreError naming the file
    and the record's offset.
    """
    data = path.read_bytes()
    found = LogContents(end=len(LOG_MAGIC))
    if len(data) < len(LOG_MAGIC) and newest and LOG_MAGIC.startswith(data):
        found.end, found.torn = 0, f"incomplete file header ({len(data)} bytes)"
        return found
    if data[: len(LOG_MAGIC)] != LOG_MAGIC:
        raise StoreError(f"{path} is not an rpcdist write-ahead log (bad header); refusing to start")
    offset = len(LOG_MAGIC)
    while offset < len(data):
        problem = None
        end = len(data)
        if len(data) - offset < _RECORD_HEADER.size:
            problem = "incomplete record header"
        else:
            length, crc = _RECORD_HEADER.unpack_from(data, offset)
            end = offset + _RECORD_HEADER.size + length
            if length == 0 or length > MAX_RECORD_BYTES:
                problem = f"invalid record length {length}"
            elif end > len(data):
                problem = f"record of {length} bytes runs past the end of the file"
            elif zlib.crc32(data[offset + _RECORD_HEADER.size : end]) != crc:
                problem = "CRC32 mismatch"
        if problem is not None:
            last = end >= len(data) or not data[end:].strip(b"\0") or not data[offset:].strip(b"\0")
            if newest and last and _next_good_record(data, offset + 1) is None:
                found.torn = f"{problem} ({len(data) - offset} bytes)"
                return found
            raise StoreError(
                f"corrupt write-ahead log {path} at offset {offset}: {problem} "
                f"({len(data) - offset} bytes follow); refusing to start"
            )
        found.records.append(data[offset + _RECORD_HEADER.size : end])
        offset = found.end = end
    return found


_RECORD_TYPE = re.compile(b"[SAD]")
_RESYNC_BYTES = 16 * 1024 * 1024  # how far past a bad record a good one is looked for


def _next_good_record(data: bytes, start: int) -> int | None:
    """The offset of a well-formed record (length, CRC, type) at or after ``start``, if any."""
    stop = min(len(data), start + _RESYNC_BYTES)
    for match in _RECORD_TYPE.finditer(data, start + _RECORD_HEADER.size, stop + _RECORD_HEADER.size):
        offset = match.start() - _RECORD_HEADER.size
        length, crc = _RECORD_HEADER.unpack_from(data, offset)
        end = match.start() + length
        if 0 < length and end <= len(data) and zlib.crc32(data[match.start() : end]) == crc:
            return offset
    return None


# -- snapshots -------------------------------------------------------------------------------------
@dataclass
class _Image:
    """A copy of the state, consistent with the start of log ``first_log``."""

    data: dict[str, bytes]
    requests: dict[bytes, dict[int, tuple[str, int]]]
    first_log: int


def _encode_snapshot(image: _Image) -> bytes:
    parts: list[bytes] = [struct.pack("<Q", len(image.data))]
    for key, value in image.data.items():
        k = key.encode()
        parts += [_U32.pack(len(k)), k, _U32.pack(len(value)), value]
    parts.append(_U32.pack(len(image.requests)))
    for client, done in image.requests.items():
        parts += [client, _U32.pack(len(done))]
        for seq, (key, result) in done.items():
            k = key.encode()
            parts += [_ENTRY.pack(seq, result, len(k)), k]
    payload = b"".join(parts)
    header = _SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, image.first_log, len(payload), zlib.crc32(payload))
    return header + payload


def _write_snapshot(directory: Path, image: _Image) -> int:
    """Write ``image`` as the snapshot (atomically and durably); returns its size."""
    blob = _encode_snapshot(image)
    tmp = directory / SNAPSHOT_TMP
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / SNAPSHOT)
    _fsync_dir(directory)
    return len(blob)


def _read_snapshot(path: Path, state: KeyValueState) -> tuple[int, int]:
    """Load the snapshot at ``path`` into ``state``; returns (first log index, size)."""
    blob = path.read_bytes()
    where = f"snapshot {path}"
    if len(blob) < _SNAPSHOT_HEADER.size:
        raise StoreError(f"{where} is truncated ({len(blob)} bytes); refusing to start")
    magic, first_log, length, crc = _SNAPSHOT_HEADER.unpack_from(blob)
    payload = blob[_SNAPSHOT_HEADER.size :]
    if magic != SNAPSHOT_MAGIC:
        raise StoreError(f"{where} is not an rpcdist snapshot (bad header); refusing to start")
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise StoreError(
            f"{where} is corrupt: {len(payload)} bytes where the header says {length}, "
            "or a CRC32 mismatch; refusing to start"
        )
    try:
        offset = 8
        (count,) = struct.unpack_from("<Q", payload)
        for _ in range(count):
            (klen,) = _U32.unpack_from(payload, offset)
            key = payload[offset + 4 : offset + 4 + klen].decode()
            offset += 4 + klen
            (vlen,) = _U32.unpack_from(payload, offset)
            state._data[key] = payload[offset + 4 : offset + 4 + vlen]
            offset += 4 + vlen
        (clients,) = _U32.unpack_from(payload, offset)
        offset += 4
        for _ in range(clients):
            client = payload[offset : offset + CLIENT_ID_BYTES]
            (entries,) = _U32.unpack_from(payload, offset + CLIENT_ID_BYTES)
            offset += CLIENT_ID_BYTES + 4
            for _ in range(entries):
                seq, result, klen = _ENTRY.unpack_from(payload, offset)
                key = payload[offset + _ENTRY.size : offset + _ENTRY.size + klen].decode()
                offset += _ENTRY.size + klen
                state._remember(RequestId(client, seq, 0), key, result)
    except (struct.error, UnicodeDecodeError, StoreError) as exc:
        raise StoreError(f"{where} is malformed at payload offset {offset}: {exc}; refusing to start") from (
            exc
        )
    return first_log, len(blob)


# -- the log ---------------------------------------------------------------------------------------
class WriteAheadLog:
    """Appends framed records to ``wal-<index>.log`` and makes them durable in groups.

    :meth:`append` queues a record (on the event loop, never blocking); :meth:`sync` waits
    until everything appended so far is fdatasync-ed. One background task writes and syncs: all
    records appended while a sync runs go out together in the next write and sync. When the log
    outgrows its limit, the log is rotated at a record boundary: ``on_rotate(index of the new
    log)`` is called right there (to copy the state as of that point) and the function it returns
    is called once the new log exists (to write the snapshot).

    ``syncs`` and ``records`` count the syncs done and the records made durable.
    """

    def __init__(
        self,
        directory: Path,
        index: int,
        max_bytes: int,
        on_rotate: Callable[[int], Callable[[], None]],
    ) -> None:
        self.directory = directory
        self.index = index
        self.max_bytes = max_bytes
        self.syncs = 0
        self.records = 0
        self._on_rotate = on_rotate
        path = log_path(directory, index)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        os.write(self._fd, LOG_MAGIC)
        os.fsync(self._fd)
        _fsync_dir(directory)
        self._size = len(LOG_MAGIC)
        self._pending = bytearray()
        self._appended = 0  # records appended
        self._durable = 0  # records synced
        self._inflight_last = 0  # the last record of the batch being written
        self._inflight: asyncio.Future[None] | None = None
        self._next: asyncio.Future[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rpcdist-wal")
        self.snapshot_bytes = 0  # size of the last snapshot (raises the rotation threshold)
        self.compacting = False  # set by the owner while a snapshot is written

    @property
    def path(self) -> Path:
        """The log file being appended to."""
        return log_path(self.directory, self.index)

    @property
    def failed(self) -> str | None:
        """Why the log stopped accepting records (a write or sync failed), or None."""
        return self._error

    def append(self, payload: bytes) -> None:
        """Queue one record; it is durable once a later :meth:`sync` returns."""
        self.check_usable()
        self._pending += _frame(payload)
        self._appended += 1
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())

    def check_usable(self) -> None:
        """Raise StoreError if records can no longer be appended."""
        if self._error is not None:
            raise StoreError(f"the store's write-ahead log failed ({self._error}); restart the server")
        if self._closed:
            raise StoreError("the store's write-ahead log is closed")

    async def sync(self) -> None:
        """Wait until every record appended so far is on disk (raises StoreError if that failed)."""
        target = self._appended
        while self._durable < target:
            if self._error is not None:
                self.check_usable()
            waiter = self._next if target > self._inflight_last else self._inflight
            if waiter is None:  # pragma: no cover - the flusher always holds one of them
                raise AssertionError("write-ahead log lost track of its pending records")
            await asyncio.shield(waiter)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending and self._error is None:
            batch, self._pending = bytes(self._pending), bytearray()
            last, count = self._appended, self._appended - self._durable
            self._inflight, self._next = self._next, None
            self._inflight_last = last
            rotate = (
                not self.compacting
                and not self._closed
                and self._size + len(batch) >= max(self.max_bytes, self.snapshot_bytes)
            )
            start_snapshot = None
            if rotate:
                # The state now reflects exactly the records up to `last`: copy it here.
                self.compacting = True
                start_snapshot = self._on_rotate(self.index + 1)
            try:
                self._size = await loop.run_in_executor(self._executor, self._write, batch, rotate)
            except Exception as exc:  # an I/O error (disk full, EIO): nothing more can be kept
                self._error = f"{type(exc).__name__}: {exc}"
                log.critical("write-ahead log %s failed, refusing further writes: %s", self.path, exc)
            else:
                self._durable = last
                self.syncs += 1
                self.records += count
                if start_snapshot is not None:
                    self.index += 1
                    start_snapshot()
            for waiter in (self._inflight, self._next if self._error else None):
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            self._inflight = None

    def _write(self, batch: bytes, rotate: bool) -> int:
        """(Log thread.) Append and sync ``batch``; on ``rotate`` then start the next log file."""
        view = memoryview(batch)
        while view:
            view = view[os.write(self._fd, view) :]
        _fdatasync(self._fd)
        size = self._size + len(batch)
        if rotate:
            path = log_path(self.directory, self.index + 1)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            try:
                os.write(fd, LOG_MAGIC)
                os.fsync(fd)
                _fsync_dir(self.directory)
            except OSError:
                os.close(fd)
                raise
            os.close(self._fd)
            self._fd = fd
            size = len(LOG_MAGIC)
            log.debug("rotated the write-ahead log to %s", path)
        return size

    async def close(self) -> None:
        """Sync what was appended, then close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        os.close(self._fd)
        self._executor.shutdown(wait=False)


# -- the durable state -----------------------------------------------------------------------------
class DurableKeyValueState(KeyValueState):
    """A :class:`~rpcdist.store.memory.KeyValueState` whose changes are logged in ``directory``.

    Make one with :meth:`open` (it recovers what the directory holds), use it on one event loop
    like any KeyValueState, ``await flushed()`` before answering, and ``await close()`` at the
    end. ``wal_max_bytes`` is the log size that triggers a snapshot (at least the size of the
    last snapshot, so that snapshots cost no more than the log they replace).
    """

    def __init__(self, directory: Path, wal_max_bytes: int = DEFAULT_WAL_MAX_BYTES) -> None:
        super().__init__()
        self.directory = directory
        self.wal_max_bytes = int(wal_max_bytes)
        self._wal: WriteAheadLog | None = None
        self._lock_fd: int | None = None
        self._compaction: asyncio.Task[None] | None = None
        self.snapshots = 0  # snapshots written since open (recovery's included)

    # -- opening and recovery ------------------------------------------------------------------
    @classmethod
    def open(
        cls, directory: str | os.PathLike[str], wal_max_bytes: int = DEFAULT_WAL_MAX_BYTES
    ) -> DurableKeyValueState:
        """Open (creating if needed) the data directory and recover its state (blocking).

        Raises StoreError if another server holds the directory or its files are corrupt
        (naming the file and offset).
        """
        if wal_max_bytes <= 0:
            raise ValueError(f"wal_max_bytes must be positive, not {wal_max_bytes}")
        path = Path(directory).resolve()
        try:
            if not path.is_dir():
                path.mkdir(parents=True)
                _fsync_dir(path.parent)  # so that the new directory itself survives a crash
        except OSError as exc:
            raise StoreError(f"cannot create the store's data directory {path}: {exc}") from exc
        state = cls(path, wal_max_bytes)
        state._lock()
        try:
            state._recover()
        except BaseException:
            state._unlock()
            raise
        return state

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover - not POSIX
            raise StoreError("a durable store needs POSIX file locks (fcntl), missing on this platform")
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise StoreError(
                    f"the store's data directory {self.directory} is in use by another server"
                ) from exc
            raise StoreError(f"cannot lock the store's data directory {self.directory}: {exc}") from exc
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _recover(self) -> None:
        directory = self.directory
        with contextlib.suppress(FileNotFoundError):
            (directory / SNAPSHOT_TMP).unlink()
        first_log, snapshot_bytes = 0, 0
        if (directory / SNAPSHOT).exists():
            first_log, snapshot_bytes = _read_snapshot(directory / SNAPSHOT, self)
        logs = sorted(
            (int(m.group(1)), directory / name)
            for name in os.listdir(directory)
            if (m := _LOG_NAME.fullmatch(name)) is not None
        )
        live = [(i, p) for i, p in logs if i >= first_log]
        for expected, (index, path) in enumerate(live, start=first_log):
            if index != expected:
                raise StoreError(
                    f"write-ahead log {log_path(directory, expected)} is missing (found {path.name}); "
                    "refusing to start"
                )
        replayed = 0
        for position, (_, path) in enumerate(live):
            contents = read_log(path, newest=position == len(live) - 1)
            for record in contents.records:
                try:
                    _apply_record(self, record)
                except _Malformed as exc:
                    raise StoreError(
                        f"corrupt write-ahead log {path}: undecodable record #{replayed + 1}: {exc}; "
                        "refusing to start"
                    ) from exc
                replayed += 1
            if contents.torn is not None:
                log.warning(
                    "ignored a torn record at the end of %s (offset %d): %s; it was never acknowledged",
                    path,
                    contents.end,
                    contents.torn,
                )
        next_log = max([first_log] + [i + 1 for i, _ in logs])
        # One fresh snapshot of what was recovered, so the next start replays nothing twice.
        size = _write_snapshot(directory, _Image(dict(self._data), self.requests(), next_log))
        self.snapshots += 1
        for _, path in logs:
            path.unlink()
        self._wal = WriteAheadLog(directory, next_log, self.wal_max_bytes, self._rotated)
        self._wal.snapshot_bytes = size
        log.info(
            "store data directory %s: %d keys recovered (snapshot of %d bytes%s, %d log records)",
            directory,
            len(self._data),
            snapshot_bytes,
            "" if snapshot_bytes else ": none",
            replayed,
        )

    # -- hooks of KeyValueState ----------------------------------------------------------------
    def _writable(self) -> None:
        if self._wal is None:
            raise StoreError("the durable store is closed")
        self._wal.check_usable()

    def _journal(
        self, op: str, key: str, value: bytes | None = None, request: RequestId | None = None
    ) -> None:
        assert self._wal is not None
        if op == "delete":
            self._wal.append(_encode_delete(key))
        elif op == "add" and request is not None:
            assert value is not None
            self._wal.append(_encode_add(key, value, request))
        else:
            assert value is not None
            self._wal.append(_encode_set(key, value))

    async def flushed(self) -> None:
        """Wait until every change made so far is fdatasync-ed (StoreError if the log failed)."""
        if self._wal is None:
            raise StoreError("the durable store is closed")
        await self._wal.sync()

    # -- compaction ----------------------------------------------------------------------------
    def _rotated(self, next_log: int) -> Callable[[], None]:
        """(Loop, at a record boundary.) Copy the state as of the start of log ``next_log``;
        returns what writes it as the snapshot (once that log exists)."""
        image = _Image(dict(self._data), self.requests(), next_log)

        def start() -> None:
            self._compaction = asyncio.get_running_loop().create_task(self._compact(image))

        return start

    async def _compact(self, image: _Image) -> None:
        wal = self._wal
        assert wal is not None
        try:
            size = await asyncio.to_thread(_write_snapshot, self.directory, image)
            # The snapshot covers every log before image.first_log: delete them.
            for name in os.listdir(self.directory):
                m = _LOG_NAME.fullmatch(name)
                if m is not None and int(m.group(1)) < image.first_log:
                    (self.directory / name).unlink()
            wal.snapshot_bytes = size
            self.snapshots += 1
            log.debug("snapshot of %d keys (%d bytes) written", len(image.data), size)
        except OSError as exc:
            log.error("could not write a snapshot in %s (the logs are kept): %s", self.directory, exc)
        finally:
            wal.compacting = False

    @property
    def wal(self) -> WriteAheadLog | None:
        """The open write-ahead log (None once closed)."""
        return self._wal

    async def close(self) -> None:
        """Sync and close the log, finish a snapshot being written, release the directory."""
        wal, self._wal = self._wal, None
        if wal is not None:
            await wal.close()
        if self._compaction is not None:
            with contextlib.suppress(Exception):
                await self._compaction
        self._unlock()

    def __repr__(self) -> str:
        return f"<DurableKeyValueState {self.directory} keys={len(self._data)}>"
