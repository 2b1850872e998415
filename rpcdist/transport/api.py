"""The transport's small interface: what a link is, and what it reports to whoever uses it.

A **link** is the caller's end of one ordered, bidirectional connection to one peer; it
carries *frames* (bytes, see :mod:`rpcdist.transport.frames`) and knows nothing of what is in
them. Each worker's :class:`~rpcdist.transport.endpoint.Transport` keeps one outgoing link
per peer and accepts the incoming ones, handing each to a *session* of its user (the agent).

- :class:`LinkHandler` — the user's caller side: frames that came back on a link, and the
  link's loss (the per-peer liveness signal: every pending exchange with that peer fails).
- :class:`Session` — the user's callee side of one incoming connection.

A peer that stops answering without closing (its host vanished, its link was cut, it hangs)
is found by heartbeats on network links: an empty frame on a link that has been quiet,
answered by an empty frame on the same connection (see ``Transport``).

Two carriers implement :class:`Link`: a gRPC bidirectional stream
(:mod:`~rpcdist.transport.grpc_link`, works between any hosts) and a length-prefixed Unix
socket (:mod:`~rpcdist.transport.unix_link`, between workers that share a host). Security
(TLS, tokens) and heartbeats belong here, in these two modules and the endpoint.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rpcdist.transport.writer import FrameWriter

if TYPE_CHECKING:
    from rpcdist.transport.framing import TakenReading

__all__ = [
    "Accept",
    "ChannelSession",
    "ChannelSessionFactory",
    "Entries",
    "Link",
    "LinkHandler",
    "PeerAddress",
    "Session",
    "SessionFactory",
    "TakeReading",
    "Write",
]

Entries = Iterator[list[bytes | memoryview]]
"""One message, as a lazy sequence of frame entries (see ``frames.encode_message``)."""

Write = Callable[[list[bytes | memoryview]], Awaitable[None]]
"""Writes one frame, given as its pieces (a carrier that can send them as they are, without
joining them into one buffer, does so)."""


@dataclass(frozen=True)
class PeerAddress:
    """How to reach one peer: what it published at rendezvous, plus what this host sees."""

    rank: int
    name: str
    grpc_address: str
    unix_path: str = ""
    colocated: bool = False  # shares this host's /dev/shm (shared memory and the socket reach it)
    tcp_address: str = ""  # its framed-TCP server, if it runs one (transport="tcp")


class LinkHandler(Protocol):
    """What a link reports to (the agent's caller half)."""

    def on_frame(self, link: Link, raw: bytes) -> None:
        """A frame arrived on ``link``; raise to drop the link as malformed."""

    def on_lost(self, link: Link, reason: str) -> None:
        """``link`` is gone (closed, refused, reset, or sent garbage); ``reason`` says why."""


class Session(Protocol):
    """The user's side of one incoming connection (the agent's callee half).

    A session may name its peer's rank as ``caller_rank`` (-1 until known): frames on the
    connection then count as hearing from that peer (see ``Transport``)."""

    def on_frame(self, raw: bytes) -> None:
        """Handle one frame; raises ``FrameError`` if it is malformed."""

    async def finish(self) -> None:
        """The peer is done sending: finish its work and flush the replies."""

    def cleanup(self) -> None:
        """The connection is gone: drop whatever is left."""


SessionFactory = Callable[[FrameWriter], Session]
"""Makes the user's session of a new incoming connection, given the writer of its replies."""

class ChannelSession(Protocol):
    """The user's side of one reply channel a co-located caller opened: its thread hands it
    every frame the caller sends there (see ``rpcdist.transport.reply_channel``)."""

    def on_frame(self, raw: bytes | memoryview) -> None:
        """Handle one frame, on the channel's thread; raises ``FrameError`` if it is malformed."""

    def cleanup(self) -> None:
        """The channel is gone (any thread)."""


ChannelSessionFactory = Callable[[FrameWriter, int], ChannelSession]
"""Makes the user's session of a new reply channel, given the writer of its answers and the
rank of its caller."""

TakeReading = Callable[[], "TakenReading | None"]
"""Hands the reading of an incoming connection to a thread (see ``_FramedProtocol.take_reading``)."""

Accept = Callable[..., Session]
"""What a carrier's server calls for each incoming connection (``Write``, then ``DirectWrite |
None``, ``LoopWrite | None`` and ``TakeReading | None``), with the function that writes to it,
and if the carrier has them the one that writes from any thread, the one that writes at once
on the loop and the one that hands its reading to a thread (the transport's own session,
which answers heartbeats and passes the rest on)."""


class Link(abc.ABC):
    """The caller's end of one connection to a peer: :meth:`send` queues a message, the
    replies and the loss of the link go to the :class:`LinkHandler`."""

    writer: FrameWriter
    reader: asyncio.Task[None]  # reports the loss (through the handler) when it ends
    # Whether silence on this link can mean a lost peer. Not on a co-located peer's socket:
    # the kernel closes it the moment the process dies, whereas a live peer's loop may be
    # busy for seconds (a 1 GiB copy on a loaded host) and must not be declared dead for it.
    heartbeats = True

    def __init__(self, handler: LinkHandler, peer: PeerAddress, address: str) -> None:
        self.handler = handler
        self.peer = peer
        self.address = address
        # Messages on this link still waiting for CHUNKs (filled by the handler's decoder).
        self.assemblies: dict[int, Any] = {}
        self.last_heard = time.monotonic()  # when the peer last sent anything on this link
        # When the peer was last heard on its own connection to us, if its heartbeats there
        # cover this pair (this link then needs none of its own: Transport._heard_from).
        self.peer_heard_at = float("-inf")
        self.lost_reason = ""  # set when the link is given up on (no heartbeat answer)
        self.traffic: Any = None  # the peer's byte counters (rpcdist.metrics.Traffic), metrics on
        self.slots_read: Any = None  # the handler's SLOTS_READ notices to the peer (frames.py)

    def give_up(self, reason: str) -> None:
        """The peer stopped answering: stop reading; the loss is reported with ``reason``."""
        self.lost_reason = reason
        self.reader.cancel()

    def send(self, entries: Entries, written: Callable[[bool], None] | None = None) -> None:
        """Queue one message; it goes out in order, interleaved chunk by chunk with others.
        ``written``: see :meth:`FrameWriter.send`."""
        self.writer.send(entries, written)

    @abc.abstractmethod
    async def close(self, graceful: bool) -> None:
        """Close the link; ``graceful`` flushes what is queued and lets the peer finish first."""
