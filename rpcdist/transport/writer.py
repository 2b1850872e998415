"""The writing half of every link: queued messages go out in batched frames.

Many small envelopes share one write (one gRPC message or one socket write), and a large
message is interleaved chunk by chunk with others, so a big tensor sent inline does not
hold up small calls to the same peer.

On a socket carrier, a thread with a small message ready (a pool thread's result, a caller's
request) may write it itself when nothing is queued (:meth:`FrameWriter.write_now`): one
socket write instead of a wake-up of the loop, which would then write it. What the loop itself
queues there during one of its turns is written right after that turn, on the loop
(:meth:`FrameWriter._flush`), rather than by waking the writer task.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rpcdist.transport.frames import ALIGNED_DATA_BYTES, align_data

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 20
"""A frame is closed once it holds this many bytes (then a big message yields its turn)."""

Entries = Iterator[list[bytes | memoryview]]

DirectWrite = Callable[[list[bytes | memoryview], int], bool]
"""Writes one frame (its pieces and their total size) from any thread, if the carrier can
right now; False: nothing was written (see ``_FramedProtocol.try_write``)."""

LoopWrite = Callable[[list[bytes | memoryview]], bool]
"""Writes one frame at once on the loop, if the carrier takes it without waiting (see
``_FramedProtocol.write_on_loop``); False: nothing was written."""

DIRECT_MAX_BYTES = 64 << 10
"""Messages up to this size may be written by the thread that made them (larger ones go
through the loop, which streams them chunk by chunk)."""


class FrameWriter:
    """Writes queued messages to one link, many small envelopes per write.

    Large messages are interleaved chunk by chunk with others, so a big tensor sent inline
    does not hold up small calls to the same peer.
    """

    def __init__(
        self, write: Callable[[list[bytes | memoryview]], Any], name: str, direct: DirectWrite | None = None
    ) -> None:
        self._write = write
        # Set (by a socket carrier) once frames may be written from any thread.
        self.direct = direct
        # Set (by a socket carrier) once frames may be written at once on the loop: what is
        # queued during one turn of the loop goes out right after it, in one write, instead
        # of waking the writer task (a task step per frame is a good share of a small call).
        self.loop_write: LoopWrite | None = None
        self._flush_due = False
        # A frame taken from the queue that the carrier did not take at once: the task writes
        # it before anything else.
        self._held: tuple[list[bytes | memoryview], int, list[int]] | None = None
        # Held by whoever is writing a frame: the writer task (across its write, which may wait
        # for the socket) or a thread in write_now, so frames never interleave or reorder.
        self.lock = threading.Lock()
        self._messages: collections.deque[Entries] = collections.deque()
        self._wake = asyncio.Event()
        self._closed = False
        self._heartbeat_due = False
        # The peer's byte counters (rpcdist.metrics.Traffic) while metrics are on; None is free.
        self.traffic: Any = None
        # Messages sent with a written() callback that has not run yet, and those of them whose
        # last piece is in the frame being made.
        self._unwritten: dict[int, Callable[[bool], None]] = {}
        self._finished: list[int] = []
        self._keys = itertools.count()
        # Envelopes handed to the carrier so far (counted under ``lock``): see quiet_envelopes.
        self.envelopes = 0
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name=f"rpcdist-writer-{name}")

    def send(self, entries: Entries, written: Callable[[bool], None] | None = None) -> None:
        """Queue one message. ``written(ok)`` runs on the loop once its last byte has been
        handed to the carrier (the kernel's socket buffer; gRPC's stream), or with False once
        it never will be (the link was lost or closed first)."""
        if written is not None:
            key = next(self._keys)
            self._unwritten[key] = written
            entries = self._tracked(entries, key)
        self._messages.append(entries)
        if self.loop_write is None:
            self._wake.set()
        elif not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _tracked(self, entries: Entries, key: int) -> Entries:
        yield from entries
        self._finished.append(key)  # its last piece is in the frame being made

    def _report_written(self, ok: bool, keys: list[int]) -> None:
        for key in keys:
            written = self._unwritten.pop(key, None)
            if written is not None:
                try:
                    written(ok)
                except Exception:  # noqa: BLE001 - one listener's bug must not stop the writer
                    log.exception("writer %s: a written() callback failed", self._task.get_name())

    def write_now(self, entries: list[list[bytes | memoryview]]) -> bool:
        """From any thread: write this small, complete message (its encoded entries) at once,
        if the carrier allows it and nothing is queued or being written; else False, and the
        caller queues it with :meth:`send` (on the loop)."""
        direct = self.direct
        if direct is None or self._messages or self._held is not None or self._closed:
            return False
        pieces = [piece for entry in entries for piece in entry]
        size = 0
        for piece in pieces:
            size += len(piece)
        if size > DIRECT_MAX_BYTES or not self.lock.acquire(blocking=False):
            return False
        try:
            if self._messages or self._held is not None or self._heartbeat_due or not direct(pieces, size):
                return False
            self.envelopes += len(entries)
        finally:
            self.lock.release()
        traffic = self.traffic
        if traffic is not None:
            traffic.sent += size
        return True

    def quiet_envelopes(self) -> int | None:
        """From any thread: the number of envelopes handed to the carrier so far, if nothing is
        queued or being written, so that every message sent before is among them (a request
        sent on another socket may then name that count: see ``Envelope.link_envelopes``);
        else None."""
        if self.direct is None or self._messages or self._held is not None or self._closed:
            return None
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self._messages or self._held is not None:
                return None
            return self.envelopes
        finally:
            self.lock.release()

    def send_heartbeat(self) -> None:
        """Queue one empty frame (a heartbeat, or its answer): it goes out before the next
        batch, so a long message ahead of it delays it by one frame at most."""
        self._heartbeat_due = True
        self._wake.set()

    async def _run(self) -> None:
        try:
            await self._write_queued()
        finally:  # lost, closed or aborted: what is left will never be written
            self._report_written(False, list(self._unwritten))

    def _flush(self) -> None:
        """Write one frame of what is queued, at once on the loop (scheduled by :meth:`send`).
        Whatever is left, or cannot be written without waiting, goes to the writer task."""
        self._flush_due = False
        if not self._messages:
            return
        loop_write = self.loop_write
        if (
            loop_write is None
            or self._heartbeat_due
            or self._held is not None
            or self._closed
            or not self.lock.acquire(blocking=False)  # the task is writing: it goes on
        ):
            self._wake.set()
            return
        try:
            pieces, size = self._next_frame(self._messages)
            finished, self._finished = self._finished, []
            if pieces and not loop_write(pieces):
                self._held = (pieces, size, finished)
                self._wake.set()
                return
        finally:
            self.lock.release()
        self._wrote(size, finished)
        if self._messages:  # more than a frame: the task writes the rest, minding the carrier
            self._wake.set()

    async def _write_queued(self) -> None:
        messages = self._messages
        while True:
            if self._held is not None:
                with self.lock:
                    pieces, size, finished = self._held
                    self._held = None
                    if not await self._put(pieces):
                        return
                self._wrote(size, finished)
                continue
            if self._heartbeat_due:
                with self.lock:
                    self._heartbeat_due = False
                    if not await self._put([]):  # the one frame that is empty
                        return
                continue
            if not messages:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            with self.lock:  # (a thread in write_now then leaves its message to this task)
                if not await self._write_batch(messages):
                    return

    def _next_frame(self, messages: collections.deque[Entries]) -> tuple[list[bytes | memoryview], int]:
        """The pieces (and size) of the next frame, taken from the queued messages (under
        ``lock``)."""
        pieces: list[bytes | memoryview] = []
        size = 0
        while messages and size < MAX_FRAME_BYTES:
            entry = next(messages[0], None)
            if entry is None:
                messages.popleft()
                continue
            self.envelopes += 1
            if len(entry) == 4 and len(entry[3]) >= ALIGNED_DATA_BYTES:
                entry = align_data(entry, size)  # the receiver may keep it in place
            pieces += entry
            size += sum(len(p) for p in entry)
            if size >= MAX_FRAME_BYTES and len(messages) > 1:
                messages.rotate(-1)  # a big message yields its turn after each chunk
        return pieces, size

    async def _write_batch(self, messages: collections.deque[Entries]) -> bool:
        """Write one frame of queued envelopes; False once the link is gone."""
        pieces, size = self._next_frame(messages)
        finished, self._finished = self._finished, []
        if pieces and not await self._put(pieces):
            return False
        self._wrote(size, finished)
        return True

    def _wrote(self, size: int, finished: list[int]) -> None:
        """A frame of ``size`` bytes was handed to the carrier, with the last pieces of the
        messages ``finished``."""
        if size and self.traffic is not None:
            self.traffic.sent += size
        if finished:
            self._report_written(True, finished)

    async def _put(self, frame: list[bytes | memoryview]) -> bool:
        """Write one frame; False once the link is gone (its reader fails the calls that were
        waiting on it)."""
        try:
            await self._write(frame)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, OSError) as exc:
            log.debug("writer %s stopped: %s", self._task.get_name(), exc)
            self._messages.clear()
            return False
        return True

    async def close(self) -> None:
        """Flush what is queued, then stop."""
        self._closed = True
        self._wake.set()
        # wait(), not `await self._task`: a writer aborted meanwhile (its link was lost while
        # another link closed) is done, and its cancellation must not cancel the close.
        await asyncio.wait([self._task])

    def abort(self) -> None:
        self._task.cancel()
        self._report_written(False, list(self._unwritten))  # (a task cancelled unstarted runs nothing)
