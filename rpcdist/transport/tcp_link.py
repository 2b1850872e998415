"""Links over plain TCP: the Unix-socket framing (length-prefixed frames, big frames read
straight into aligned buffers) between hosts, without HTTP/2.

Chosen with ``RpcBackendOptions(transport="tcp")``: lower latency and higher throughput than
the gRPC stream between hosts, but a carrier only rpcdist speaks. A vanished host closes
nothing, so these links carry heartbeats, as gRPC links do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rpcdist.security import Security
from rpcdist.transport.api import Accept
from rpcdist.transport.unix_link import UnixLink, _FramedProtocol, connection_factory


class TcpLink(UnixLink):
    """Frames over a TCP connection to ``host:port``."""

    heartbeats = True

    async def _open(
        self, factory: Callable[[], _FramedProtocol], address: str
    ) -> tuple[Any, _FramedProtocol]:
        host, _, port = address.rpartition(":")
        context = self._security.ssl_context(server_side=False)
        return await asyncio.get_running_loop().create_connection(
            factory,
            host.strip("[]"),
            int(port),
            ssl=context,
            server_hostname=host.strip("[]") if context else None,
        )


async def serve_tcp(host: str, accept: Accept, security: Security) -> tuple[asyncio.AbstractServer, int]:
    """Accept framed TCP connections on ``host`` (an ephemeral port) that carry ``security``'s
    token, over TLS when it has TLS files; returns the server and port."""
    server = await asyncio.get_running_loop().create_server(
        connection_factory(accept, security), host, 0, ssl=security.ssl_context(server_side=True)
    )
    return server, server.sockets[0].getsockname()[1]
