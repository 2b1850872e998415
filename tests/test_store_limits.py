"""The store service's limits: key and value size caps and the key count.

A request above a cap gets a clear status naming the limit (INVALID_ARGUMENT for sizes,
RESOURCE_EXHAUSTED for the key count; the client raises StoreValueError with it), nothing
stored is changed or lost, and other clients go on as before. Also the rpcdist-server flags.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from rpcdist.programs.server import parse_args

from rpcdist.errors import StoreValueError
from rpcdist.store import GrpcStore, StoreLimits, StoreServer
from rpcdist.v1 import store_pb2

HOST = "127.0.0.1"
LIMITS = StoreLimits(max_key_bytes=64, max_value_bytes=1024, max_keys=5)


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    async with await StoreServer.start(HOST, 0, limits=LIMITS) as running:
        yield running


@pytest.fixture
async def clients(server: StoreServer) -> AsyncIterator[tuple[GrpcStore, GrpcStore]]:
    stores = (GrpcStore(HOST, server.port, timeout=20), GrpcStore(HOST, server.port, timeout=20))
    try:
        yield stores
    finally:
        for store in stores:
            await store.close_async()


async def _status(server: StoreServer, method: str, request: object) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            f"/rpcdist.v1.Store/{method}", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request.SerializeToString(), timeout=20)  # type: ignore[attr-defined]
    return info.value.code(), info.value.details() or ""


async def test_key_too_long_is_refused_naming_the_limit(
    server: StoreServer, clients: tuple[GrpcStore, GrpcStore]
) -> None:
    mine, other = clients
    await mine.set_async("kept", b"v")
    long_key = "k" * 65
    for call in (
        lambda: mine.set_async(long_key, b"v"),
        lambda: mine.get_async(long_key, timeout=1),
        lambda: mine.add_async(long_key, 1),
        lambda: mine.compare_set_async(long_key, b"", b"v"),
        lambda: mine.check_async([long_key]),
        lambda: mine.wait_async(["ok", long_key], timeout=1),
        lambda: mine.delete_key_async(long_key),
    ):
        with pytest.raises(StoreValueError, match="max_key_bytes=64"):
            await call()
    code, details = await _status(server, "Set", store_pb2.SetRequest(key=long_key, value=b"v"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "max_key_bytes=64" in details, details
    assert await mine.num_keys_async() == 1
    await other.set_async("k" * 64, b"at the limit")  # others, and keys at the cap, are fine
    assert await other.get_async("k" * 64) == b"at the limit"
    assert await mine.get_async("kept") == b"v"


async def test_value_too_large_is_refused_and_the_old_value_kept(
    server: StoreServer, clients: tuple[GrpcStore, GrpcStore]
) -> None:
    mine, other = clients
    await mine.set_async("key", b"old")
    with pytest.raises(StoreValueError, match="max_value_bytes=1024"):
        await mine.set_async("key", b"x" * 1025)
    with pytest.raises(StoreValueError, match="max_value_bytes=1024"):
        await mine.compare_set_async("key", b"old", b"x" * 1025)
    code, details = await _status(server, "Set", store_pb2.SetRequest(key="key", value=b"x" * 1025))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "1025 bytes" in details, details
    assert await other.get_async("key") == b"old"
    await other.set_async("key", b"y" * 1024)
    assert await mine.get_async("key") == b"y" * 1024


async def test_key_count_cap_refuses_new_keys_only(
    server: StoreServer, clients: tuple[GrpcStore, GrpcStore]
) -> None:
    mine, other = clients
    for i in range(5):
        await mine.set_async(f"k{i}", b"v")
    for call in (
        lambda: mine.set_async("new", b"v"),
        lambda: mine.add_async("counter", 1),
        lambda: mine.compare_set_async("new", b"", b"v"),
    ):
        with pytest.raises(StoreValueError, match="max_keys=5"):
            await call()
    code, details = await _status(server, "Add", store_pb2.AddRequest(key="counter", amount=1))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_keys=5" in details, details
    assert await other.num_keys_async() == 5
    await other.set_async("k0", b"overwritten")  # existing keys still change
    assert await mine.get_async("k0") == b"overwritten"
    assert await mine.delete_key_async("k4")
    assert await other.add_async("counter", 2) == 2  # room again
    assert sorted([await mine.get_async(f"k{i}") for i in range(4)]) == [b"overwritten", b"v", b"v", b"v"]


def test_server_flags() -> None:
    defaults = parse_args([])
    assert (defaults.max_key_bytes, defaults.max_value_bytes, defaults.max_keys) == (
        StoreLimits().max_key_bytes,
        StoreLimits().max_value_bytes,
        StoreLimits().max_keys,
    )
    args = parse_args(["--max-key-bytes", "100", "--max-value-bytes", "2000", "--max-keys", "7"])
    assert (args.max_key_bytes, args.max_value_bytes, args.max_keys) == (100, 2000, 7)
    with pytest.raises(SystemExit):
        parse_args(["--max-keys", "0"])
