"""Links between workers: ordered, bidirectional carriers of Frames (see wire.py).

Two carriers behind one interface:

- **gRPC** (``rpcdist.v1.Agent/Exchange``): one long-lived bidirectional stream per caller
  and peer. Works between any hosts; the only carrier a non-rpcdist client sees.
- **Unix socket**: between workers that share a host (proved by the shared-memory probe,
  see shm.py), the same Frames go length-prefixed over a Unix-domain socket, which costs a
  fraction of an HTTP/2 round trip. ``RpcBackendOptions(transport="grpc")`` turns it off.

The caller side is a :class:`GrpcLink` or :class:`UnixLink`; the callee side feeds each
incoming connection's frames to a session object of the agent (``on_frame``/``finish``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from rpcdist.rpc.wire import FrameError

log = logging.getLogger(__name__)

EXCHANGE_METHOD = "/rpcdist.v1.Agent/Exchange"
MAX_FRAME_BYTES = 1 << 20
GRPC_MESSAGE_LIMIT = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Servers accept the clients' 30 s keepalive pings (gRPC's default would answer GOAWAY).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
    ("grpc.http2.max_ping_strikes", 0),
]
_LENGTH = struct.Struct("<Q")

Entries = Iterator[list[bytes | memoryview]]


class FrameWriter:
    """Writes queued messages to one link, many small envelopes per write.

    Large messages are interleaved chunk by chunk with others, so a big tensor sent inline
    does not hold up small calls to the same peer.
    """

    def __init__(self, write: Callable[[bytes], Any], name: str) -> None:
        self._write = write
        self._messages: collections.deque[Entries] = collections.deque()
        self._wake = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"rpcdist-writer-{name}")

    def send(self, entries: Entries) -> None:
        self._messages.append(entries)
        self._wake.set()

    async def _run(self) -> None:
        messages = self._messages
        while True:
            if not messages:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            pieces: list[bytes | memoryview] = []
            size = 0
            while messages and size < MAX_FRAME_BYTES:
                entry = next(messages[0], None)
                if entry is None:
                    messages.popleft()
                    continue
                pieces += entry
                size += sum(len(p) for p in entry)
                if size >= MAX_FRAME_BYTES and len(messages) > 1:
                    messages.rotate(-1)  # a big message yields its turn after each chunk
            if pieces:
                try:
                    await self._write(b"".join(pieces))
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, OSError) as exc:
                    # The link is gone; its reader fails the calls that were waiting on it.
                    log.debug("writer %s stopped: %s", self._task.get_name(), exc)
                    messages.clear()
                    return

    async def close(self) -> None:
        """Flush what is queued, then stop."""
        self._closed = True
        self._wake.set()
        await self._task

    def abort(self) -> None:
        self._task.cancel()


class LinkOwner(Protocol):
    """What a caller-side link reports to (the agent)."""

    def _on_reply_frame(self, link: Any, raw: bytes) -> None: ...

    def _on_connection_lost(self, link: Any, reason: str) -> None: ...


class Link:
    """The caller's end of a connection to one peer: ``writer`` sends, replies go to the owner."""

    writer: FrameWriter
    reader: asyncio.Task[None]

    def __init__(self, owner: LinkOwner, peer: Any, address: str) -> None:
        self.owner = owner
        self.peer = peer
        self.address = address
        self.assemblies: dict[int, Any] = {}

    async def close(self, graceful: bool) -> None:
        raise NotImplementedError


class GrpcLink(Link):
    """A bidirectional Exchange stream on a gRPC channel."""

    def __init__(self, owner: LinkOwner, peer: Any, address: str) -> None:
        super().__init__(owner, peer, address)
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.call = self.channel.stream_stream(
            EXCHANGE_METHOD, request_serializer=None, response_deserializer=None
        )()
        self.writer = FrameWriter(self.call.write, peer.name)
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"rpcdist-reader-{peer.name}")

    async def _read(self) -> None:
        reason = "the stream ended"
        try:
            while True:
                raw = await self.call.read()
                if raw is grpc.aio.EOF:
                    break
                self.owner._on_reply_frame(self, raw)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the connection was closed"
            raise
        except Exception as exc:  # a malformed reply: fail this peer's calls, keep the agent up
            log.exception("bad frame from %s", self.peer.name)
            reason = f"bad frame: {exc}"
        finally:
            self.owner._on_connection_lost(self, reason)

    async def close(self, graceful: bool) -> None:
        try:
            if graceful:
                await asyncio.wait_for(self.writer.close(), 5.0)
                await asyncio.wait_for(self.call.done_writing(), 5.0)
                await asyncio.wait_for(asyncio.shield(self.reader), 5.0)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            self.writer.abort()
            self.reader.cancel()
            await self.channel.close(grace=None)


class _FramedProtocol(asyncio.Protocol):
    """Length-prefixed frames over a stream socket, with write flow control."""

    def __init__(self, on_frame: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        self._on_frame = on_frame
        self._on_eof = on_eof
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while len(buffer) - start >= 8:
                (length,) = _LENGTH.unpack_from(buffer, start)
                if length > GRPC_MESSAGE_LIMIT:
                    raise FrameError(f"frame of {length} bytes is above the {GRPC_MESSAGE_LIMIT} limit")
                end = start + 8 + length
                if len(buffer) < end:
                    break
                self._on_frame(bytes(buffer[start + 8 : end]))
                start = end
        except FrameError as exc:
            log.warning("closing a connection that sent a malformed frame: %s", exc)
            del buffer[:]
            if self.transport is not None:
                self.transport.abort()
            return
        if start:
            del buffer[:start]

    def eof_received(self) -> bool:
        self._on_eof()
        return True  # keep our side open to flush replies

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        if not self.lost.done():
            self.lost.set_result(str(exc) if exc else "the connection was closed")

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def write(self, frame: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise OSError("connection closed")
        if len(frame) < 65536:
            transport.write(_LENGTH.pack(len(frame)) + frame)
        else:  # don't copy a big frame just to prefix it
            transport.write(_LENGTH.pack(len(frame)))
            transport.write(frame)
        if not self._can_write.is_set():
            await self._can_write.wait()


class UnixLink(Link):
    """Frames over a Unix-domain socket to a co-located peer."""

    def __init__(self, owner: LinkOwner, peer: Any, path: str) -> None:
        super().__init__(owner, peer, path)
        self._protocol: _FramedProtocol | None = None
        self._connected = asyncio.get_running_loop().create_task(self._connect(path))
        self.writer = FrameWriter(self._write, peer.name)
        self.reader = asyncio.get_running_loop().create_task(
            self._watch(), name=f"rpcdist-reader-{peer.name}"
        )
        self._eof = asyncio.Event()

    async def _connect(self, path: str) -> _FramedProtocol:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: _FramedProtocol(lambda raw: self.owner._on_reply_frame(self, raw), self._eof.set), path
        )
        self._protocol = protocol
        return protocol

    async def _write(self, frame: bytes) -> None:
        protocol = self._protocol or await self._connected
        await protocol.write(frame)

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
            self.owner._on_connection_lost(self, reason)

    async def close(self, graceful: bool) -> None:
        try:
            if graceful:
                await asyncio.wait_for(self.writer.close(), 5.0)
                protocol = await asyncio.wait_for(self._connected, 5.0)
                if protocol.transport is not None and protocol.transport.can_write_eof():
                    protocol.transport.write_eof()
                await asyncio.wait_for(self._eof.wait(), 5.0)  # the callee finished our calls
        except (asyncio.TimeoutError, OSError):
            pass
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


class InboundSession(Protocol):
    """What the agent provides for each incoming connection."""

    writer: FrameWriter

    def on_frame(self, raw: bytes) -> None: ...

    async def finish(self) -> None: ...

    def cleanup(self) -> None: ...


async def serve_grpc_stream(
    make_session: Callable[[Callable[[bytes], Any]], InboundSession],
    request_iterator: Any,
    context: grpc.aio.ServicerContext,
) -> None:
    """Drive one incoming Exchange stream through a session of the agent."""
    session = make_session(context.write)
    try:
        async for raw in request_iterator:
            try:
                session.on_frame(raw)
            except FrameError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {exc}")
        await session.finish()  # the caller is done sending: finish its calls, flush replies
    finally:
        session.cleanup()


async def serve_unix(
    path: str, make_session: Callable[[Callable[[bytes], Any]], InboundSession]
) -> asyncio.AbstractServer:
    """Accept co-located callers on the Unix socket ``path``."""
    loop = asyncio.get_running_loop()

    def connection() -> _FramedProtocol:
        holder: dict[str, Any] = {}

        def on_frame(raw: bytes) -> None:
            holder["session"].on_frame(raw)

        def on_eof() -> None:
            loop.create_task(_finish(holder["session"], protocol))

        protocol = _FramedProtocol(on_frame, on_eof)
        holder["session"] = make_session(protocol.write)
        protocol.lost.add_done_callback(lambda _: holder["session"].cleanup())
        return protocol

    return await loop.create_unix_server(connection, path)


async def _finish(session: InboundSession, protocol: _FramedProtocol) -> None:
    try:
        await session.finish()
    finally:
        if protocol.transport is not None:
            protocol.transport.close()
