"""The transport's framing, in one process: frames cut anywhere by the socket come out whole,
big data lands aligned and is kept in place as tensor memory, and the gRPC framing is the same
protobuf any client can read."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import torch

from rpcdist import serialization
from rpcdist.errors import PayloadTooLargeError
from rpcdist.transport import frames
from rpcdist.transport.unix_link import _FramedProtocol
from rpcdist.transport.writer import MAX_FRAME_BYTES
from rpcdist.v1 import agent_pb2


def _message(call_id: int, tensor: torch.Tensor) -> list[bytes | memoryview]:
    payload, buffers = serialization.dumps(tensor)
    return [p for entry in frames.encode_message(call_id, frames.REQUEST, payload, buffers) for p in entry]


def _protocol(received: list[Any]) -> _FramedProtocol:
    """A receiving protocol (made on a loop, as it needs one) that collects its frames."""

    async def make() -> _FramedProtocol:
        return _FramedProtocol(received.append, lambda: None)

    return asyncio.run(make())


def _feed(protocol: _FramedProtocol, stream: bytes, rng: random.Random) -> None:
    """Deliver ``stream`` the way a socket might: in reads of any size the buffer allows."""
    pos = 0
    while pos < len(stream):
        target = protocol.get_buffer(-1)
        n = min(len(target), len(stream) - pos, rng.choice([1, 7, 100, 4096, 65536, 300_000]))
        target[:n] = stream[pos : pos + n]
        protocol.buffer_updated(n)
        pos += n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_cut_anywhere_come_out_whole_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    sent = []
    for _ in range(60):
        size = rng.choice([0, 5, 1000, 70_000, 300_000, 1_500_000])
        sent.append(bytes(rng.getrandbits(8) for _ in range(min(size, 64))) * (size // 64 or 1))
        sent[-1] = sent[-1][:size]
    stream = b"".join(len(f).to_bytes(8, "little") + f for f in sent)
    received: list[Any] = []
    _feed(_protocol(received), stream, rng)
    assert [bytes(f) for f in received] == sent


def test_a_big_tensor_is_kept_in_the_frame_it_arrived_in() -> None:
    """The writer aligns big data in its frame; the receiver reads the frame into aligned
    memory and rebuilds the tensor over it: no copy after the socket's own."""
    tensor = torch.arange(300_000, dtype=torch.float32)
    for lead in (0, 1, 13, 64):  # other small messages ahead of it in the same frame
        entries = [
            frames.align_data(e, 0) for e in frames.encode_message(1, frames.RESPONSE, b"x" * lead, [])
        ]
        offset = sum(len(p) for e in entries for p in e)
        payload, buffers = serialization.dumps(tensor)
        for entry in frames.encode_message(
            2, frames.RESPONSE, payload, buffers, chunk_bytes=MAX_FRAME_BYTES * 2
        ):
            entry = frames.align_data(entry, offset)
            entries.append(entry)
            offset += sum(len(p) for p in entry)
        frame = b"".join(p for e in entries for p in e)
        received: list[Any] = []
        _feed(_protocol(received), len(frame).to_bytes(8, "little") + frame, random.Random(lead))
        (raw,) = received
        assemblies: dict[int, frames.Assembly] = {}
        done = [frames.collect(assemblies, env, 1 << 30) for env in frames.decode_frame(raw)]
        header, bufs = done[-1]
        rebuilt = serialization.loads(header.payload, bufs)
        assert torch.equal(rebuilt, tensor)
        frame_start = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        assert frame_start <= rebuilt.data_ptr() < frame_start + len(raw), "the tensor was copied"
        assert rebuilt.data_ptr() % frames.DATA_ALIGNMENT == 0
        rebuilt += 1  # its memory is writable, and its own
        assert torch.equal(rebuilt, tensor + 1)


def test_read_only_frames_are_copied_out() -> None:
    """gRPC hands frames over as bytes: the tensor must get writable memory of its own."""
    tensor = torch.ones(100_000)
    frame = b"".join(_message(3, tensor))
    assemblies: dict[int, frames.Assembly] = {}
    (env,) = frames.decode_frame(frame)
    header, bufs = frames.collect(assemblies, env, 1 << 30)  # type: ignore[misc]
    rebuilt = serialization.loads(header.payload, bufs)
    rebuilt.mul_(3)
    assert torch.equal(rebuilt, tensor * 3)


def test_a_small_message_gets_memory_of_its_own_and_keeps_the_size_limit() -> None:
    """A small tensor arriving whole in its header is rebuilt over writable memory that is not
    the frame's; one above the receiver's max_payload_bytes is refused all the same."""
    tensor = torch.arange(320.0).view(32, 10)
    frame = b"".join(_message(4, tensor))
    (env,) = frames.decode_frame(frame)
    header, bufs = frames.collect({}, env, 1 << 30)  # type: ignore[misc]
    rebuilt = serialization.loads(header.payload, bufs)
    rebuilt.mul_(2)
    assert torch.equal(rebuilt, tensor * 2)
    assert torch.equal(serialization.loads(header.payload, frames.collect({}, env, 1 << 30)[1]), tensor)  # type: ignore[index, arg-type]
    _, refused = frames.collect({}, env, 1000)  # type: ignore[misc]
    assert isinstance(refused, PayloadTooLargeError), refused


def test_aligned_padding_is_plain_protobuf() -> None:
    data = memoryview(np.arange(100_000, dtype=np.uint8))
    for offset in range(0, 130):
        (entry,) = frames.encode_message(9, frames.REQUEST, b"p", [data])
        entry = frames.align_data(entry, offset)
        assert (offset + sum(len(p) for p in entry[:3])) % frames.DATA_ALIGNMENT == 0
        parsed = agent_pb2.Frame.FromString(b"".join(entry)).envelopes[0]
        assert parsed.call_id == 9 and parsed.payload == b"p" and parsed.data == bytes(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_messages_written_from_threads_arrive_whole(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads writing messages themselves (FrameWriter.write_now) while the loop writes
    others, on a socket with tiny buffers so that direct writes are cut short: every message
    arrives whole, exactly once, and each thread's messages keep their order."""
    import socket
    import threading

    from rpcdist._runtime import new_event_loop
    from rpcdist.transport.writer import FrameWriter

    if loop_kind == "uvloop":
        pytest.importorskip("uvloop")
    else:
        monkeypatch.setenv("RPCDIST_LOOP", "asyncio")
    loop = new_event_loop()
    threads, per_thread = 4, 150
    expected = (threads + 1) * per_thread
    received: list[Any] = []
    all_in = asyncio.Event()
    cut_short = 0

    def on_frame(raw: bytes | memoryview) -> None:
        received.extend((env.call_id, bytes(env.payload)) for env in frames.decode_frame(bytes(raw)))
        if len(received) >= expected:
            all_in.set()

    def message(source: int, seq: int) -> list[list[bytes | memoryview]]:
        size = random.Random(source * 100_000 + seq).randrange(16, 60_000)
        return list(frames.encode_message(source * 1000 + seq, frames.REQUEST, bytes([seq % 251]) * size, []))

    async def run() -> None:
        nonlocal cut_short
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        _, sender = await loop.connect_accepted_socket(
            lambda: _FramedProtocol(lambda _: None, lambda: None), a
        )
        receiver_transport, _ = await loop.connect_accepted_socket(
            lambda: _FramedProtocol(on_frame, lambda: None), b
        )
        flush = sender._flush_remainder

        def counting_flush() -> None:
            nonlocal cut_short
            cut_short += sender._remainder is not None
            flush()

        sender._flush_remainder = counting_flush  # type: ignore[method-assign]
        writer = FrameWriter(sender.write, "test", direct=sender.try_write)

        def produce(source: int) -> None:
            for seq in range(per_thread):
                entries = message(source, seq)
                if not writer.write_now(entries):
                    # Queued on the loop; the next one waits until it is, as an agent's caller
                    # keeps its order (write_now refuses while anything is queued).
                    queued = threading.Event()
                    loop.call_soon_threadsafe(lambda e=entries, q=queued: (writer.send(iter(e)), q.set()))
                    assert queued.wait(10)

        workers = [threading.Thread(target=produce, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for seq in range(per_thread):  # the loop's own messages meanwhile
            writer.send(iter(message(threads, seq)))
            await asyncio.sleep(0)
        await asyncio.wait_for(all_in.wait(), 60)
        for worker in workers:
            worker.join(10)
        await writer.close()
        sender.transport.close()
        receiver_transport.close()

    loop.run_until_complete(run())
    loop.close()
    assert len(received) == expected
    seen: dict[int, list[int]] = {}
    for call_id, payload in received:
        source, seq = divmod(call_id, 1000)
        size = random.Random(source * 100_000 + seq).randrange(16, 60_000)
        assert payload == bytes([seq % 251]) * size, f"message {source}:{seq} arrived cut or mixed"
        seen.setdefault(source, []).append(seq)
    for source in range(threads):
        assert seen[source] == list(range(per_thread)), f"thread {source}'s order: {seen[source][:20]}..."
    assert sorted(seen[threads]) == list(range(per_thread))
    assert cut_short > 0, "no direct write was cut short: the test did not exercise the socket's limit"


@pytest.mark.timeout(60)
def test_writer_reports_a_message_written_only_once_its_last_frame_is() -> None:
    """FrameWriter.send(written=...): the callback says True only after the frame holding the
    message's last byte was written (a big message takes several frames, interleaved with
    small ones), and False for what a failed or aborted writer never wrote. A collective's
    notices wait on it, so that a rank may exit right after its last collective."""
    from rpcdist.transport.writer import FrameWriter

    big = [[b"x" * (MAX_FRAME_BYTES // 2)] for _ in range(5)]  # 2.5 frames' worth

    async def run() -> None:
        written_bytes = 0
        reports: list[tuple[str, bool, int]] = []
        gate = asyncio.Event()

        async def write(frame: list[bytes | memoryview]) -> None:
            nonlocal written_bytes
            await gate.wait()  # nothing is written until the test lets it
            written_bytes += sum(len(p) for p in frame)

        writer = FrameWriter(write, "test")
        writer.send(iter(big), lambda ok: reports.append(("big", ok, written_bytes)))
        writer.send(iter([[b"s" * 100]]), lambda ok: reports.append(("small", ok, written_bytes)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert reports == [], "reported written before anything was written"
        gate.set()
        await writer.close()
        total = 5 * (MAX_FRAME_BYTES // 2) + 100
        assert written_bytes == total
        by_name = {name: (ok, at) for name, ok, at in reports}
        assert by_name["big"] == (True, total), reports  # its last piece went in the last frame
        ok, at = by_name["small"]
        assert ok and 100 <= at < total, reports  # between the big one's frames

        # A write that fails: what it held, and what was queued behind it, is reported unwritten.
        async def broken(frame: list[bytes | memoryview]) -> None:
            raise OSError("connection reset")

        failing = FrameWriter(broken, "broken")
        outcome: list[bool] = []
        failing.send(iter([[b"a"]]), outcome.append)
        failing.send(iter([[b"b"]]), outcome.append)
        await failing.close()
        assert outcome == [False, False]

        # Aborted before it ever ran: still reported, so nobody waits for it forever.
        stuck = FrameWriter(write, "aborted")
        gate.clear()
        outcome = []
        stuck.send(iter([[b"c"]]), outcome.append)
        stuck.abort()
        assert outcome == [False]
        await asyncio.wait([stuck._task])
        assert outcome == [False], "reported twice"

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_a_loop_turns_messages_go_out_at_once_in_one_write() -> None:
    """On a carrier that writes at once on the loop (a socket), what the loop queues during one
    turn leaves right after it, in one write, without the writer task; what the carrier cannot
    take at once (paused) and what does not fit one frame goes through the task, in order."""
    from rpcdist.transport.writer import FrameWriter

    async def run() -> None:
        writes: list[tuple[str, bytes]] = []
        accepting = True

        async def task_write(frame: list[bytes | memoryview]) -> None:
            writes.append(("task", b"".join(bytes(p) for p in frame)))

        def loop_write(frame: list[bytes | memoryview]) -> bool:
            if not accepting:
                return False
            writes.append(("loop", b"".join(bytes(p) for p in frame)))
            return True

        writer = FrameWriter(task_write, "test")
        writer.loop_write = loop_write
        await asyncio.sleep(0)  # the writer task is waiting for work
        written: list[bool] = []
        for name in (b"a", b"b", b"c"):
            writer.send(iter([[name * 10]]), written.append)
        await asyncio.sleep(0)
        assert writes == [("loop", b"a" * 10 + b"b" * 10 + b"c" * 10)]
        assert written == [True, True, True]

        # Paused: the frame taken goes out through the task first, then what followed it.
        writes.clear()
        accepting = False
        writer.send(iter([[b"d" * 10]]), written.append)
        await asyncio.sleep(0)
        writer.send(iter([[b"e" * 10]]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert [w for w in writes if w[0] == "loop"] == []
        assert b"".join(data for _, data in writes) == b"d" * 10 + b"e" * 10
        assert written[-1] is True

        # More than a frame: the first at once, the rest through the task.
        writes.clear()
        accepting = True
        big = b"x" * (MAX_FRAME_BYTES + 100)
        writer.send(iter([[big[:MAX_FRAME_BYTES]], [big[MAX_FRAME_BYTES:]]]))
        writer.send(iter([[b"f"]]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert writes[0] == ("loop", big[:MAX_FRAME_BYTES])
        rest = writes[1:]
        assert rest and all(kind == "task" for kind, _ in rest)
        # (the small message may overtake the big one's last chunk: a big one yields its turn)
        assert sorted(b"".join(data for _, data in rest)) == sorted(big[MAX_FRAME_BYTES:] + b"f")
        await writer.close()

    asyncio.run(run())


@pytest.mark.parametrize("rank", [0, 3])
def test_every_header_field_reads_back_as_sent_or_as_its_default(rank: int) -> None:
    """The encoder names only the fields that differ from their defaults (a response has no
    function, timeout or rank): each one still reads back as it was sent."""
    buffer = memoryview(bytearray(b"tensor bytes"))
    raw = b"".join(
        piece
        for entry in [
            *frames.encode_message(5, frames.RESPONSE, b"result", []),
            *frames.encode_message(
                6, frames.REQUEST, b"call", [buffer], timeout_seconds=2.5, function="mod.f", caller_rank=rank
            ),
            *frames.encode_message(7, frames.REQUEST, b"", [], shared=()),
        ]
        for piece in entry
    )
    got = [
        (
            e.call_id,
            e.kind,
            bytes(e.payload),
            list(e.buffer_sizes),
            e.timeout_seconds,
            e.function,
            e.caller_rank,
        )
        for e in frames.decode_frame(raw)
    ]
    assert got == [
        (5, frames.RESPONSE, b"result", [], 0.0, "", 0),
        (6, frames.REQUEST, b"call", [len(buffer)], 2.5, "mod.f", rank),
        (7, frames.REQUEST, b"", [], 0.0, "", 0),
    ]
