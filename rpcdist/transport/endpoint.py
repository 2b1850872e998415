"""One worker's transport: the servers that accept peers' links, one outgoing link per peer,
and the shared-memory handoff to peers on the same host.

Lifecycle::

    transport = Transport(name, handler, make_session, shm_threshold_bytes=512 << 10)
    port = await transport.start("127.0.0.1")      # gRPC server (+ Unix socket when possible)
    card = transport.card("127.0.0.1")             # published at rendezvous
    transport.set_peers([...PeerAddress...])       # learned from rendezvous
    transport.link(rank).send(entries)             # connects on first use
    await transport.close(graceful=True)

Co-location is proved, not guessed: each transport leaves a probe file in ``/dev/shm`` and
publishes its name; a peer that can see it shares this host's shared memory, and is reached
over the Unix socket with large buffers handed over through shared memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from rpcdist import metrics
from rpcdist._runtime import channel_thread, match_torch_threads
from rpcdist.security import Security, server_interceptors
from rpcdist.transport import frames, shm
from rpcdist.transport.api import (
    ChannelSessionFactory,
    Link,
    LinkHandler,
    PeerAddress,
    Session,
    SessionFactory,
    TakeReading,
    Write,
)
from rpcdist.transport.framing import TakenReading
from rpcdist.transport.grpc_link import CHANNEL_OPTIONS, SERVICE, GrpcLink, exchange_handler
from rpcdist.transport.reply_channel import ReplyChannel, ReplyChannels, serve_requests
from rpcdist.transport.tcp_link import TcpLink, serve_tcp
from rpcdist.transport.unix_link import UnixLink, serve_unix
from rpcdist.transport.writer import DirectWrite, FrameWriter, LoopWrite
from rpcdist.v1 import agent_pb2  # noqa: F401 - registers the Agent service's descriptor for reflection

ServiceSetup = tuple[str, Callable[[grpc.aio.Server], None]]
"""A further gRPC service for the worker's server: its full name, and what adds it to a server."""

log = logging.getLogger(__name__)

__all__ = ["Transport"]


class Transport(LinkHandler):
    """Moves frames between this worker and its peers; knows nothing of what they carry.

    ``handler`` gets the frames that come back on outgoing links and their loss;
    ``make_session`` makes the session of each incoming connection. ``shm_threshold_bytes``
    (0: off) is the size from which buffers for co-located peers go through shared memory;
    ``unix_sockets=False`` keeps every peer on gRPC; ``tcp_links=True`` reaches peers on other
    hosts over framed TCP instead of gRPC (both sides serve it). ``make_channel_session`` makes
    the session of a reply channel a co-located caller opened, given the writer of its answers
    and its caller's rank: a thread of the channel's own hands it every frame the caller sends
    there (its requests: see :mod:`rpcdist.transport.reply_channel`); without it, callers send
    every request on their links.

    Heartbeats (gRPC links; a co-located peer's socket closes when it dies): a link the peer
    has been quiet on for ``heartbeat_interval`` seconds gets an empty frame, which the peer
    answers on the same connection; a peer quiet for ``heartbeat_interval * (heartbeat_misses
    + 1)`` seconds is given up on, and its loss is reported as if its connection had closed.
    A frame on the peer's own connection to us counts as hearing from it; a pair linked both
    ways beats one way (the link to the peer whose name sorts first waits for
    ``heartbeat_misses`` intervals of silence before it beats). This finds peers that vanish
    without closing (a host gone, a link cut, a hung process); 0 turns it off.

    ``security`` (default: none) is the token every incoming link must carry (checked once
    per connection: gRPC metadata, or the socket's hello, before any frame is decoded) and
    the TLS files of the gRPC server and channels (and of framed TCP links).
    """

    def __init__(
        self,
        name: str,
        handler: LinkHandler,
        make_session: SessionFactory,
        *,
        make_channel_session: ChannelSessionFactory | None = None,
        shm_threshold_bytes: int = 512 << 10,
        unix_sockets: bool = True,
        tcp_links: bool = False,
        heartbeat_interval: float = 1.0,
        heartbeat_misses: int = 3,
        security: Security | None = None,
    ) -> None:
        self.name = name
        self.security = security or Security()
        self._handler = handler
        self._make_session = make_session
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_misses = heartbeat_misses
        self._heartbeats: asyncio.Task[None] | None = None
        # Peers given up on for silence: a new link to one gets a single heartbeat's grace,
        # not the whole window again (until it answers on it).
        self._unresponsive: set[int] = set()
        self.shm_threshold_bytes = shm_threshold_bytes
        self._unix_sockets = unix_sockets
        self._tcp_links = tcp_links
        self._tcp_server: asyncio.AbstractServer | None = None
        self.tcp_port = 0
        self.shm_probe = shm.create_probe() if shm_threshold_bytes > 0 else ""
        self.slots = shm.SlotPool()
        self.peers: dict[int, PeerAddress] = {}
        self._links: dict[int, Link] = {}
        self._watched: set[_AnsweringSession] = set()  # network carriers' incoming sessions
        self._lost: list[Link] = []  # links gone from under us, closed for good at close()
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._unix_server: asyncio.AbstractServer | None = None
        self.unix_path = ""
        self.port = 0
        self._closed = False
        self._lost_peers: dict[int, str] = {}  # rank -> why its link was lost (until it reconnects)
        # (caller rank, channel id) -> the writer of a reply channel a co-located caller opened
        # to us (see rpcdist.transport.reply_channel)
        self._reply_channels: dict[tuple[int, int], FrameWriter] = {}
        self._make_channel_session = make_channel_session
        self._channel_readers: set[socket.socket] = set()  # the sockets their threads read
        self._my_channels = ReplyChannels(self.security)  # ours, to co-located peers

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, services: Sequence[ServiceSetup] = ()) -> int:
        """Serve incoming links on ``host`` (ephemeral gRPC port) and, when co-located peers
        can use it, a Unix socket; returns the gRPC port.

        The gRPC server also serves ``services``, the standard health service (SERVING until
        :meth:`close`) and server reflection, which lists them all."""
        security = self.security
        interceptors = server_interceptors(security, f"worker {self.name}")
        self._server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        self._server.add_generic_rpc_handlers((exchange_handler(self._accept_watched),))
        for _, add_to in services:
            add_to(self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [
            SERVICE,
            *(name for name, _ in services),
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self._server)
        address = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.port = security.add_port(self._server, address)
        if not self.port:
            raise OSError(f"worker {self.name} cannot listen on {host}")
        await self._server.start()
        for name in ("", *names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        listening = [f"gRPC {address[:-1]}{self.port} ({'TLS' if security.tls else 'plaintext'})"]
        if self.shm_probe and self._unix_sockets:
            path = shm.socket_path()
            try:
                self._unix_server = await serve_unix(path, self._accept_local, security)
                self.unix_path = path
                listening.append(f"Unix socket {path}")
            except OSError as exc:
                shm.remove_socket(path)
                log.info("no Unix-socket transport (%s); co-located peers use gRPC", exc)
        if self._tcp_links:
            self._tcp_server, self.tcp_port = await serve_tcp(host, self._accept_watched, security)
            listening.append(f"TCP {address[:-1]}{self.tcp_port} ({'TLS' if security.tls else 'plaintext'})")
        log.info(
            "%s listens on %s; %s",
            self.name,
            ", ".join(listening),
            "auth token required" if security.token else "NO auth token (anyone who reaches these may call)",
        )
        if self.heartbeat_interval > 0:
            self._heartbeats = asyncio.get_running_loop().create_task(
                self._beat(), name=f"rpcdist-heartbeats-{self.name}"
            )
        return self.port

    def _accept(
        self,
        write: Write,
        direct: DirectWrite | None = None,
        loop_write: LoopWrite | None = None,
        take_reading: TakeReading | None = None,
    ) -> Session:
        """The session of an incoming connection: heartbeats answered here, the rest to the
        user's session, both through one writer (so they never write at once)."""
        return _AnsweringSession(self._make_session, write, direct, loop_write)

    def _accept_local(
        self,
        write: Write,
        direct: DirectWrite | None = None,
        loop_write: LoopWrite | None = None,
        take_reading: TakeReading | None = None,
    ) -> Session:
        """:meth:`_accept` for the Unix socket, whose connections may also be reply channels
        (told by their first frame)."""
        return _LocalConnection(self, write, direct, loop_write, take_reading)

    def reply_writer(self, caller_rank: int, channel_id: int) -> FrameWriter | None:
        """The writer of reply channel ``channel_id`` of ``caller_rank`` (None if it is not open)."""
        return self._reply_channels.get((caller_rank, channel_id))

    def _serve_channel(self, caller_rank: int, writer: FrameWriter, taken: TakenReading) -> None:
        """Start the thread that reads the requests ``caller_rank`` sends on a reply channel and
        hands them to that channel's session (which answers through ``writer``)."""
        assert self._make_channel_session is not None
        session = self._make_channel_session(writer, caller_rank)
        self._channel_readers.add(taken.sock)

        def serve() -> None:
            match_torch_threads()  # (the session runs user functions on this thread)
            channel_thread.serving = True
            try:
                serve_requests(taken.sock, taken.frames, session.on_frame)
            except (OSError, frames.FrameError) as exc:
                if not self._closed:
                    log.info("%s: closing a reply channel of rank %s: %s", self.name, caller_rank, exc)
            except Exception:  # a bug must cost one channel (its caller sees it close), not more
                if not self._closed:
                    log.exception("%s: a reply channel of rank %s failed", self.name, caller_rank)
            finally:
                self._channel_readers.discard(taken.sock)
                taken.sock.close()
                session.cleanup()
                taken.close()

        threading.Thread(target=serve, name=f"rpcdist-{self.name}-channel-{caller_rank}", daemon=True).start()

    def _accept_watched(
        self,
        write: Write,
        direct: DirectWrite | None = None,
        loop_write: LoopWrite | None = None,
        take_reading: TakeReading | None = None,
    ) -> Session:
        """:meth:`_accept` for a network carrier (gRPC, TCP), whose links heartbeat: what the
        peer sends on its own connection counts as hearing from it (see :meth:`_heard_from`)."""
        if self.heartbeat_interval <= 0:
            return self._accept(write, direct, loop_write)
        heard, watched = self._heard_from, self._watched
        return _AnsweringSession(self._make_session, write, direct, loop_write, heard, watched)

    def _heard_from(self, rank: int, at: float) -> None:
        """``rank`` sent something on its own connection to us at ``at`` (or later): it is
        alive. A pair of peers linked both ways beats one way, answered, not both ways (each
        gRPC message costs an idle worker a dozen wake-ups of gRPC's threads): the one whose
        name sorts first beats; the other's link waits, while the first one's connection
        keeps carrying frames (its heartbeats, when quiet)."""
        link = self._links.get(rank)
        if link is not None:
            link.last_heard = max(link.last_heard, at)
            if link.peer.name < self.name:
                link.peer_heard_at = max(link.peer_heard_at, at)

    def _note_incoming(self, since: float) -> None:
        """Peers whose connections carried frames since the last tick were heard from then
        (counted per frame, so a call's path costs one increment, not a clock read)."""
        for session in self._watched:
            if session.frames != session.frames_noted:
                session.frames_noted = session.frames
                rank = session.peer_rank
                if rank >= 0:
                    self._heard_from(rank, since)

    async def _beat(self) -> None:
        """Send heartbeats on quiet links; give up on peers that stay silent too long."""
        interval = self.heartbeat_interval
        limit = interval * (self.heartbeat_misses + 1)
        loop = asyncio.get_running_loop()
        expected = loop.time() + interval
        previous = time.monotonic()
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            now = time.monotonic()
            late = loop.time() - expected
            expected = loop.time() + interval
            self._note_incoming(previous)
            previous = now
            links = [link for link in self._links.values() if link.heartbeats]
            if late > interval:
                # This process was stalled (not the peers): frames may be waiting unread.
                # Give every peer a fresh window instead of blaming it.
                for link in links:
                    link.last_heard = max(link.last_heard, now)
                continue
            for link in links:
                quiet = now - link.last_heard
                # Covered by the peer's frames on its own connection (its heartbeats come every
                # interval or two): ours beats only if those stop, one interval before giving up.
                covered = now - link.peer_heard_at <= 2.5 * interval
                due = limit - interval if covered else interval
                if quiet >= limit:
                    log.warning("%s: no answer from %s for %.1f s", self.name, link.peer.name, quiet)
                    self._unresponsive.add(link.peer.rank)
                    link.give_up(
                        f"no answer to heartbeats for {quiet:.1f} s (interval {interval:g} s, "
                        f"{self.heartbeat_misses} missed): its host or process stopped responding"
                    )
                elif quiet >= due:
                    link.writer.send_heartbeat()

    def card(self, advertise_host: str) -> dict[str, str]:
        """What peers need to reach this worker (published at rendezvous)."""
        return {
            "address": f"{advertise_host}:{self.port}",
            "shm_probe": self.shm_probe,
            "unix": self.unix_path,
            "tcp": f"{advertise_host}:{self.tcp_port}" if self.tcp_port else "",
        }

    @staticmethod
    def peer_from_card(
        rank: int, name: str, card: dict[str, str], probe_seen: bool | None = None
    ) -> PeerAddress:
        """The :class:`PeerAddress` of a peer from its published card."""
        colocated = shm.sees_probe(card.get("shm_probe", "")) if probe_seen is None else probe_seen
        return PeerAddress(
            rank, name, card.get("address", ""), card.get("unix", ""), colocated, card.get("tcp", "")
        )

    def set_peers(self, peers: Sequence[PeerAddress]) -> None:
        """Learn how to reach every peer (co-location counts only if this side uses shm)."""
        for peer in peers:
            if peer.colocated and not self.shm_probe:
                peer = dataclasses.replace(peer, colocated=False)
            self.peers[peer.rank] = peer

    def forget_peer(self, rank: int) -> None:
        """``rank`` left: drop its address; its link (if any) is closed with the transport."""
        self.peers.pop(rank, None)
        self._unresponsive.discard(rank)
        self._lost_peers.pop(rank, None)
        self._my_channels.forget(rank)
        link = self._links.pop(rank, None)
        if link is not None:
            link.writer.abort()
            self._lost.append(link)

    def peer_states(self) -> list[dict[str, object]]:
        """Each known peer's link as this worker sees it now (for metrics and status):
        ``name``, ``rank``, ``state`` ("connected", "unresponsive": heartbeats unanswered,
        "lost": its connection broke, "idle": never needed), ``carrier`` and
        ``seconds_since_heard`` (None without a link)."""
        now = time.monotonic()
        states = []
        for rank, peer in sorted(self.peers.items()):
            if peer.name == self.name:
                continue  # this worker itself
            link = self._links.get(rank)
            if rank in self._unresponsive:
                state = "unresponsive"
            elif link is not None:
                state = "connected"
            elif rank in self._lost_peers:
                state = "lost"
            else:
                state = "idle"
            states.append(
                {
                    "name": peer.name,
                    "rank": rank,
                    "state": state,
                    "carrier": type(link).__name__.removesuffix("Link").lower() if link is not None else "",
                    "seconds_since_heard": None if link is None else max(0.0, now - link.last_heard),
                }
            )
        return states

    def is_colocated(self, rank: int) -> bool:
        """Whether ``rank`` shares this host's /dev/shm (so shared memory reaches it)."""
        peer = self.peers.get(rank)
        return peer is not None and peer.colocated

    def on_unix_socket(self, rank: int) -> bool:
        """Whether the link with ``rank`` is (or will be) a Unix socket, which threads write to
        directly and whose calls may name reply channels (:meth:`link` chooses by it)."""
        peer = self.peers.get(rank)
        return peer is not None and bool(peer.unix_path) and peer.colocated and self._unix_sockets

    # ------------------------------------------------------------------ links
    def link(self, rank: int) -> Link:
        """The outgoing link to ``rank``, connecting on first use (raises KeyError if unknown)."""
        link = self._links.get(rank)
        if link is None:
            if self._closed:
                raise ConnectionError(f"transport of {self.name} is closed")
            peer = self.peers[rank]
            if self.on_unix_socket(rank):
                link = UnixLink(self, peer, peer.unix_path, self.security)
            elif peer.tcp_address and self._tcp_links:
                link = TcpLink(self, peer, peer.tcp_address, self.security)
            else:
                link = GrpcLink(self, peer, peer.grpc_address, self.security)
            if rank in self._unresponsive:  # one heartbeat's grace (see _beat)
                link.last_heard -= self.heartbeat_interval * self.heartbeat_misses
            if metrics.current is not None:
                link.traffic = link.writer.traffic = metrics.current.traffic(peer.name)
            self._links[rank] = link
            self._lost_peers.pop(rank, None)
        return link

    def take_reply_channel(self, rank: int, my_rank: int) -> ReplyChannel | None:
        """A reply channel to ``rank`` for one waiting call (see
        :mod:`rpcdist.transport.reply_channel`), when its link is a Unix socket; else None.
        Give it back with :meth:`give_back_reply_channel` once its answer has been read."""
        link = self._links.get(rank)
        if type(link) is not UnixLink or self._closed:
            return None
        return self._my_channels.take(rank, link.address, my_rank)

    def give_back_reply_channel(self, channel: ReplyChannel) -> None:
        self._my_channels.give_back(channel)

    def existing_link(self, rank: int) -> Link | None:
        """The link to ``rank`` if one is open (never connects)."""
        return self._links.get(rank)

    def on_frame(self, link: Link, raw: bytes) -> None:
        link.last_heard = time.monotonic()
        if link.traffic is not None:
            link.traffic.received += len(raw)
        self._unresponsive.discard(link.peer.rank)
        if raw:  # empty: an answer to a heartbeat
            self._handler.on_frame(link, raw)

    def on_lost(self, link: Link, reason: str) -> None:
        if self._links.get(link.peer.rank) is link:
            del self._links[link.peer.rank]  # the next send reconnects
        link.writer.abort()  # nothing it still holds can arrive
        self._lost.append(link)
        self._my_channels.forget(link.peer.rank)  # (a peer that comes back gets new ones)
        if link.peer.rank in self.peers:
            self._lost_peers[link.peer.rank] = reason
            # What it kept of ours may never come back (a live peer that reconnects may still
            # hold some: dropped, they are never lent again, which is safe).
            self.slots.drop_given(link.peer.rank)
        self._handler.on_lost(link, reason)

    # ------------------------------------------------------------------ shared memory
    def share(self, rank: int, buffers: list[memoryview], lent: list[shm.Slot] | None = None) -> list[str]:
        """Hand the large buffers for a co-located peer to shared memory; names per buffer
        ("" = inline), or [] when everything goes inline.

        Buffers go through reusable slots. With ``lent`` (requests, whose reply tells when the
        callee is done reading) a buffer below ``shm.KEEP_MIN_BYTES`` is lent and its slot
        appended to ``lent``; every other one is given (``+name``): the receiver may keep it
        as the memory of the tensor it rebuilds and hands it back with ``SLOTS_READ`` once
        done (see :meth:`slots_read`).
        """
        if not buffers:
            return []
        threshold = self.shm_threshold_bytes
        if not self.is_colocated(rank) or not any(len(b) >= threshold for b in buffers):
            return []
        names: list[str] = []
        try:
            for buffer in buffers:
                if len(buffer) < threshold:
                    names.append("")
                elif lent is not None and len(buffer) < shm.KEEP_MIN_BYTES:
                    slot = self.slots.lend(rank, buffer.cast("B") if buffer.format != "B" else buffer)
                    lent.append(slot)
                    names.append(slot.name)
                else:
                    slot = self.slots.give(rank, buffer.cast("B") if buffer.format != "B" else buffer)
                    names.append(shm.GIVEN + slot.name)
        except OSError as exc:  # /dev/shm full or gone: send inline
            log.warning("shared-memory handoff failed (%s); sending inline", exc)
            self.slots.returned(rank, (n.removeprefix(shm.GIVEN) for n in names if shm.is_given(n)))
            if lent:
                self.drop_lent(lent)
            return []
        return names

    def slots_read(self, rank: int, names: Iterable[str]) -> None:
        """Peer ``rank``'s ``SLOTS_READ``: it is done with these slots we gave it."""
        self.slots.returned(rank, names)

    def finished_reading(self, rank: int, lent: list[shm.Slot]) -> None:
        """The peer has read the slots ``lent`` to it: they may be lent again."""
        for slot in lent:
            self.slots.give_back(rank, slot)
        lent.clear()

    def drop_lent(self, lent: list[shm.Slot]) -> None:
        """The peer may still read these slots (its reply never came): never reuse them."""
        for slot in lent:
            self.slots.discard(slot)
        lent.clear()

    # ------------------------------------------------------------------ teardown
    async def close(self, graceful: bool) -> None:
        """Close every link and server and remove this worker's shared-memory files."""
        if self._closed:
            return
        self._closed = True
        self._my_channels.close()
        for sock in list(self._channel_readers):  # their threads see the end and stop
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            self._heartbeats = None
        for link in list(self._links.values()):
            await link.close(graceful)
        self._links.clear()
        for link in self._lost:
            await link.close(graceful=False)
        self._lost.clear()
        if self._unix_server is not None:
            self._unix_server.close()
            shm.remove_socket(self.unix_path)
        if self._tcp_server is not None:
            self._tcp_server.close()
        if self._server is not None:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            await self._server.stop(grace=1.0 if graceful else None)
            self._server = None  # its handlers refer back to the sessions' owner
        shm.remove([self.shm_probe])
        self.slots.close()


class _LocalConnection:
    """An incoming Unix-socket connection: a caller's link (handled by an
    :class:`_AnsweringSession`) or, if its first frame opens one, a reply channel, which the
    transport registers (and acknowledges with that same frame) until it closes. A thread of
    the channel's own then reads the requests the caller sends there (see
    :meth:`Transport._serve_channel`)."""

    __slots__ = ("_transport", "_write", "_direct", "_loop_write", "_take_reading", "_inner", "_channel")

    def __init__(
        self,
        transport: Transport,
        write: Write,
        direct: DirectWrite | None,
        loop_write: LoopWrite | None,
        take_reading: TakeReading | None,
    ) -> None:
        self._transport = transport
        self._write, self._direct, self._loop_write = write, direct, loop_write
        self._take_reading = take_reading
        self._inner: _AnsweringSession | None = None
        self._channel: tuple[tuple[int, int], FrameWriter] | None = None

    def on_frame(self, raw: bytes) -> None:
        if self._inner is not None:
            self._inner.on_frame(raw)
            return
        if self._channel is not None:
            raise frames.FrameError("a reply channel's requests are read by its own thread")
        opening = frames.channel_opening(raw)
        if opening is None:
            self._inner = _AnsweringSession(
                self._transport._make_session, self._write, self._direct, self._loop_write
            )
            self._inner.on_frame(raw)
            return
        writer = FrameWriter(self._write, "reply-channel", self._direct)
        writer.loop_write = self._loop_write
        self._channel = (opening, writer)
        self._transport._reply_channels[opening] = writer
        taken = None
        if self._take_reading is not None and self._transport._make_channel_session is not None:
            taken = self._take_reading()
        caller_rank, channel_id = opening
        ack = frames.encode_control(channel_id, frames.REPLY_CHANNEL, caller_rank, taken is not None)
        writer.send(iter([ack]))
        if taken is not None:
            self._transport._serve_channel(caller_rank, writer, taken)

    async def finish(self) -> None:
        if self._inner is not None:
            await self._inner.finish()
        elif self._channel is not None:
            self._forget_channel()
            await self._channel[1].close()

    def cleanup(self) -> None:
        if self._inner is not None:
            self._inner.cleanup()
        elif self._channel is not None:
            self._forget_channel()
            self._channel[1].abort()

    def _forget_channel(self) -> None:
        assert self._channel is not None
        key, writer = self._channel
        if self._transport._reply_channels.get(key) is writer:
            del self._transport._reply_channels[key]


class _AnsweringSession:
    """The transport's side of an incoming connection: answers heartbeats, hands every other
    frame to the user's session. Both write through the same :class:`FrameWriter`.

    On a network carrier it is ``watched`` (a set the transport's heartbeats look through):
    it counts its frames, and tells ``heard(rank, now)`` of each heartbeat once the user's
    session knows its peer's rank (its ``caller_rank``, -1 until then)."""

    __slots__ = ("frames", "frames_noted", "heard", "session", "watched", "writer")

    def __init__(
        self,
        make_session: SessionFactory,
        write: Write,
        direct: DirectWrite | None,
        loop_write: LoopWrite | None,
        heard: Callable[[int, float], None] | None = None,
        watched: set[_AnsweringSession] | None = None,
    ) -> None:
        self.writer = FrameWriter(write, "inbound", direct)
        self.writer.loop_write = loop_write
        self.session = make_session(self.writer)
        self.heard = heard
        self.frames = self.frames_noted = 0
        self.watched = watched
        if watched is not None:
            watched.add(self)

    def on_frame(self, raw: bytes) -> None:
        self.frames += 1
        if raw:
            self.session.on_frame(raw)
            return
        self.writer.send_heartbeat()
        if self.heard is not None:
            rank = self.peer_rank
            if rank >= 0:
                self.heard(rank, time.monotonic())

    @property
    def peer_rank(self) -> int:
        """The peer's rank as the user's session knows it (-1 until then, or if it cannot)."""
        return getattr(self.session, "caller_rank", -1)

    async def finish(self) -> None:
        await self.session.finish()

    def cleanup(self) -> None:
        if self.watched is not None:
            self.watched.discard(self)
        self.session.cleanup()
