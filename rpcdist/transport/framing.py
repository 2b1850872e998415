"""Length-prefixed frames on a stream socket: how the bytes are cut into frames.

Every socket carrier (Unix and TCP links, read by the event loop; reply channels, read by
threads on blocking sockets) frames its messages the same way: an 8-byte little-endian length,
then the frame. :class:`FrameSplitter` holds the reading side: small frames are read many per
``recv`` into a staging buffer; a big frame is read by the kernel straight into an aligned
buffer of its own (:mod:`rpcdist.transport.warm`), handed on as it is (a writable memoryview:
tensors decoded from it may keep its memory instead of copying it out).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from rpcdist.transport import warm
from rpcdist.transport.frames import FrameError
from rpcdist.transport.grpc_link import GRPC_MESSAGE_LIMIT

LENGTH = struct.Struct("<Q")
STAGING_BYTES = 256 << 10
BIG_FRAME_BYTES = 64 << 10


class FrameSplitter:
    """The frames in a stream of bytes: receive into :meth:`room`, report how many bytes came
    with :meth:`filled`, then take the complete frames with :meth:`next_frame`."""

    __slots__ = ("_staging", "_staged", "_start", "_end", "_big", "_big_filled")

    def __init__(self) -> None:
        self._staging = bytearray(STAGING_BYTES)
        self._staged = memoryview(self._staging)
        self._start = self._end = 0  # unread bytes: _staging[_start:_end]
        self._big: memoryview | None = None  # a big frame being read, and how much is in
        self._big_filled = 0

    def room(self) -> memoryview:
        """Where the next bytes received go."""
        if self._big is not None:
            return self._big[self._big_filled :]
        if self._end == STAGING_BYTES:  # make room: move the unread tail to the front
            unread = self._end - self._start
            self._staging[:unread] = bytes(self._staged[self._start : self._end])
            self._start, self._end = 0, unread
        return self._staged[self._end :]

    def filled(self, nbytes: int) -> None:
        """``nbytes`` were received into the last :meth:`room`."""
        if self._big is not None:
            self._big_filled += nbytes
        else:
            self._end += nbytes

    def take(self, size: int) -> bytes | None:
        """The next ``size`` bytes as they are (a handshake before the frames), once they are in."""
        if self._end - self._start < size:
            return None
        start = self._start
        self._start = start + size
        got = bytes(self._staged[start : self._start])
        self._reset_if_drained()
        return got

    def clear(self) -> None:
        """Forget what was received and not taken."""
        self._start = self._end = 0
        self._big = None

    def next_frame(self) -> bytes | memoryview | None:
        """The next complete frame, if it is in (starts reading a big one); raises
        :class:`FrameError` on a length above gRPC's message limit."""
        big = self._big
        if big is not None:
            if self._big_filled < len(big):
                return None
            self._big = None
            return big
        available = self._end - self._start
        if available < 8:
            return None
        start = self._start
        (length,) = LENGTH.unpack_from(self._staged, start)
        if length > GRPC_MESSAGE_LIMIT:
            raise FrameError(f"frame of {length} bytes is above the {GRPC_MESSAGE_LIMIT} limit")
        if length >= BIG_FRAME_BYTES:
            big = warm.receive_buffer(length)  # aligned as tensor memory (frames.align_data)
            have = min(available - 8, length)
            big[:have] = self._staged[start + 8 : start + 8 + have]
            self._start = start + 8 + have
            self._reset_if_drained()
            if have < length:
                self._big, self._big_filled = big, have
                return None
            return big
        if available - 8 < length:
            return None
        self._start = start + 8 + length
        frame = bytes(self._staged[start + 8 : self._start])
        self._reset_if_drained()
        return frame

    def _reset_if_drained(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0


class TakenReading(NamedTuple):
    """A connection whose reading a thread took over from the loop: ``sock`` (a second handle
    on the loop's non-blocking socket: read it with timeouts only), ``frames`` (what was
    received already), and ``close`` (from any thread: the loop closes the connection)."""

    sock: socket.socket
    frames: FrameSplitter
    close: Callable[[], None]


def send_frame(sock: socket.socket, pieces: list[bytes | memoryview], deadline: float | None) -> None:
    """Write one frame (given as its pieces) on a blocking socket of the caller's own (not one
    the loop shares), by ``deadline`` (``time.monotonic()``; None: no limit). Raises
    TimeoutError or OSError."""
    view = memoryview(b"".join([LENGTH.pack(sum(len(piece) for piece in pieces)), *pieces]))
    while view:
        if deadline is None:
            sock.settimeout(None)  # (not a timeout left from the socket's last read)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer did not take the frame in time")
            sock.settimeout(remaining)
        sent = sock.send(view)
        view = view[sent:]
