"""Reply channels: a co-located callee answers a waiting thread's call on a socket that thread
reads itself, and runs the thread's plain calls from a socket it reads on a thread of its own.

A call's answer normally comes back on the caller's link, read by the event loop, which then
wakes the thread waiting for it: two thread wake-ups per answer, each 20-40 µs of an idle vCPU
on a VM. A thread that sends a call and waits for it next (``rpc_sync``, ``to_here()``, a
backward pass) can instead name one of its reply channels in the request: the callee writes
the answer there, and the kernel wakes the waiting thread straight from its ``recv``; the loop
never wakes.

The request side has the same two hops on the callee (its loop wakes to read the request,
then wakes a pool thread to run it), so when the callee's acknowledgement says it reads
requests there too, the call of a plain function carrying no RRef is written on the channel
itself, and the callee's thread reading the channel runs it (:func:`serve_requests`): a round
trip costs two thread wake-ups instead of four. Order is kept with the caller's link: the
request names the link (the token of its ``LINK_OPENING``) and how many envelopes the caller had
written there before it, and the callee runs it only once its loop has handled that many, so
everything a worker sends a peer keeps its order whichever socket carries it. Other requests
(``remote()``, RRef proxies, ``async def`` functions) travel on the link and are answered on
the channel.

A channel is a Unix-socket connection to the callee's server that authenticates as any link
does, then sends a ``REPLY_CHANNEL`` frame (its id and its caller's rank); the callee sends the
frame back once it has registered the channel, so no request naming it can arrive first. A
channel serves one waiting call at a time; idle ones are kept per peer for the next.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

from rpcdist.security import ACCEPTED, REFUSED, VERDICT_BYTES, Security
from rpcdist.transport import frames
from rpcdist.transport.frames import FrameError
from rpcdist.transport.framing import FrameSplitter, send_frame

log = logging.getLogger(__name__)

OPEN_TIMEOUT = 5.0  # seconds to connect, authenticate and be registered
_IDLE_POLL_SECONDS = 3600.0  # a callee's channel thread waits this long per read (never forever)
_channel_ids = itertools.count(1)


class ChannelClosed(ConnectionError):
    """The callee closed the channel (it died or left), or it was interrupted."""


class ReplyChannel:
    """The caller's end of one reply channel: a blocking socket, used by one thread at a time."""

    def __init__(self, rank: int, path: str, security: Security, caller_rank: int) -> None:
        self.rank = rank
        self.id = next(_channel_ids)
        self.assemblies: dict[int, frames.Assembly] = {}  # answers still missing CHUNKs
        self.busy_until = 0.0  # time.monotonic() until which requests go on the link (callee busy)
        self._frames = FrameSplitter()
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
            opening = frames.encode_control(self.id, frames.REPLY_CHANNEL, caller_rank)
            self._sock = sock
            self.send([opening], time.monotonic() + OPEN_TIMEOUT)
            ack = self.read_frame(time.monotonic() + OPEN_TIMEOUT)
            if ack is None or frames.channel_opening(ack) != (caller_rank, self.id):
                raise ConnectionError("the peer did not register the reply channel")
            self.takes_requests = frames.takes_requests(ack)  # (see Envelope.link_envelopes)
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

    def send(self, entries: list[list[bytes | memoryview]], deadline: float | None) -> None:
        """Write one frame of these envelope entries (a request: see
        ``Envelope.link_envelopes``); raises OSError (TimeoutError past ``deadline``)."""
        send_frame(self._sock, [piece for entry in entries for piece in entry], deadline)

    def read_frame(self, deadline: float | None) -> bytes | memoryview | None:
        """The next frame (blocking); None once ``deadline`` (``time.monotonic()``) passes
        first, with any partial frame kept for the next read. Raises :class:`ChannelClosed`
        if the callee closed the channel or :meth:`interrupt` was called."""
        splitter = self._frames
        while True:
            frame = splitter.next_frame()
            if frame is not None:
                return frame
            if deadline is None:
                self._sock.settimeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._sock.settimeout(remaining)
            try:
                received = self._sock.recv_into(splitter.room())
            except TimeoutError:
                return None
            except OSError as exc:
                raise ChannelClosed(f"reply channel broken: {exc}") from exc
            if not received:
                raise ChannelClosed("the callee closed the reply channel")
            splitter.filled(received)

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


def serve_requests(
    sock: socket.socket, splitter: FrameSplitter, on_frame: Callable[[bytes | memoryview], None]
) -> None:
    """The callee's end of a reply channel, on a thread of its own: hand every frame the caller
    sends (its requests) to ``on_frame``, on this thread, until the caller closes the channel.
    ``sock`` shares its open file with the loop's transport (which writes the answers), so it
    is always read with a timeout: a blocking handle would make the loop's writes block too."""
    sock.settimeout(_IDLE_POLL_SECONDS)
    while True:
        while (frame := splitter.next_frame()) is not None:
            on_frame(frame)
        try:
            received = sock.recv_into(splitter.room())
        except TimeoutError:
            continue
        if not received:
            return
        splitter.filled(received)


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
