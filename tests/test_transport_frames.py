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


def test_aligned_padding_is_plain_protobuf() -> None:
    data = memoryview(np.arange(100_000, dtype=np.uint8))
    for offset in range(0, 130):
        (entry,) = frames.encode_message(9, frames.REQUEST, b"p", [data])
        entry = frames.align_data(entry, offset)
        assert (offset + sum(len(p) for p in entry[:3])) % frames.DATA_ALIGNMENT == 0
        parsed = agent_pb2.Frame.FromString(b"".join(entry)).envelopes[0]
        assert parsed.call_id == 9 and parsed.payload == b"p" and parsed.data == bytes(data)
