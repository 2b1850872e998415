"""Frames on the Exchange stream: encoding and decoding of ``rpcdist.v1.Frame``.

The bytes are exactly the protobuf encoding of ``Frame``/``Envelope`` (protos/rpcdist/v1/
agent.proto), but built and read here by hand so that tensor bytes are copied once into the
outgoing message and read back as zero-copy slices of the incoming one (protobuf's own
Python classes would copy every ``bytes`` field again on both sides).

A message whose buffers exceed one chunk goes out as a header envelope followed by CHUNK
envelopes; :class:`Assembly` puts the buffers back together on the receiving side and
:func:`collect` feeds it envelope by envelope.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from rpcdist.errors import PayloadTooLargeError
from rpcdist.transport import shm, warm
from rpcdist.v1 import agent_pb2

REQUEST = agent_pb2.REQUEST
RESPONSE = agent_pb2.RESPONSE
ERROR = agent_pb2.ERROR
CANCEL = agent_pb2.CANCEL
CHUNK = agent_pb2.CHUNK
NOTIFY = agent_pb2.NOTIFY
SLOTS_READ = agent_pb2.SLOTS_READ
REPLY_CHANNEL = agent_pb2.REPLY_CHANNEL
LINK_OPENING = agent_pb2.LINK_OPENING

DEFAULT_CHUNK_BYTES = 1 << 20

_FRAME_ENVELOPE_TAG = b"\x0a"  # Frame.envelopes: field 1, length-delimited
_DATA_TAG = b"\x2a"  # Envelope.data: field 5, length-delimited
_unpack_double = struct.Struct("<d").unpack_from


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


DATA_ALIGNMENT = 64
"""Where a big envelope's data starts in its frame (a multiple of this), so that a receiver
whose frame buffer is aligned can keep the data as tensor memory without copying it."""
ALIGNED_DATA_BYTES = 64 << 10
_PADDING_TAG = b"\x7a"  # Envelope field 15, length-delimited: unknown to readers, skipped


def align_data(entry: list[bytes | memoryview], offset: int) -> list[bytes | memoryview]:
    """``entry`` (from :func:`encode_message`), padded so that its data starts at a multiple
    of :data:`DATA_ALIGNMENT` when the entry is placed at ``offset`` in its frame."""
    if len(entry) != 4 or len(entry[3]) < ALIGNED_DATA_BYTES:
        return entry
    _, header, data_prefix, data = entry
    body = len(header) + len(data_prefix) + len(data)
    for pad in (0, *range(2, 130)):  # a padding field takes 2..129 bytes: tag, length, zeros
        prefix = _FRAME_ENVELOPE_TAG + _varint(body + pad)
        if (offset + len(prefix) + len(header) + pad + len(data_prefix)) % DATA_ALIGNMENT == 0:
            padding = _PADDING_TAG + bytes([pad - 2]) + bytes(pad - 2) if pad else b""
            return [prefix, header + padding, data_prefix, data]
    return entry  # unreachable: 128 consecutive sizes cover every remainder


def _envelope_entry(header: bytes, data: memoryview | bytes) -> list[bytes | memoryview]:
    """The pieces of one ``Frame.envelopes`` entry: header fields plus the ``data`` field."""
    body_len = len(header)
    pieces: list[bytes | memoryview] = [b"", header]
    if len(data):
        data_prefix = _DATA_TAG + _varint(len(data))
        body_len += len(data_prefix) + len(data)
        pieces += [data_prefix, data]
    pieces[0] = _FRAME_ENVELOPE_TAG + _varint(body_len)
    return pieces


@dataclass(slots=True)
class Envelope:
    """One decoded envelope; ``data`` is a zero-copy slice of the received frame."""

    call_id: int = 0
    kind: int = 0
    payload: bytes | memoryview = b""
    buffer_sizes: list[int] = field(default_factory=list)
    data: memoryview | bytes = b""
    timeout_seconds: float = 0.0
    function: str = ""
    caller_rank: int = 0
    shared_buffers: list[str] = field(default_factory=list)
    reply_channel: int = 0
    link_token: int = 0
    link_envelopes: int = 0
    with_value: bool = False


class FrameError(ValueError):
    """The bytes are not a well-formed Frame."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise FrameError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise FrameError("varint too long")


_SMALL_FRAME_BYTES = 64 << 10


def decode_frame(raw: bytes) -> Sequence[Envelope]:
    """Parse a Frame; raises :class:`FrameError` on malformed or truncated input.

    Small frames go through protobuf's C parser (fast, and the copies are tiny); large ones
    through the zero-copy reader below. Both give objects with the same fields.
    """
    if len(raw) < _SMALL_FRAME_BYTES:
        try:
            # (a slice is a list: iterating the repeated field itself ends in an IndexError
            # whose message is formatted, a measurable share of a small call)
            return agent_pb2.Frame.FromString(raw).envelopes[:]  # type: ignore[return-value]
        except DecodeError as exc:
            raise FrameError(f"cannot parse frame: {exc}") from None
    buf = memoryview(raw)
    end = len(buf)
    pos = 0
    envelopes = []
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        if key != 0x0A:
            raise FrameError(f"unexpected Frame field key {key}")
        length, pos = _read_varint(buf, pos, end)
        if pos + length > end:
            raise FrameError("truncated envelope")
        envelopes.append(_decode_envelope(buf, pos, pos + length))
        pos += length
    return envelopes


def _decode_envelope(buf: memoryview, pos: int, end: int) -> Envelope:
    env = Envelope()
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos, end)
            if number == 1:
                env.call_id = value
            elif number == 2:
                env.kind = value
            elif number == 8:
                env.caller_rank = value if value < 1 << 31 else value - (1 << 64)
            elif number == 4:
                env.buffer_sizes.append(value)
            elif number == 10:
                env.reply_channel = value
            elif number == 11:
                env.link_token = value
            elif number == 12:
                env.link_envelopes = value
            elif number == 13:
                env.with_value = bool(value)
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise FrameError("truncated field")
            if number == 3:
                env.payload = buf[pos:stop]
            elif number == 5:
                env.data = buf[pos:stop]
            elif number == 4:
                while pos < stop:
                    value, pos = _read_varint(buf, pos, stop)
                    env.buffer_sizes.append(value)
            elif number == 7:
                env.function = bytes(buf[pos:stop]).decode("utf-8", "replace")
            elif number == 9:
                env.shared_buffers.append(bytes(buf[pos:stop]).decode("utf-8", "replace"))
            pos = stop
        elif wire_type == 1:
            if pos + 8 > end:
                raise FrameError("truncated fixed64")
            if number == 6:
                env.timeout_seconds = _unpack_double(buf, pos)[0]
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise FrameError(f"unsupported wire type {wire_type}")
    if pos != end:
        raise FrameError("envelope overruns its length")
    return env


def encode_message(
    call_id: int,
    kind: int,
    payload: bytes,
    buffers: Sequence[memoryview],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_seconds: float = 0.0,
    function: str = "",
    caller_rank: int = 0,
    shared: Sequence[str] = (),
    reply_channel: int = 0,
    link_token: int = 0,
    link_envelopes: int = 0,
    with_value: bool = False,
) -> Iterator[list[bytes | memoryview]]:
    """Yield the envelope entries of one message: a header, then CHUNKs of its buffer bytes.

    ``shared`` names, per buffer, the shared-memory file already holding it ("" = inline).
    ``reply_channel``: a request's, the channel its answer goes to (0: the caller's link).
    ``link_token``, ``link_envelopes``: a request sent on that channel, the caller's link and
    how many envelopes it had written there before (see ``Envelope`` in agent.proto).
    ``with_value``: a request's, the caller wants the value the call makes in the answer.
    Entries are made lazily, so a 1 GiB tensor is never copied whole into a queue.
    """
    sizes = [len(b) for b in buffers]
    any_shared = any(shared)
    if any_shared:
        buffers = [b for b, name in zip(buffers, shared, strict=True) if not name]
    # The fields most messages leave at their defaults are given only when set: each one
    # given costs the constructor as much as setting it (a response names no function,
    # timeout or rank), and the bytes are the same either way.
    fields: dict[str, Any] = {"call_id": call_id, "kind": kind, "payload": payload}
    if sizes:
        fields["buffer_sizes"] = sizes
    if timeout_seconds:
        fields["timeout_seconds"] = timeout_seconds
    if function:
        fields["function"] = function
    if caller_rank:
        fields["caller_rank"] = caller_rank
    if any_shared:
        fields["shared_buffers"] = shared
    if reply_channel:
        fields["reply_channel"] = reply_channel
    if link_token:
        fields["link_token"] = link_token
        fields["link_envelopes"] = link_envelopes
    if with_value:
        fields["with_value"] = True
    header = agent_pb2.Envelope(**fields).SerializeToString()
    total = sum(len(b) for b in buffers)
    if total <= chunk_bytes:
        data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
        yield _envelope_entry(header, data)
        return
    yield _envelope_entry(header, b"")
    chunk_header = agent_pb2.Envelope(call_id=call_id, kind=CHUNK).SerializeToString()
    for buffer in buffers:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        for start in range(0, len(view), chunk_bytes):
            yield _envelope_entry(chunk_header, view[start : start + chunk_bytes])


def encode_control(
    call_id: int, kind: int, caller_rank: int = 0, takes_requests: bool = False
) -> list[bytes | memoryview]:
    """A bodiless envelope entry (e.g. CANCEL, REPLY_CHANNEL with its caller's rank, or
    LINK_OPENING with its link's token as ``call_id``). ``takes_requests``: a callee's
    acknowledgement of a reply channel that it reads requests on too."""
    fields: dict[str, int] = {"call_id": call_id, "kind": kind}
    if caller_rank:
        fields["caller_rank"] = caller_rank
    if takes_requests:
        fields["reply_channel"] = 1
    return _envelope_entry(agent_pb2.Envelope(**fields).SerializeToString(), b"")


def channel_opening(raw: bytes | memoryview) -> tuple[int, int] | None:
    """``(caller_rank, channel id)`` if ``raw`` is the frame that opens a reply channel (or
    acknowledges it: see :func:`takes_requests`)."""
    if len(raw) > 64:  # (an opening is a few bytes: a call's frame is never mistaken for one)
        return None
    try:
        envelopes = agent_pb2.Frame.FromString(bytes(raw)).envelopes
    except DecodeError:
        return None
    if len(envelopes) != 1 or envelopes[0].kind != REPLY_CHANNEL:
        return None
    return envelopes[0].caller_rank, envelopes[0].call_id


def takes_requests(ack: bytes | memoryview) -> bool:
    """Whether a reply channel's acknowledgement says the callee reads requests on it too."""
    return agent_pb2.Frame.FromString(bytes(ack)).envelopes[0].reply_channel == 1


def _in_place(data: memoryview | bytes, sizes: list[int]) -> list[memoryview] | None:
    """The buffers of ``sizes`` as slices of ``data`` itself, when its memory can be kept as
    tensor memory: writable, aligned, all of the message's inline bytes, and most of its frame
    (a tensor keeps the whole frame alive). None: copy them out."""
    if (
        type(data) is not memoryview
        or data.readonly
        or len(data) < ALIGNED_DATA_BYTES
        or len(data) != sum(sizes)
        or 2 * len(data) < memoryview(data.obj).nbytes
    ):
        return None
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data
    views = []
    offset = 0
    for size in sizes:
        if size and (address + offset) % DATA_ALIGNMENT:
            return None
        views.append(data[offset : offset + size])
        offset += size
    return views


def _fresh_buffer(size: int) -> memoryview:
    """Writable memory of its own for a received buffer. Small ones are a bytearray's (16-byte
    aligned by the allocator, enough for every dtype; 0.2 µs to make, a tensor's 1.7 µs); large
    ones come warm from :mod:`rpcdist.transport.warm`."""
    if size < _SMALL_FRAME_BYTES:
        return memoryview(bytearray(size))
    return warm.receive_buffer(size)


class Assembly:
    """Collects a message's buffers from its header envelope and following CHUNKs.

    Buffers are allocated as fresh tensors' memory (or adopted from shared memory), so rebuilt
    tensors own writable memory. A shared buffer that cannot be adopted leaves ``error`` set;
    the inline bytes are still consumed so the stream stays in step.
    """

    __slots__ = ("header", "buffers", "_views", "_index", "_offset", "remaining", "error")

    def __init__(
        self,
        header: Envelope,
        max_bytes: int | None = None,
        release_slot: Callable[[str], None] | None = None,
    ) -> None:
        self.header = header
        self.buffers: list[memoryview] = []
        self._views: list[memoryview] = []
        self.error: Exception | None = None
        shared = list(header.shared_buffers) or [""] * len(header.buffer_sizes)
        if len(shared) != len(header.buffer_sizes):
            raise FrameError("shared_buffers and buffer_sizes differ in length")
        total = sum(header.buffer_sizes) + len(header.payload)
        if max_bytes is not None and total > max_bytes:
            # Too big to accept: consume (and drop) its inline bytes to stay in step.
            self.error = PayloadTooLargeError(
                f"message of {total} bytes is above this worker's max_payload_bytes={max_bytes}"
            )
            _release_given(shared, release_slot)
            self._index = 0
            self._offset = 0
            self.remaining = sum(n for n, name in zip(header.buffer_sizes, shared, strict=True) if not name)
            self._views = []
            if header.data:
                self.feed(header.data)
            return
        inline_sizes = [n for n, name in zip(header.buffer_sizes, shared, strict=True) if not name]
        in_place = _in_place(header.data, inline_sizes)
        for size, name in zip(header.buffer_sizes, shared, strict=True):
            if name:
                slot = name.removeprefix(shm.GIVEN)
                # A given slot goes back through ``release_slot``; a lent one with the reply.
                release = release_slot if shm.is_given(name) else None
                try:
                    if release is not None and size >= shm.KEEP_MIN_BYTES:  # ours until freed: no copy
                        self.buffers.append(shm.borrowings.keep(slot, size, release))
                    else:
                        self.buffers.append(shm.borrowings.copy(slot, size))
                        if release is not None:
                            release(slot)
                except (OSError, ValueError) as exc:
                    self.error = exc
                    self.buffers.append(memoryview(bytearray()))
                    if release is not None:
                        release(slot)
            elif in_place is not None:
                self.buffers.append(in_place.pop(0))
            else:
                view = _fresh_buffer(size)
                self.buffers.append(view)
                self._views.append(view)
        self._index = 0
        self._offset = 0
        self.remaining = sum(len(v) for v in self._views)
        if header.data and in_place is None:
            self.feed(header.data)

    def feed(self, data: memoryview | bytes) -> None:
        """Copy the next ``data`` bytes into place; raises FrameError on overflow."""
        if len(data) > self.remaining:
            raise FrameError("message carries more bytes than its header announced")
        if self.error is not None and not self._views:  # refused: count, don't keep
            self.remaining -= len(data)
            return
        pos = 0
        while pos < len(data):
            while self._offset == len(self._views[self._index]):
                self._index += 1
                self._offset = 0
            target = self._views[self._index]
            n = min(len(target) - self._offset, len(data) - pos)
            target[self._offset : self._offset + n] = data[pos : pos + n]
            self._offset += n
            pos += n
        self.remaining -= len(data)

    @property
    def complete(self) -> bool:
        return self.remaining == 0


def _release_given(shared: Sequence[str], release_slot: Callable[[str], None] | None) -> None:
    if release_slot is not None:
        for name in shared:
            if shm.is_given(name):
                release_slot(name.removeprefix(shm.GIVEN))


def slots_read_names(env: Any) -> list[str]:
    """The slot names a ``SLOTS_READ`` envelope carries."""
    return [name for name in env.payload.decode().split("\n") if name]


class SlotsReadNotices:
    """Tells the peer at the other end of ``writer`` which of the slots it gave us we are done
    with: callable from any thread (a kept tensor is freed wherever its last reference goes);
    the names of one loop turn go out in one ``SLOTS_READ`` envelope."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: Any) -> None:
        self._loop = loop
        self._writer = writer
        self._names: list[str] = []
        # Reentrant: a kept tensor freed by the garbage collector while this thread holds it.
        self._lock = threading.RLock()

    def __call__(self, name: str) -> None:
        with self._lock:
            self._names.append(name)
            first = len(self._names) == 1
        if first:
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the peer is gone or going
                pass

    def _flush(self) -> None:
        with self._lock:
            names, self._names = self._names, []
        if names:
            self._writer.send(encode_message(0, SLOTS_READ, "\n".join(names).encode(), []))


def _whole_and_small(env: Any, max_bytes: int) -> bool:
    """One inline buffer, all of it in this envelope, small, and within ``max_bytes``."""
    sizes = env.buffer_sizes
    if len(sizes) != 1 or env.shared_buffers:
        return False
    size = sizes[0]
    return len(env.data) == size < _SMALL_FRAME_BYTES and size + len(env.payload) <= max_bytes


def collect(
    assemblies: dict[int, Assembly],
    env: Any,
    max_bytes: int,
    release_slot: Callable[[str], None] | None = None,
) -> tuple[Any, list[memoryview] | Exception] | None:
    """Feed one envelope; returns ``(header, buffers)`` once its message is complete.

    ``assemblies`` holds the link's messages still missing CHUNKs, by call id. ``buffers`` is
    the exception instead when a shared-memory buffer could not be adopted (or the message
    is above ``max_bytes``); the stream stays in step either way.
    """
    if env.kind == CHUNK:
        assembly = assemblies.get(env.call_id)
        if assembly is None:
            raise FrameError(f"CHUNK for unknown message {env.call_id}")
        assembly.feed(env.data)
        if not assembly.complete:
            return None
        del assemblies[env.call_id]
    elif not env.buffer_sizes:
        return env, []
    elif _whole_and_small(env, max_bytes):
        # The common small message: its one buffer came whole in the header (copied out, so
        # the tensor rebuilt over it owns writable memory, as Assembly's buffers).
        return env, [memoryview(bytearray(env.data))]
    else:
        assembly = Assembly(env, max_bytes, release_slot)
        if not assembly.complete:
            assemblies[env.call_id] = assembly
            return None
    return assembly.header, assembly.error or assembly.buffers
