"""Links over gRPC: one long-lived bidirectional ``rpcdist.v1.Agent/Exchange`` stream per
caller and peer. Works between any hosts; the only carrier a non-rpcdist client sees.

Each gRPC message on the stream is one frame (see :mod:`rpcdist.transport.frames`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from rpcdist._runtime import stray_cancellation, wait_for
from rpcdist.security import Security
from rpcdist.transport.api import Accept, Link, LinkHandler, PeerAddress, Write
from rpcdist.transport.frames import FrameError
from rpcdist.transport.writer import FrameWriter

log = logging.getLogger(__name__)

SERVICE = "rpcdist.v1.Agent"
EXCHANGE_METHOD = f"/{SERVICE}/Exchange"
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


class GrpcLink(Link):
    """A bidirectional Exchange stream on a gRPC channel."""

    def __init__(self, handler: LinkHandler, peer: PeerAddress, address: str, security: Security) -> None:
        super().__init__(handler, peer, address)
        self.channel = security.channel(address, options=CHANNEL_OPTIONS)
        # The token travels once, with the stream's metadata; the server checks it before
        # the first frame is read.
        self.call = self.channel.stream_stream(
            EXCHANGE_METHOD, request_serializer=None, response_deserializer=None
        )(metadata=security.metadata())
        self.writer = FrameWriter(joined(self.call.write), peer.name)
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"rpcdist-reader-{peer.name}")

    async def _read(self) -> None:
        reason = "the stream ended"
        try:
            while True:
                raw = await self.call.read()
                if raw is grpc.aio.EOF:
                    break
                self.handler.on_frame(self, raw)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                log.error("%s refused this worker: %s", self.peer.name, exc.details())
        except asyncio.CancelledError:
            reason = "the connection was closed"
            raise
        except Exception as exc:  # a malformed reply: fail this peer's calls, keep the agent up
            log.exception("bad frame from %s", self.peer.name)
            reason = f"bad frame: {exc}"
        finally:
            self.handler.on_lost(self, self.lost_reason or reason)

    async def close(self, graceful: bool) -> None:
        try:
            if graceful:
                await wait_for(self.writer.close(), 5.0)
                await wait_for(self.call.done_writing(), 5.0)
                await wait_for(asyncio.shield(self.reader), 5.0)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            if not stray_cancellation():  # the reader was stopped meanwhile: nothing to wait for
                raise
        finally:
            self.writer.abort()
            self.reader.cancel()
            await self.channel.close(grace=None)


def joined(write: Callable[[bytes], Awaitable[None]]) -> Write:
    """gRPC sends one message per frame: the pieces are joined into it."""

    def write_frame(pieces: list[bytes | memoryview]) -> Awaitable[None]:
        return write(pieces[0] if len(pieces) == 1 and type(pieces[0]) is bytes else b"".join(pieces))

    return write_frame


def exchange_handler(accept: Accept) -> grpc.GenericRpcHandler:
    """The gRPC handler that serves incoming Exchange streams through ``accept``."""

    async def exchange(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await serve_grpc_stream(accept, requests, context)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Exchange": grpc.stream_stream_rpc_method_handler(
                exchange, request_deserializer=None, response_serializer=None
            )
        },
    )


async def serve_grpc_stream(
    accept: Accept,
    request_iterator: Any,
    context: grpc.aio.ServicerContext,
) -> None:
    """Drive one incoming Exchange stream through the session ``accept`` makes for it."""
    session = accept(joined(context.write), None, None)
    try:
        async for raw in request_iterator:
            try:
                session.on_frame(raw)
            except FrameError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {exc}")
        await session.finish()  # the caller is done sending: finish its calls, flush replies
    finally:
        session.cleanup()
