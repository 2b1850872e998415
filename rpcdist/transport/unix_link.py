"""Links over a Unix-domain socket, between workers that share a host.

The same frames as on the gRPC stream, each prefixed with its length, at a fraction of an
HTTP/2 round trip. Co-location is proved by the shared-memory probe (see
:mod:`rpcdist.transport.shm`); ``RpcBackendOptions(transport="grpc")`` turns this carrier off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from rpcdist._runtime import stray_cancellation, wait_for
from rpcdist.security import ACCEPTED, HELLO_BYTES, REFUSED, VERDICT_BYTES, Security
from rpcdist.transport.api import Accept, Link, LinkHandler, PeerAddress, Session
from rpcdist.transport.frames import LINK_OPENING, FrameError, encode_control
from rpcdist.transport.framing import BIG_FRAME_BYTES, LENGTH, FrameSplitter, TakenReading
from rpcdist.transport.writer import FrameWriter

log = logging.getLogger(__name__)


HELLO_TIMEOUT = 10.0  # seconds a new connection has to authenticate


class _FramedProtocol(asyncio.BufferedProtocol):
    """Length-prefixed frames over a stream socket, with write flow control.

    The bytes are cut into frames by a :class:`~rpcdist.transport.framing.FrameSplitter`
    (big frames land in aligned buffers of their own), which a reply channel's thread takes
    over with the socket (:meth:`take_reading`).

    Before any frame, the connection authenticates once: a client (``hello`` given) writes its
    hello first and reads the server's verdict (a refusal closes the connection, reported as
    the reason it was lost); a server (``admit`` given) reads the hello, answers, and decodes
    frames only once ``admit`` accepted it (a refused client is closed, its bytes never read).
    """

    def __init__(
        self,
        on_frame: Callable[[bytes | memoryview], None],
        on_eof: Callable[[], None],
        *,
        hello: bytes | None = None,
        admit: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._hello = hello
        self._admit = admit
        # Bytes of the handshake still expected before frames: the verdict or the hello.
        self._handshake = VERDICT_BYTES if hello is not None else HELLO_BYTES if admit is not None else 0
        self._refusal = ""
        self._on_frame = on_frame
        self._on_eof = on_eof
        self._frames = FrameSplitter()
        self._reading_taken = False  # a thread reads the socket now (see take_reading)
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[str] = self._loop.create_future()
        # Direct writes from other threads (see try_write): a second handle on the socket, made
        # once the handshake is done; the tail of a direct write the socket did not take, which
        # goes out (from the loop) before anything else.
        self._direct_socket: socket.socket | None = None
        self._direct_lock = threading.Lock()  # guards _direct_socket against its closing
        self._remainder: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._hello is not None:
            self.transport.write(self._hello)  # first, before any frame this side writes
        elif self._admit is not None:
            asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self._hello_overdue)
        else:
            self._allow_direct_writes()

    def _allow_direct_writes(self) -> None:
        """Frames may flow now: let other threads write them on a handle of their own (plain
        sockets only: TLS must go through the transport)."""
        transport = self.transport
        if transport is None or transport.get_extra_info("sslcontext") is not None:
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            handle = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError as exc:
            log.debug("no direct writes on this connection: %s", exc)
            return
        handle.setblocking(False)
        with self._direct_lock:
            self._direct_socket = handle

    def try_write(self, pieces: list[bytes | memoryview], size: int) -> bool:
        """Write one frame from any thread, if the socket takes it now: only while the
        transport holds nothing unsent (so frames keep their order; the caller holds the
        writer's lock, which the loop's writes take too). False: nothing was written. If the
        socket takes part of it, the rest goes out from the loop before any other frame."""
        transport = self.transport
        if (
            self._direct_socket is None
            or self._remainder is not None
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return False
        data = b"".join([LENGTH.pack(size), *pieces])
        with self._direct_lock:
            handle = self._direct_socket
            if handle is None:
                return False
            try:
                sent = handle.send(data)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:  # broken: the loop's reader reports the loss
                return False
        if sent < len(data):
            self._remainder = data[sent:]
            self._loop.call_soon_threadsafe(self._flush_remainder)
        return True

    def _flush_remainder(self) -> None:
        """Hand the unsent tail of a direct write to the transport (loop only)."""
        rest, self._remainder = self._remainder, None
        if rest is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(rest)

    def _close_direct(self) -> None:
        with self._direct_lock:
            handle, self._direct_socket = self._direct_socket, None
        if handle is not None:
            handle.close()

    def _hello_overdue(self) -> None:
        if self._handshake and self.transport is not None and not self.transport.is_closing():
            self._refusal = f"no authentication within {HELLO_TIMEOUT:g} s"
            self.transport.abort()

    def _shake(self) -> bool:
        """Consume the handshake from the staging buffer; whether frames may follow."""
        got = self._frames.take(self._handshake)
        if got is None:
            return False
        self._handshake = 0
        transport = self.transport
        assert transport is not None
        if self._admit is not None:  # server: check the client's hello
            if self._admit(got):
                transport.write(ACCEPTED)
                self._allow_direct_writes()
                return True
            log.warning("refused a connection: missing or wrong auth token")
            self._refusal = "refused: missing or wrong auth token"
            transport.write(REFUSED)
            transport.close()  # after the verdict is flushed; nothing it sent is decoded
            return False
        if got == ACCEPTED:  # client: the server's verdict
            self._allow_direct_writes()
            return True
        self._refusal = (
            "the peer refused the connection (UNAUTHENTICATED): missing or wrong auth token"
            if got == REFUSED
            else "the peer did not answer the handshake: not an rpcdist worker of this version"
        )
        transport.abort()
        return False

    # -- reading ----------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.room()

    def buffer_updated(self, nbytes: int) -> None:
        frames = self._frames
        frames.filled(nbytes)
        if self._handshake or self._refusal:
            if self._refusal or not self._shake():
                if self._refusal:  # refused: nothing more it sends is looked at
                    frames.clear()
                return
        try:
            while (frame := frames.next_frame()) is not None:
                self._on_frame(frame)
                if self._reading_taken:
                    return
        except FrameError as exc:
            log.warning("closing a connection that sent a malformed frame: %s", exc)
            frames.clear()
            if self.transport is not None:
                self.transport.abort()

    def take_reading(self) -> TakenReading | None:
        """From a frame handler, on the loop: stop reading this connection here and hand it to a
        thread, which reads what follows (see :class:`TakenReading`). The loop keeps writing;
        the thread closes the connection once the peer ended it. None if this connection
        cannot be read so (TLS, or no socket)."""
        transport = self.transport
        if transport is None or transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        try:
            handle = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError as exc:
            log.debug("cannot hand this connection's reading to a thread: %s", exc)
            return None
        transport.pause_reading()
        self._reading_taken = True
        return TakenReading(handle, self._frames, self._close_soon)

    def _close_soon(self) -> None:
        """Close the connection (any thread)."""
        try:
            self._loop.call_soon_threadsafe(lambda: self.transport is not None and self.transport.close())
        except RuntimeError:  # the loop is closed: so is the connection
            pass

    def eof_received(self) -> bool:
        self._on_eof()
        return True  # keep our side open to flush replies

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_direct()
        self._can_write.set()
        if not self.lost.done():
            self.lost.set_result(self._refusal or (str(exc) if exc else "the connection was closed"))

    # -- writing ----------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def write(self, pieces: list[bytes | memoryview]) -> None:
        """Write one frame, given as its pieces (big pieces are not copied to be joined)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise OSError("connection closed")
        self._put(transport, pieces)
        if not self._can_write.is_set():
            await self._can_write.wait()

    def write_on_loop(self, pieces: list[bytes | memoryview]) -> bool:
        """Write one frame now (loop only), if the transport takes it without waiting: open
        and not paused. False: nothing was written (the writer task then waits its turn)."""
        transport = self.transport
        if transport is None or transport.is_closing() or not self._can_write.is_set():
            return False
        self._put(transport, pieces)
        return True

    def _put(self, transport: asyncio.Transport, pieces: list[bytes | memoryview]) -> None:
        if self._remainder is not None:  # a direct write's tail goes first
            self._flush_remainder()
        size = 0
        for piece in pieces:
            size += len(piece)
        if size < BIG_FRAME_BYTES:
            transport.write(b"".join([LENGTH.pack(size), *pieces]))
        else:
            transport.writelines([LENGTH.pack(size), *pieces])


class UnixLink(Link):
    """Frames over a Unix-domain socket to a co-located peer (whose death closes it at once,
    so it needs no heartbeats).

    Its first envelope is a ``LINK_OPENING`` with its ``token``: requests this worker sends the
    peer on reply channels name the token and how many envelopes the link carried before them
    (see ``rpcdist.transport.reply_channel``)."""

    heartbeats = False

    def __init__(self, handler: LinkHandler, peer: PeerAddress, path: str, security: Security) -> None:
        super().__init__(handler, peer, path)
        self._security = security
        self._protocol: _FramedProtocol | None = None
        self._connected = asyncio.get_running_loop().create_task(self._connect(path))
        self.writer = FrameWriter(self._write, peer.name)
        self.token = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        self.writer.send(iter([encode_control(self.token, LINK_OPENING)]))
        self.reader = asyncio.get_running_loop().create_task(
            self._watch(), name=f"rpcdist-reader-{peer.name}"
        )
        self._eof = asyncio.Event()

    async def _connect(self, address: str) -> _FramedProtocol:
        hello = self._security.hello()

        def protocol_factory() -> _FramedProtocol:
            return _FramedProtocol(lambda raw: self.handler.on_frame(self, raw), self._peer_done, hello=hello)

        _, protocol = await self._open(protocol_factory, address)
        self._protocol = protocol
        self.writer.direct = protocol.try_write  # (refuses until the handshake is done)
        self.writer.loop_write = protocol.write_on_loop
        return protocol

    async def _open(self, factory: Callable[[], _FramedProtocol], path: str) -> tuple[Any, _FramedProtocol]:
        return await asyncio.get_running_loop().create_unix_connection(factory, path)

    def _peer_done(self) -> None:
        """The callee closed its side: it has sent every reply it ever will (it answers all of
        ours before closing when we shut down; otherwise it died or left). Calls still
        pending fail now, through ``on_lost``, instead of at their timeouts."""
        self._eof.set()

        def close(connected: asyncio.Future[_FramedProtocol]) -> None:
            if not connected.cancelled() and connected.exception() is None:
                transport = connected.result().transport
                if transport is not None:
                    transport.close()

        self._connected.add_done_callback(close)  # at once if connected already

    async def _write(self, pieces: list[bytes | memoryview]) -> None:
        protocol = self._protocol or await self._connected
        await protocol.write(pieces)

    async def _watch(self) -> None:
        reason = "the connection was closed"
        try:
            protocol = await self._connected
            reason = await protocol.lost
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, or a malformed reply
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.handler.on_lost(self, self.lost_reason or reason)

    async def close(self, graceful: bool) -> None:
        try:
            if graceful:
                await wait_for(self.writer.close(), 5.0)
                protocol = await wait_for(self._connected, 5.0)
                transport = protocol.transport
                # The peer may have closed first (its EOF closes ours): nothing left to end.
                if transport is not None and not transport.is_closing() and transport.can_write_eof():
                    transport.write_eof()
                await wait_for(self._eof.wait(), 5.0)  # the callee finished our calls
        except (asyncio.TimeoutError, OSError, RuntimeError):
            pass  # RuntimeError: uvloop's word for a transport closed under us
        except asyncio.CancelledError:
            if not stray_cancellation():  # the connection attempt was stopped meanwhile
                raise
        finally:
            self.writer.abort()
            self.reader.cancel()
            if (
                self._connected.done()
                and not self._connected.cancelled()
                and self._connected.exception() is None
            ):
                transport = self._connected.result().transport
                if transport is not None:
                    transport.close()
            else:
                self._connected.cancel()


async def serve_unix(path: str, accept: Accept, security: Security) -> asyncio.AbstractServer:
    """Accept co-located callers on the Unix socket ``path`` (owner-only: mode 0600, inside a
    0700 directory) that carry ``security``'s token."""
    server = await asyncio.get_running_loop().create_unix_server(connection_factory(accept, security), path)
    os.chmod(path, 0o600)
    return server


def connection_factory(accept: Accept, security: Security) -> Callable[[], _FramedProtocol]:
    """The protocol factory of a server of framed streams (Unix or TCP sockets): a session is
    made for a connection only once its hello carried ``security``'s token."""
    loop = asyncio.get_running_loop()

    def connection() -> _FramedProtocol:
        holder: dict[str, Any] = {}

        def on_frame(raw: bytes | memoryview) -> None:
            session = holder.get("session")
            if session is None:  # the first frame after an accepted hello
                session = accept(
                    protocol.write, protocol.try_write, protocol.write_on_loop, protocol.take_reading
                )
                holder["session"] = session
            session.on_frame(raw)

        def on_eof() -> None:
            session = holder.get("session")
            if session is None:
                if protocol.transport is not None:
                    protocol.transport.close()
                return
            loop.create_task(_finish(session, protocol))

        def lost(_: object) -> None:
            session = holder.get("session")
            if session is not None:
                session.cleanup()

        protocol = _FramedProtocol(on_frame, on_eof, admit=security.admits)
        protocol.lost.add_done_callback(lost)
        return protocol

    return connection


async def _finish(session: Session, protocol: _FramedProtocol) -> None:
    try:
        await session.finish()
    finally:
        if protocol.transport is not None:
            protocol.transport.close()
