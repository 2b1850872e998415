"""Reply channels: a co-located callee answers a waiting thread's call on a socket that thread
reads itself.

A call's answer normally comes back on the caller's link, read by the event loop, which then
wakes the thread waiting for it: two thread wake-ups per answer, each 20-40 µs of an idle vCPU
on a VM. A thread that sends a call and waits for it next (``rpc_sync``, ``to_here()``, a
backward pass) can instead name one of its reply channels in the request: the callee writes
the answer there, and the kernel wakes the waiting thread straight from its ``recv``; the loop
never wakes. The request itself still travels on the caller's link, so everything a worker
sends a peer keeps its order.

A channel is a Unix-socket connection to the callee's server that authenticates as any link
does, then sends a ``REPLY_CHANNEL`` frame (its id and its caller's rank); the callee sends the
frame back once it has registered the channel, so no request naming it can arrive first. A
channel serves one waiting call at a time; idle ones are kept per peer for the next.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time

from rpcdist.security import ACCEPTED, REFUSED, VERDICT_BYTES, Security
from rpcdist.transport import frames, warm
from rpcdist.transport.frames import FrameError
from rpcdist.transport.grpc_link import GRPC_MESSAGE_LIMIT

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
_STAGING_BYTES = 256 << 10
_BIG_FRAME_BYTES = 64 << 10  # as on the links: read straight into an aligned buffer of its own
OPEN_TIMEOUT = 5.0  # seconds to connect, authenticate and be registered
_channel_ids = itertools.count(1)


class ChannelClosed(ConnectionError):
    """The callee closed the channel (it died or left), or it was interrupted."""


class ReplyChannel:
    """The caller's end of one reply channel: a blocking socket, read by one thread at a time."""

    def __init__(self, rank: int, path: str, security: Security, caller_rank: int) -> None:
        self.rank = rank
        self.id = next(_channel_ids)
        self.assemblies: dict[int, frames.Assembly] = {}  # answers still missing CHUNKs
        self._staging = bytearray(_STAGING_BYTES)
        self._staged = memoryview(self._staging)
        self._start = self._end = 0  # unread bytes: _staging[_start:_end]
        self._big: memoryview | None = None  # a big frame being read, and how much is in
        self._big_filled = 0
        self._closed = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(OPEN_TIMEOUT)
            sock.connect(path)
            sock.sendall(security.hello())
            verdict = self._read_exact(sock, VERDICT_BYTES)
            if verdict != ACCEPTED:
                raise ConnectionError(
                    "the peer refused the reply channel (UNAUTHENTICATED)"
                    if verdict == REFUSED
                    else "the peer did not answer the handshake"
                )
            opening = b"".join(frames.encode_control(self.id, frames.REPLY_CHANNEL, caller_rank))
            sock.sendall(_LENGTH.pack(len(opening)) + opening)
            self._sock = sock
            ack = self.read_frame(time.monotonic() + OPEN_TIMEOUT)
            if ack is None or frames.channel_opening(ack) != (caller_rank, self.id):
                raise ConnectionError("the peer did not register the reply channel")
        except BaseException:
            sock.close()
            raise

    @staticmethod
    def _read_exact(sock: socket.socket, size: int) -> bytes:
        data = b""
        while len(data) < size:
            more = sock.recv(size - len(data))
            if not more:
                raise ConnectionError("the peer closed the connection during the handshake")
            data += more
        return data

    def read_frame(self, deadline: float | None) -> bytes | memoryview | None:
        """The next frame (blocking); None once ``deadline`` (``time.monotonic()``) passes
        first, with any partial frame kept for the next read. Raises :class:`ChannelClosed`
        if the callee closed the channel or :meth:`interrupt` was called."""
        while True:
            frame = self._next_buffered()
            if frame is not None:
                return frame
            if deadline is None:
                self._sock.settimeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._sock.settimeout(remaining)
            into = self._big[self._big_filled :] if self._big is not None else self._room()
            try:
                received = self._sock.recv_into(into)
            except TimeoutError:
                return None
            except OSError as exc:
                raise ChannelClosed(f"reply channel broken: {exc}") from exc
            if not received:
                raise ChannelClosed("the callee closed the reply channel")
            if self._big is not None:
                self._big_filled += received
            else:
                self._end += received

    def _room(self) -> memoryview:
        if self._end == _STAGING_BYTES:  # move the unread tail to the front
            unread = self._end - self._start
            self._staging[:unread] = bytes(self._staged[self._start : self._end])
            self._start, self._end = 0, unread
        return self._staged[self._end :]

    def _next_buffered(self) -> bytes | memoryview | None:
        """A complete frame from what was read, if there is one (starts reading a big one)."""
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
        (length,) = _LENGTH.unpack_from(self._staged, start)
        if length > GRPC_MESSAGE_LIMIT:
            raise FrameError(f"frame of {length} bytes is above the {GRPC_MESSAGE_LIMIT} limit")
        if length >= _BIG_FRAME_BYTES:
            big = warm.receive_buffer(length)
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

    def interrupt(self) -> None:
        """Wake the thread reading this channel (any thread): its read raises ChannelClosed.
        The channel is not used again."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._closed


class ReplyChannels:
    """The idle reply channels of one worker, per peer rank."""

    def __init__(self, security: Security) -> None:
        self._security = security
        self._idle: dict[int, list[ReplyChannel]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._unusable: set[int] = set()  # peers a channel could not be opened to

    def take(self, rank: int, path: str, caller_rank: int) -> ReplyChannel | None:
        """An idle channel to ``rank`` (whose Unix socket is ``path``), or a new one; None if
        none can be had (the caller's link carries the answer then)."""
        with self._lock:
            if self._closed or rank in self._unusable:
                return None
            idle = self._idle.get(rank)
            if idle:
                return idle.pop()
        try:
            return ReplyChannel(rank, path, self._security, caller_rank)
        except (OSError, FrameError) as exc:
            log.info("no reply channel to rank %s (answers come on the link): %s", rank, exc)
            with self._lock:
                self._unusable.add(rank)
            return None

    def give_back(self, channel: ReplyChannel) -> None:
        with self._lock:
            if not (self._closed or channel.closed or channel.assemblies):
                self._idle.setdefault(channel.rank, []).append(channel)
                return
        channel.close()

    def forget(self, rank: int) -> None:
        """``rank`` left or was replaced: close its idle channels, and try again next time."""
        with self._lock:
            idle = self._idle.pop(rank, [])
            self._unusable.discard(rank)
        for channel in idle:
            channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [channel for channels in self._idle.values() for channel in channels]
            self._idle.clear()
        for channel in idle:
            channel.close()
