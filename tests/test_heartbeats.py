"""Heartbeats between two transports in one process, over gRPC: a pair linked both ways beats
one way (each heartbeat costs an idle worker a dozen wake-ups of gRPC's threads), and the
side that stays quiet still gives up on a peer that stops answering, within the bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from rpcdist.transport import writer
from rpcdist.transport.api import Link, PeerAddress
from rpcdist.transport.endpoint import Transport

HOST = "127.0.0.1"
INTERVAL = 0.25
MISSES = 3


class _Session:
    """An incoming connection's session: a frame names the caller's rank, and is answered
    (so a busy link hears from its peer, as a link with calls in flight does)."""

    def __init__(self, out: writer.FrameWriter) -> None:
        self.caller_rank = -1
        self.out = out

    def on_frame(self, raw: bytes) -> None:
        self.caller_rank = int(bytes(raw[:1]))
        self.out.send(iter([[b"answer"]]))

    async def finish(self) -> None:
        pass

    def cleanup(self) -> None:
        pass


class _Handler:
    """The caller side: what came back on outgoing links, and which links were lost."""

    def __init__(self) -> None:
        self.lost: dict[str, tuple[float, str]] = {}

    def on_frame(self, link: Link, raw: bytes) -> None:
        pass

    def on_lost(self, link: Link, reason: str) -> None:
        self.lost[link.peer.name] = (time.monotonic(), reason)


async def _pair() -> tuple[list[Transport], list[_Handler]]:
    handlers = [_Handler(), _Handler()]
    transports = [
        Transport(
            f"w{rank}",
            handlers[rank],
            _Session,
            shm_threshold_bytes=0,
            unix_sockets=False,
            heartbeat_interval=INTERVAL,
            heartbeat_misses=MISSES,
        )
        for rank in range(2)
    ]
    ports = [await t.start(HOST) for t in transports]
    peers = [PeerAddress(rank, f"w{rank}", f"{HOST}:{ports[rank]}") for rank in range(2)]
    for t in transports:
        t.set_peers(peers)
    for rank, t in enumerate(transports):  # each links to the other and says who it is
        t.link(1 - rank).send(iter([[str(rank).encode()]]))
    return transports, handlers


async def test_a_pair_linked_both_ways_beats_one_way_and_the_quiet_side_still_finds_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    beats: dict[str, int] = {}  # heartbeats each worker sent on its own link (not answers)
    send_heartbeat = writer.FrameWriter.send_heartbeat

    def counted(self: writer.FrameWriter) -> None:
        to = self._task.get_name().removeprefix("rpcdist-writer-")  # a peer's name, or "inbound"
        if to != "inbound":
            beats[to] = beats.get(to, 0) + 1
        send_heartbeat(self)

    monkeypatch.setattr(writer.FrameWriter, "send_heartbeat", counted)
    transports, handlers = await _pair()
    try:
        await asyncio.sleep(16 * INTERVAL)
        assert not any(h.lost for h in handlers), [h.lost for h in handlers]
        # Both ways would be about 8 each (a link beats every interval or two). One way: w0
        # (its name sorts first) beats w1; w1's link to w0 waits, refreshed by w0's heartbeats.
        assert beats.get("w1", 0) >= 4, beats
        # (a beat before w0's first one arrived, or one a loaded machine's late tick allows)
        assert beats.get("w0", 0) <= 2, beats

        # After traffic both ways (no heartbeats while links hear answers), the quiet side
        # does not start beating either: w0's calls on its connection counted as hearing it.
        # (Counting heartbeats alone, w1 beats once after each spell of traffic.)
        beats.clear()
        for _ in range(3):
            for _ in range(8):
                for rank, t in enumerate(transports):
                    t.link(1 - rank).send(iter([[str(rank).encode()]]))
                await asyncio.sleep(INTERVAL / 2)
            await asyncio.sleep(4 * INTERVAL)
        assert not any(h.lost for h in handlers), [h.lost for h in handlers]
        assert beats.get("w1", 0) >= 3 and beats.get("w0", 0) <= 1, beats

        # The beating side hangs: it neither beats nor answers, and its connections stay
        # open. The quiet side must give up on it within the bound, as if it beat itself.
        beating, quiet = 0, 1
        hung = transports[beating]
        assert hung._heartbeats is not None
        hung._heartbeats.cancel()
        monkeypatch.setattr("rpcdist.transport.endpoint._AnsweringSession.on_frame", lambda self, raw: None)
        hung_at = time.monotonic()
        deadline = hung_at + INTERVAL * (MISSES + 1) + 4 * INTERVAL
        while f"w{beating}" not in handlers[quiet].lost and time.monotonic() < deadline:
            await asyncio.sleep(INTERVAL / 5)
        assert f"w{beating}" in handlers[quiet].lost, "the quiet side never gave up on the hung peer"
        lost_at, reason = handlers[quiet].lost[f"w{beating}"]
        assert "no answer to heartbeats" in reason, reason
        assert lost_at - hung_at <= INTERVAL * (MISSES + 1) + 2 * INTERVAL
    finally:
        for t in transports:
            await t.close(graceful=False)
