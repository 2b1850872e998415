"""The stores: HashStore, FileStore, GrpcStore (in-process server and rpcdist-server), EtcdStore
(a real etcd, see ``_etcd``), PrefixStore."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from _harness import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcdist._runtime import LoopThread
from rpcdist.errors import StoreError, StoreTimeoutError, StoreValueError
from rpcdist.security import Security, read_job_token
from rpcdist.store import (
    EtcdStore,
    FileStore,
    GrpcStore,
    HashStore,
    KeyValueState,
    PrefixStore,
    Store,
    StoreServer,
)
from rpcdist.store import grpc_store as grpc_store_module
from rpcdist.v1 import store_pb2

HOST = "127.0.0.1"
BACKENDS = ["hash", "file", "grpc-inproc", "grpc-process", "etcd"]
MULTIPROCESS_BACKENDS = ["file", "grpc-inproc", "grpc-process", "etcd"]


# -- helpers -----------------------------------------------------------------------------------
def server_command() -> list[str]:
    script = Path(sys.executable).with_name("rpcdist-server")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "rpcdist.programs.server"]


def start_server_process(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    """Start rpcdist-server; returns it and the port it reports."""
    proc = subprocess.Popen(
        [*server_command(), "--host", HOST, "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("rpcdist-server listening on "):
        proc.kill()
        proc.wait()
        raise AssertionError(f"rpcdist-server did not start: {line!r} (exit {proc.returncode})")
    return proc, int(line.strip().rsplit(":", 1)[1])


def stop_process(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A worker process: talks to a store given on its command line, prints a JSON result.
WORKER = r"""
import faulthandler, json, sys
# Stuck past the test's patience: print every thread's stack (the test reports it), then exit.
faulthandler.dump_traceback_later(WORKER_STACKS_AFTER, exit=True)
from rpcdist.store import EtcdStore, FileStore, GrpcStore

kind, where, mode, key = sys.argv[1:5]
if kind == "file":
    store = FileStore(where, timeout=60)
elif kind == "etcd":
    endpoints, prefix = where.split("/", 1)
    store = EtcdStore(endpoints, prefix, timeout=60)
else:
    host, port = where.rsplit(":", 1)
    store = GrpcStore(host, int(port), timeout=60)
if mode == "add":  # wait for the start signal so that the workers overlap, then count
    store.wait([key + "/start"])
    result = [store.add(key, 1) for _ in range(int(sys.argv[5]))]
elif mode == "set":
    store.set(key, sys.argv[5])
    result = None
store.close()
print(json.dumps(result))
"""


WORKER_SECONDS = 90  # how long a test waits for a worker process
WORKER_STACKS_AFTER = 75  # when a worker still running prints its stacks and exits


def run_worker(spec: tuple[str, str], *args: str) -> subprocess.Popen[str]:
    code = WORKER.replace("WORKER_STACKS_AFTER", str(WORKER_STACKS_AFTER))
    return subprocess.Popen(
        [sys.executable, "-c", code, *spec, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def worker_result(proc: subprocess.Popen[str]) -> object:
    try:
        out, err = proc.communicate(timeout=WORKER_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"worker failed with exit code {proc.returncode}; its stderr:\n{err}"
    return json.loads(out)


# -- servers and backends ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def thread_server() -> Iterator[StoreServer]:
    """A StoreServer on a loop thread of its own (so sync and async tests can both use it)."""
    loop_thread = LoopThread()
    server = asyncio.run_coroutine_threadsafe(StoreServer.start(HOST, 0), loop_thread.loop).result(30)
    yield server
    asyncio.run_coroutine_threadsafe(server.stop(0), loop_thread.loop).result(30)
    loop_thread.stop()


@pytest.fixture(scope="module")
def process_server() -> Iterator[int]:
    """A real rpcdist-server process; yields its port."""
    proc, port = start_server_process()
    yield port
    stop_process(proc)


class Backend:
    """Makes clients of one store; clients bind to the loop running where they are made."""

    def __init__(
        self, kind: str, path: Path | None = None, port: int | None = None, etcd: list[str] | None = None
    ) -> None:
        self.kind = kind
        self.path = path
        self.port = port
        self.etcd = etcd
        self.etcd_prefix = f"test-{uuid.uuid4().hex[:12]}"  # the job: one per backend
        self.clients: list[Store] = []
        self._hash: HashStore | None = None

    def client(self, timeout: float = 30.0) -> Store:
        store: Store
        if self.kind == "hash":
            if self._hash is None:
                self._hash = HashStore(timeout=timeout)
                self.clients.append(self._hash)
            return self._hash
        if self.kind == "file":
            assert self.path is not None
            store = FileStore(self.path, timeout=timeout)
        elif self.kind == "etcd":
            assert self.etcd is not None
            store = EtcdStore(self.etcd, self.etcd_prefix, timeout=timeout, connect_timeout=10)
        else:
            assert self.port is not None
            store = GrpcStore(HOST, self.port, timeout=timeout, connect_timeout=10)
        self.clients.append(store)
        return store

    @property
    def spec(self) -> tuple[str, str]:
        """How a worker process reaches this store."""
        if self.kind == "file":
            return ("file", str(self.path))
        if self.kind == "etcd":
            assert self.etcd is not None
            return ("etcd", f"{','.join(self.etcd)}/{self.etcd_prefix}")
        return ("grpc", f"{HOST}:{self.port}")


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    kind = request.param
    if kind == "grpc-inproc":
        made = Backend(kind, port=request.getfixturevalue("thread_server").port)
    elif kind == "grpc-process":
        made = Backend(kind, port=request.getfixturevalue("process_server"))
    elif kind == "etcd":
        made = Backend(kind, etcd=request.getfixturevalue("etcd_server").endpoints)
    else:
        made = Backend(kind, path=tmp_path / "store")
    yield made
    for store in made.clients:
        await store.close_async()


@pytest.fixture(params=MULTIPROCESS_BACKENDS)
async def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """The backends that processes can share."""
    kind = request.param
    if kind == "grpc-inproc":
        made = Backend(kind, port=request.getfixturevalue("thread_server").port)
    elif kind == "grpc-process":
        made = Backend(kind, port=request.getfixturevalue("process_server"))
    elif kind == "etcd":
        made = Backend(kind, etcd=request.getfixturevalue("etcd_server").endpoints)
    else:
        made = Backend(kind, path=tmp_path / "store")
    yield made
    for store in made.clients:
        await store.close_async()


@pytest.fixture
def uniq() -> str:
    """A key prefix no other test uses (servers are shared within the module)."""
    return f"t{uuid.uuid4().hex[:12]}/"


# -- basic operations, blocking API ------------------------------------------------------------
def test_set_get_roundtrip(backend: Backend, uniq: str) -> None:
    store = backend.client()
    store.set(uniq + "a", b"\x00\x01binary\xff")
    store.set(uniq + "text", "héllo")
    store.set(uniq + "empty", b"")
    assert store.get(uniq + "a") == b"\x00\x01binary\xff"
    assert store.get(uniq + "text") == "héllo".encode()
    assert store.get(uniq + "empty") == b""
    store.set(uniq + "a", b"new")
    assert store.get(uniq + "a") == b"new"
    big = os.urandom(1 << 20)
    store.set(uniq + "big", big)
    assert store.get(uniq + "big") == big


def test_add(backend: Backend, uniq: str) -> None:
    store = backend.client()
    assert store.add(uniq + "n", 5) == 5
    assert store.add(uniq + "n", 2) == 7
    assert store.add(uniq + "n", -10) == -3
    assert store.get(uniq + "n") == b"-3"  # decimal ASCII, as torch stores counters
    store.set(uniq + "m", b"12")
    assert store.add(uniq + "m", 3) == 15
    assert store.add(uniq + "zero", 0) == 0
    assert store.get(uniq + "zero") == b"0"


@pytest.mark.parametrize("bad", [b"abc", b"1.5", b"", b"12abc"])
def test_add_on_non_integer_raises_and_keeps_value(backend: Backend, uniq: str, bad: bytes) -> None:
    store = backend.client()
    store.set(uniq + "x", bad)
    with pytest.raises(StoreValueError) as info:
        store.add(uniq + "x", 1)
    assert isinstance(info.value, ValueError)
    assert uniq + "x" in str(info.value)
    assert store.get(uniq + "x") == bad


def test_compare_set_semantics(backend: Backend, uniq: str) -> None:
    store = backend.client()
    # absent key, empty expected: set
    assert store.compare_set(uniq + "k", b"", b"first") == b"first"
    assert store.get(uniq + "k") == b"first"
    # value matches: replaced
    assert store.compare_set(uniq + "k", "first", "second") == b"second"
    assert store.get(uniq + "k") == b"second"
    # value differs: unchanged, current value returned
    assert store.compare_set(uniq + "k", b"nope", b"third") == b"second"
    assert store.get(uniq + "k") == b"second"
    # absent key, non-empty expected: nothing set, expected returned (torch's behaviour)
    assert store.compare_set(uniq + "absent", b"exp", b"des") == b"exp"
    assert not store.check([uniq + "absent"])
    # an empty value matches an empty expected, as a missing key does (torch's stores agree):
    # elastic membership frees a dead member's name that way, in one step
    store.set(uniq + "freed", b"")
    assert store.compare_set(uniq + "freed", b"", b"taken") == b"taken"
    assert store.get(uniq + "freed") == b"taken"
    assert store.compare_set(uniq + "freed", b"", b"again") == b"taken"
    assert store.compare_set(uniq + "freed", b"taken", b"") == b""
    assert store.check([uniq + "freed"]) and store.get(uniq + "freed") == b""


def test_check_delete_num_keys(backend: Backend, uniq: str) -> None:
    store = backend.client()
    before = store.num_keys()
    assert not store.check([uniq + "a"])
    store.set(uniq + "a", b"1")
    assert store.check([uniq + "a"])
    assert not store.check([uniq + "a", uniq + "b"])
    store.set(uniq + "b", b"2")
    assert store.check([uniq + "a", uniq + "b"])
    assert store.num_keys() == before + 2
    assert store.delete_key(uniq + "a") is True
    assert store.delete_key(uniq + "a") is False
    assert not store.check([uniq + "a"])
    assert store.num_keys() == before + 1
    with pytest.raises(StoreTimeoutError):
        store.get(uniq + "a", timeout=0.05)


# -- timeouts ----------------------------------------------------------------------------------
def test_get_timeout(backend: Backend, uniq: str) -> None:
    store = backend.client()
    with pytest.raises(StoreTimeoutError) as info:
        store.get(uniq + "missing", timeout=0.1)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, StoreError)
    assert uniq + "missing" in str(info.value)
    with pytest.raises(TimeoutError):
        store.get(uniq + "missing", timeout=timedelta(milliseconds=50))


def test_wait_timeout_names_missing_keys(backend: Backend, uniq: str) -> None:
    store = backend.client()
    store.set(uniq + "here", b"1")
    store.wait([uniq + "here"], timeout=1)
    with pytest.raises(StoreTimeoutError) as info:
        store.wait([uniq + "here", uniq + "gone"], timeout=0.1)
    assert uniq + "gone" in str(info.value)
    assert uniq + "here'" not in str(info.value)


def test_default_timeout_applies(backend: Backend, uniq: str) -> None:
    store = backend.client(timeout=0.1)
    assert store.timeout == timedelta(seconds=0.1)
    with pytest.raises(StoreTimeoutError):
        store.get(uniq + "never")
    with pytest.raises(StoreTimeoutError):
        store.wait([uniq + "never"])


# -- blocking until another party sets the key ---------------------------------------------------
async def test_get_and_wait_wake_when_another_task_sets(backend: Backend, uniq: str) -> None:
    reader, writer = backend.client(), backend.client()
    got = asyncio.create_task(reader.get_async(uniq + "late", timeout=30))
    waited = asyncio.create_task(reader.wait_async([uniq + "late", uniq + "later"], timeout=30))
    unlimited = asyncio.create_task(reader.get_async(uniq + "late", timeout=0))  # 0: no limit (torch)
    await asyncio.sleep(0.05)
    assert not got.done() and not waited.done() and not unlimited.done()
    await writer.set_async(uniq + "late", b"v")
    assert await got == b"v"
    assert await unlimited == b"v"
    await asyncio.sleep(0.05)
    assert not waited.done()
    assert await writer.add_async(uniq + "later", 1) == 1
    await waited


def test_blocking_get_from_threads(backend: Backend, uniq: str) -> None:
    reader, writer = backend.client(), backend.client()
    results: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            results.append(reader.get(uniq + "go", timeout=30))
            reader.wait([uniq + "go", uniq + "go2"], timeout=30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    writer.set(uniq + "go", b"now")
    writer.set(uniq + "go2", b"too")
    for t in threads:
        t.join(60)
    assert not errors
    assert results == [b"now"] * 3


def test_async_api_inside_asyncio_run(backend: Backend, uniq: str) -> None:
    store = backend.client()  # made outside any loop: bound to the background loop

    async def main() -> tuple[bytes, int, bool]:
        await store.set_async(uniq + "a", "x")
        value = await store.get_async(uniq + "a")
        count = await store.add_async(uniq + "n", 3)
        await store.wait_async([uniq + "a", uniq + "n"])
        return value, count, await store.check_async([uniq + "n"])

    assert asyncio.run(main()) == (b"x", 3, True)
    assert store.get(uniq + "n") == b"3"


async def test_async_api(backend: Backend, uniq: str) -> None:
    store = backend.client()
    await store.set_async(uniq + "a", b"1")
    assert await store.get_async(uniq + "a") == b"1"
    assert await store.add_async(uniq + "c", 4) == 4
    assert await store.compare_set_async(uniq + "a", b"1", b"2") == b"2"
    assert await store.check_async([uniq + "a", uniq + "c"])
    assert await store.delete_key_async(uniq + "c")
    assert await store.num_keys_async() >= 1
    with pytest.raises(StoreTimeoutError):
        await store.get_async(uniq + "c", timeout=0.05)
    # blocking twins work from other threads while this loop runs
    assert await asyncio.to_thread(store.get, uniq + "a") == b"2"


async def test_concurrent_adds_from_threads_and_tasks(backend: Backend, uniq: str) -> None:
    clients = [backend.client() for _ in range(3)]

    def adds(store: Store) -> list[int]:
        return [store.add(uniq + "n", 1) for _ in range(20)]

    thread_results = await asyncio.gather(*(asyncio.to_thread(adds, s) for s in clients))
    task_results = await asyncio.gather(*(clients[i % 3].add_async(uniq + "n", 1) for i in range(30)))
    seen = sorted([v for r in thread_results for v in r] + list(task_results))
    assert seen == list(range(1, 91))
    assert await clients[0].get_async(uniq + "n") == b"90"


# -- PrefixStore --------------------------------------------------------------------------------
def test_prefix_store_isolation(backend: Backend, uniq: str) -> None:
    base = backend.client()
    left = PrefixStore(uniq + "left", base)
    right = PrefixStore(uniq + "right", base)
    nested = PrefixStore("inner", left)
    left.set("k", b"L")
    right.set("k", b"R")
    nested.set("k", b"N")
    assert left.get("k") == b"L"
    assert right.get("k") == b"R"
    assert nested.get("k") == b"N"
    assert base.get(uniq + "left/k") == b"L"
    assert base.get(uniq + "left/inner/k") == b"N"
    assert not left.check(["only-right"])
    right.set("only-right", b"1")
    assert not left.check(["only-right"])
    assert right.add("n", 2) == 2
    assert left.add("n", 5) == 5
    assert left.compare_set("k", b"L", b"L2") == b"L2"
    assert right.get("k") == b"R"
    assert left.delete_key("k")
    assert right.check(["k"])
    with pytest.raises(StoreTimeoutError) as info:
        left.get("nothing", timeout=0.05)
    assert "nothing" in str(info.value)


# -- several processes ---------------------------------------------------------------------------
def test_concurrent_add_from_processes(shared_backend: Backend, uniq: str) -> None:
    workers, per_worker = 4, 100
    counter = uniq + "counter"
    procs = [run_worker(shared_backend.spec, "add", counter, str(per_worker)) for _ in range(workers)]
    store = shared_backend.client()
    store.set(counter + "/start", b"go")
    returned = [v for p in procs for v in worker_result(p)]  # type: ignore[union-attr]
    # every add saw a distinct value: none was lost or applied twice
    assert sorted(returned) == list(range(1, workers * per_worker + 1))
    assert store.get(counter) == str(workers * per_worker).encode()


async def test_get_released_by_another_process(shared_backend: Backend, uniq: str) -> None:
    store = shared_backend.client()
    got = asyncio.create_task(store.get_async(uniq + "from-child", timeout=60))
    waited = asyncio.create_task(store.wait_async([uniq + "from-child"], timeout=60))
    await asyncio.sleep(0.02)
    assert not got.done()
    proc = run_worker(shared_backend.spec, "set", uniq + "from-child", "hello")
    assert await asyncio.to_thread(worker_result, proc) is None
    assert await got == b"hello"
    await waited


# -- KeyValueState -------------------------------------------------------------------------------
async def test_key_value_state_leaves_no_waiters() -> None:
    state = KeyValueState()
    with pytest.raises(StoreTimeoutError):
        await state.get("a", 0.01)
    task = asyncio.create_task(state.wait(["a", "b"], None))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state._waiters == {}
    waiter = asyncio.create_task(state.wait(["a", "b"], 10))
    await asyncio.sleep(0)
    state.set("b", b"")
    state.set("a", b"")
    await waiter
    assert state._waiters == {}


# -- FileStore ---------------------------------------------------------------------------------
def test_file_store_rejects_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store file at all")
    with FileStore(path, timeout=5) as store:
        for op in (lambda: store.get("k"), lambda: store.set("k", b"v"), lambda: store.num_keys()):
            with pytest.raises(StoreError, match="not a valid rpcdist FileStore file"):
                op()
    assert path.read_bytes() == b"this is not a store file at all"


def test_file_store_rejects_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with FileStore(path) as store:
        store.set("key", b"value" * 10)
    path.write_bytes(path.read_bytes()[:-7])
    with FileStore(path) as store, pytest.raises(StoreError, match="truncated"):
        store.check(["key"])


def test_file_store_accepts_existing_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.touch()
    with FileStore(str(path)) as store:
        assert store.num_keys() == 0
        store.set("a", b"1")
    with FileStore(path) as again:
        assert again.get("a") == b"1"


def test_file_store_world_size_removes_file(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    first, second = FileStore(path, world_size=2), FileStore(path, world_size=2)
    first.set("a", b"1")
    first.close()
    assert path.exists()
    assert second.get("a") == b"1"
    assert second.num_keys() == 1  # bookkeeping is not a key
    second.close()
    assert not path.exists()
    assert not Path(str(path) + ".lock").exists()


# -- gRPC specifics -------------------------------------------------------------------------------
@pytest.fixture(params=["grpc-inproc", "grpc-process"])
def grpc_port(request: pytest.FixtureRequest) -> int:
    if request.param == "grpc-inproc":
        return request.getfixturevalue("thread_server").port
    return request.getfixturevalue("process_server")


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        ("Set", b"\xff\xff\xff"),
        ("Set", store_pb2.SetRequest(key="k", value=b"x" * 100).SerializeToString()[:-10]),
        ("Get", b"\x0a\x05ab"),
        ("Add", b"\x12"),
        ("Wait", b"\x0a\x02\xff\xfe"),  # a key that is not UTF-8
    ],
)
async def test_malformed_request_gets_invalid_argument(
    grpc_port: int, uniq: str, method: str, payload: bytes
) -> None:
    # A member's raw client: with the token a server on loopback left for this user (if any).
    metadata = Security(token=read_job_token(grpc_port)).metadata()
    async with grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as channel:
        raw = channel.unary_unary(
            f"/rpcdist.v1.Store/{method}", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(payload, timeout=10, metadata=metadata)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in (info.value.details() or "")
    # the server keeps serving everyone else
    store = GrpcStore(HOST, grpc_port, timeout=10)
    try:
        await store.set_async(uniq + "after", b"fine")
        assert await store.get_async(uniq + "after") == b"fine"
    finally:
        await store.close_async()


async def test_health_service_serving(grpc_port: int) -> None:
    async with grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rpcdist.v1.Store"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_store_server_port_in_use_fails(thread_server: StoreServer) -> None:
    with pytest.raises(StoreError, match="address already in use"):
        await StoreServer.start(HOST, thread_server.port)
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen()
        with pytest.raises(StoreError, match="address already in use"):
            await StoreServer.start(HOST, listener.getsockname()[1])


async def test_store_server_in_current_loop() -> None:
    async with await StoreServer.start(HOST, 0) as server:
        assert server.port > 0
        store = GrpcStore(HOST, server.port, timeout=10)
        try:
            await store.set_async("a", b"1")
            assert server.state.get_nowait("a") == b"1"
            server.state.set("b", b"2")
            assert await store.get_async("b") == b"2"
            with pytest.raises(StoreValueError, match="limit"):
                await store.set_async("huge", bytes(64 * 1024 * 1024 + 1))
        finally:
            await store.close_async()


def test_unreachable_store() -> None:
    store = GrpcStore(HOST, free_port(), timeout=5, connect_timeout=0.2)
    try:
        with pytest.raises(StoreError, match="unreachable"):
            store.set("a", b"1")
    finally:
        store.close()


async def test_server_going_away_is_reported() -> None:
    server = await StoreServer.start(HOST, 0)
    store = GrpcStore(HOST, server.port, timeout=10, connect_timeout=0.2)
    try:
        await store.set_async("a", b"1")
        pending = asyncio.create_task(store.get_async("never", timeout=30))
        await asyncio.sleep(0.05)
        await server.stop(0)
        with pytest.raises(StoreError) as info:
            await pending
        assert not isinstance(info.value, StoreTimeoutError)
        with pytest.raises(StoreError, match="unreachable"):
            await store.set_async("a", b"2")
    finally:
        await store.close_async()


async def test_client_deadline_when_server_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that ignores the request's timeout still cannot hang the client."""
    monkeypatch.setattr(grpc_store_module, "DEADLINE_SLACK", 0.1)

    async def never(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.Event().wait()
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "rpcdist.v1.Store", {"Get": grpc.unary_unary_rpc_method_handler(never)}
            ),
        )
    )
    port = server.add_insecure_port(f"{HOST}:0")
    await server.start()
    store = GrpcStore(HOST, port, timeout=10)
    try:
        with pytest.raises(StoreTimeoutError, match="'k'"):
            await store.get_async("k", timeout=0.1)
    finally:
        await store.close_async()
        await server.stop(0)


# -- rpcdist-server program ----------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_rpcdist_server_exits_cleanly_on_signal(sig: int) -> None:
    proc, port = start_server_process()
    try:
        with GrpcStore(HOST, port, timeout=10) as store:
            store.set("k", b"v")
            assert store.get("k") == b"v"
    finally:
        code = stop_process(proc, sig)
    assert code == 0


def test_rpcdist_server_port_in_use_exits_nonzero(process_server: int) -> None:
    proc = subprocess.Popen(
        [*server_command(), "--host", HOST, "--port", str(process_server)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "listening" not in out
    assert "address already in use" in err


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rpcdist.programs.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "--port" in proc.stdout
