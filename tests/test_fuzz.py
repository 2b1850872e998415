"""Fuzzing with hypothesis: the frame decoder, the envelope decoder and message assembly, the
restricted unpickler, and every store method through the real gRPC store service.

Each target is fed random and mutated input and may fail only with its documented exception
(``FrameError``, ``RestrictedError``, ``StoreError``, a gRPC status of INVALID_ARGUMENT and the
like); anything else, or a hang (pytest-timeout), fails. The number of examples comes from
``tests/_fuzz.py`` (``RPCDIST_FUZZ_PROFILE=long`` for the long run).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from _fuzz import FUZZ
from hypothesis import assume, given
from hypothesis import strategies as st

from rpcdist import serialization
from rpcdist._runtime import LoopThread
from rpcdist.errors import PayloadTooLargeError, RestrictedError, StoreError
from rpcdist.store import GrpcStore, StoreLimits, StoreServer
from rpcdist.transport import frames
from rpcdist.v1 import agent_pb2, store_pb2

pytestmark = pytest.mark.timeout(int(os.environ.get("RPCDIST_FUZZ_TIMEOUT", "600")))

HOST = "127.0.0.1"
MAX_BYTES = 1 << 20


# ============================================================================ frames
def _envelope_bytes() -> st.SearchStrategy[bytes]:
    """Well-formed envelopes (random fields), so mutations reach deep into the decoder."""
    return st.builds(
        lambda call_id, kind, payload, sizes, data, timeout, function, rank: agent_pb2.Envelope(
            call_id=call_id,
            kind=kind,
            payload=payload,
            buffer_sizes=sizes,
            data=data,
            timeout_seconds=timeout,
            function=function,
            caller_rank=rank,
        ).SerializeToString(),
        st.integers(0, 2**64 - 1),
        st.sampled_from([0, frames.REQUEST, frames.RESPONSE, frames.ERROR, frames.CANCEL, frames.CHUNK, 99]),
        st.binary(max_size=64),
        st.lists(st.integers(0, 2**64 - 1), max_size=4),
        st.binary(max_size=64),
        st.floats(allow_nan=True),
        st.text(max_size=16),
        st.integers(-(2**31), 2**31 - 1),
    )


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        if out:
            out[pos % len(out)] = byte
    return bytes(out)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_decode_frame_random_bytes(raw: bytes) -> None:
    try:
        frames.decode_frame(raw)
    except frames.FrameError:
        pass


_BIG = agent_pb2.Envelope(call_id=1, kind=frames.CHUNK, data=bytes(70_000)).SerializeToString()


@FUZZ
@given(
    st.lists(_envelope_bytes(), max_size=4),
    st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=4),
    st.integers(0, 8),
)
def test_fuzz_decode_frame_large_path(envelopes: list[bytes], edits: list[tuple[int, int]], cut: int) -> None:
    # Frames of 64 KiB or more take the zero-copy reader: pad with one big envelope.
    body = b"".join(frames._FRAME_ENVELOPE_TAG + frames._varint(len(e)) + e for e in [*envelopes, _BIG])
    raw = _mutate(body, edits)
    raw = raw[: len(raw) - cut] if cut else raw
    try:
        decoded = frames.decode_frame(raw)
    except frames.FrameError:
        return
    if not edits and not cut:  # untouched: every envelope reads back
        assert len(decoded) == len(envelopes) + 1


@FUZZ
@given(
    st.one_of(st.binary(max_size=256), _envelope_bytes()),
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 255)), max_size=3),
)
def test_fuzz_envelope_decoder(raw: bytes, edits: list[tuple[int, int]]) -> None:
    raw = _mutate(raw, edits)
    buf = memoryview(raw)
    try:
        env = frames._decode_envelope(buf, 0, len(buf))
    except frames.FrameError:
        return
    assert isinstance(env.function, str) and all(isinstance(n, int) for n in env.buffer_sizes)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # call id
            st.sampled_from([frames.REQUEST, frames.RESPONSE, frames.CHUNK, frames.CANCEL]),
            st.lists(st.integers(0, 4 * MAX_BYTES), max_size=3),
            st.binary(max_size=64),
        ),
        max_size=8,
    )
)
def test_fuzz_message_assembly(steps: list[tuple[int, int, list[int], bytes]]) -> None:
    """Header and CHUNK envelopes in any order and size: complete messages, FrameError, or a
    PayloadTooLargeError carried in place of the buffers; never a big allocation."""
    assemblies: dict[int, frames.Assembly] = {}
    for call_id, kind, sizes, data in steps:
        env = frames.Envelope(call_id=call_id, kind=kind, buffer_sizes=sizes, data=data)
        try:
            message = frames.collect(assemblies, env, MAX_BYTES)
        except frames.FrameError:
            continue
        if message is not None:
            header, buffers = message
            if isinstance(buffers, Exception):
                assert isinstance(buffers, PayloadTooLargeError)
            else:
                assert [len(b) for b in buffers] == list(header.buffer_sizes)


# ============================================================================ restricted unpickler
def _loads_restricted(raw: bytes) -> None:
    try:
        serialization.loads(raw, restricted=True)
    except RestrictedError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_restricted_unpickler_random_bytes(raw: bytes) -> None:
    _loads_restricted(raw)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.complex_numbers(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
        | st.frozensets(st.integers(), max_size=4)
        | st.builds(torch.tensor, st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=8))
        | st.builds(np.array, st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8))
        | st.builds(np.array, st.lists(st.floats(allow_nan=False), max_size=8))
        | st.builds(np.float32, st.floats(width=32, allow_nan=False))
        | st.builds(
            lambda rows: np.array(rows, dtype=[("a", "<i4"), ("b", "<f8")]),
            st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), st.floats(allow_nan=False)), max_size=4),
        )
    ),
    max_leaves=12,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor | np.ndarray):
        return type(a) is type(b) and a.shape == b.shape and bool((a == b).all())  # type: ignore[union-attr]
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@FUZZ
@given(_values, st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3))
def test_fuzz_restricted_unpickler_data_round_trips_and_mutations_are_refused(
    value: object, edits: list[tuple[int, int]]
) -> None:
    payload, buffers = serialization.dumps(value)
    if not edits:
        assert _same(serialization.loads(payload, [bytearray(b) for b in buffers], restricted=True), value)
        return
    try:
        serialization.loads(_mutate(payload, edits), [bytearray(b) for b in buffers], restricted=True)
    except RestrictedError:
        pass


_DANGEROUS = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "open"),
    ("builtins", "__import__"),
    ("builtins", "range"),
    ("builtins", "bytearray"),
    ("subprocess", "Popen"),
    ("importlib", "import_module"),
    ("torch", "load"),
    ("numpy", "load"),
    ("pickle", "loads"),
    ("copyreg", "_reconstructor"),
    ("rpcdist.run", "main"),
]


def _reduce_pickle(module: str, name: str, argument: str, stack_global: bool) -> bytes:
    """A hand-made pickle calling ``module.name(argument)`` (no import needed to make it)."""

    def short(text: str) -> bytes:
        data = text.encode("utf-8", "surrogatepass")
        return (
            b"\x8c" + bytes([len(data)]) + data
            if len(data) < 256
            else b"X" + len(data).to_bytes(4, "little") + data
        )

    if stack_global:
        func = short(module) + short(name) + b"\x93"
    else:
        func = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return b"\x80\x04" + func + short(argument) + b"\x85R."


@FUZZ
@given(st.sampled_from(_DANGEROUS), st.booleans(), st.text(max_size=10))
def test_fuzz_restricted_unpickler_refuses_dangerous_globals(
    target: tuple[str, str], stack_global: bool, argument: str
) -> None:
    module, name = target
    raw = _reduce_pickle(module, name, argument, stack_global)
    with pytest.raises(RestrictedError, match="refused"):
        serialization.loads(raw, restricted=True)
    assert pickle.loads(_reduce_pickle("builtins", "str", argument, stack_global)) == argument  # well-formed


def test_dangerous_modules_were_not_imported_by_the_refusals() -> None:
    for module in ("subprocess", "rpcdist.run", "antigravity"):
        if module in sys.modules:
            continue
        with pytest.raises(RestrictedError):
            serialization.loads(_reduce_pickle(module, "x", "", True), restricted=True)
        assert module not in sys.modules


def test_tensor_without_its_data_is_refused_not_allocated() -> None:
    class Claim:
        def __reduce__(self) -> object:
            return (
                serialization.rebuild_tensor,
                (b"", torch.float32, (1 << 20, 1 << 20), (1 << 20, 1), False, False),
            )

    with pytest.raises(RestrictedError, match="without its data"):
        serialization.loads(pickle.dumps(Claim(), protocol=5), restricted=True)


# ============================================================================ the store service
@pytest.fixture(scope="module")
def store_server() -> Iterator[StoreServer]:
    loop_thread = LoopThread()
    limits = StoreLimits(max_key_bytes=256, max_value_bytes=4096, max_keys=500)
    server = asyncio.run_coroutine_threadsafe(
        StoreServer.start(HOST, 0, limits=limits), loop_thread.loop
    ).result(30)
    yield server
    asyncio.run_coroutine_threadsafe(server.stop(0), loop_thread.loop).result(30)
    loop_thread.stop()


@pytest.fixture(scope="module")
def store(store_server: StoreServer) -> Iterator[GrpcStore]:
    client = GrpcStore(HOST, store_server.port, timeout=30)
    client.set("sentinel", b"intact")
    yield client
    client.close()


@pytest.fixture(scope="module")
def raw_channel(store_server: StoreServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(store_server.address) as channel:
        yield channel


_REQUESTS = {
    "Set": store_pb2.SetRequest,
    "Get": store_pb2.GetRequest,
    "Add": store_pb2.AddRequest,
    "CompareSet": store_pb2.CompareSetRequest,
    "Wait": store_pb2.WaitRequest,
    "Check": store_pb2.CheckRequest,
    "DeleteKey": store_pb2.DeleteKeyRequest,
    "NumKeys": store_pb2.NumKeysRequest,
}
# What a raw request may get: an answer, or a status that says what was wrong with it.
_EXPECTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@FUZZ
@given(st.sampled_from(sorted(_REQUESTS)), st.binary(max_size=300))
def test_fuzz_store_service_raw_bytes(
    raw_channel: grpc.Channel, store: GrpcStore, method: str, raw: bytes
) -> None:
    call = raw_channel.unary_unary(
        f"/rpcdist.v1.Store/{method}", request_serializer=None, response_deserializer=None
    )
    try:
        call(raw, timeout=2.0)
    except grpc.RpcError as exc:
        assert exc.code() in _EXPECTED_CODES, (exc.code(), exc.details())


_keys = st.text(max_size=300) | st.sampled_from(["a", "b", "counter", "sentinel-not"])
_store_ops = st.one_of(
    st.tuples(st.just("set"), _keys, st.binary(max_size=5000)),
    st.tuples(st.just("get"), _keys, st.none()),
    st.tuples(st.just("add"), _keys, st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("compare_set"), _keys, st.tuples(st.binary(max_size=5000), st.binary(max_size=5000))),
    st.tuples(st.just("check"), st.lists(_keys, max_size=3), st.none()),
    st.tuples(st.just("wait"), st.lists(_keys, max_size=3), st.none()),
    st.tuples(st.just("delete_key"), _keys, st.none()),
    st.tuples(st.just("num_keys"), st.none(), st.none()),
)


@FUZZ
@given(_store_ops)
def test_fuzz_every_store_method(store: GrpcStore, op: tuple[str, object, object]) -> None:
    """Random keys and values through GrpcStore: a result or a StoreError (a too-long key, a
    too-big value, too many keys, a non-integer add, a missing key's timeout), and the
    sentinel key set before the run is never lost."""
    name, key, arg = op
    assume(key != "sentinel" and not (isinstance(key, list) and "sentinel" in key))
    try:
        if name == "set":
            store.set(key, arg)  # type: ignore[arg-type]
            assert store.get(key, timeout=5) == arg  # type: ignore[arg-type]
        elif name == "get":
            store.get(key, timeout=0.01)  # type: ignore[arg-type]
        elif name == "add":
            store.add(key, arg)  # type: ignore[arg-type]
        elif name == "compare_set":
            store.compare_set(key, *arg)  # type: ignore[arg-type, misc]
        elif name == "check":
            store.check(key)  # type: ignore[arg-type]
        elif name == "wait":
            store.wait(key, timeout=0.01)  # type: ignore[arg-type]
        elif name == "delete_key":
            store.delete_key(key)  # type: ignore[arg-type]
        else:
            assert store.num_keys() <= 500
    except StoreError:  # the documented failures (StoreValueError, StoreTimeoutError, ...)
        pass
    if store.num_keys() >= 450:
        for k in ("a", "b", "counter"):
            store.delete_key(k)
    assert store.get("sentinel", timeout=5) == b"intact"


@pytest.mark.parametrize(
    "opcode", [b"\x96", b"\x8e", b"\x8d"], ids=["BYTEARRAY8", "BINBYTES8", "BINUNICODE8"]
)
def test_declared_huge_length_is_refused_without_allocating(opcode: bytes) -> None:
    """Found by the fuzzer: C pickle allocates what such an opcode declares before it finds
    the message shorter; restricted mode walks the opcodes first."""
    raw = b"\x80\x05" + opcode + (1 << 31).to_bytes(8, "little") + b"xx."
    _refused_within(raw, "malformed", 64 << 20)


def _refused_within(raw: bytes, reason: str, max_bytes: int) -> None:
    """Restricted mode refuses ``raw`` (a message matching ``reason``), allocating less than
    ``max_bytes`` on the way (traced: the refusal must come before any big allocation)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(RestrictedError, match=reason):
            serialization.loads(raw, restricted=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < max_bytes, f"{peak} bytes allocated for a {len(raw)}-byte message"


@pytest.mark.parametrize(
    "put",
    [b"r" + (10**7).to_bytes(4, "little"), b"p10000000\n", b"q\x05"],
    ids=["LONG_BINPUT", "PUT", "BINPUT"],
)
def test_memo_put_beyond_the_filled_slots_is_refused_without_allocating(put: bytes) -> None:
    """Found by the fuzzer (a CI run OOM-killed at 24 GB): C pickle grows its memo table to
    twice the slot a put names, zeroed, so 8 bytes naming slot 10**9 cost 16 GB. A pickler fills
    slots in order; restricted mode refuses a put past the next free one before unpickling."""
    raw = b"\x80\x04N" + put + b"."
    _refused_within(raw, "memo put at byte 3 names slot", 16 << 20)
    assert pickle.loads(raw) is None  # the same bytes are a valid pickle (that allocates) otherwise


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_that_fill_memo_slots_in_order_still_load_restricted(protocol: int) -> None:
    shared = [1.5, "x"]
    value = {"a": [shared, shared, "s"], "b": (shared,), "c": {"d": shared}}
    loaded = serialization.loads(pickle.dumps(value, protocol=protocol), restricted=True)
    assert loaded == value and loaded["a"][0] is loaded["a"][1] is loaded["b"][0] is loaded["c"]["d"]
