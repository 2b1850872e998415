"""torch's stores through rpcdist: ``rpcdist.TCPStore`` (torch's TCPStore with torch's
constructor) and ``TorchStore`` (any ``torch.distributed.Store`` as an rpcdist store), and the
errors that are torch's DistError family too.

- The store contract of ``test_store`` (set/get, add, compare_set, timeouts, waits woken by
  another client, threads, asyncio, PrefixStore...) runs again here over rpcdist.TCPStore
  clients, TorchStore over torch's TCPStore client, PrefixStore, HashStore, FileStore and a
  torch Store written in Python (which cannot be cloned, so the adapter calls it directly).
- A group of processes shares one TCPStore: the master on an ephemeral port, clients that
  connect to it; set/get, add, compare_set races, wait timeouts raising DistStoreError, waits
  released by another process, num_keys/delete_key, the async API.
- ``except torch.distributed.DistNetworkError`` catches rpcdist's WorkerUnavailableError (from
  a real RPC call) and StoreConnectionError; ``except DistStoreError`` catches
  StoreTimeoutError.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import rpc_scenarios
import test_store
import torch
import torch.distributed as tdist
from _harness import check, free_port, run_group
from c10d_functions import ImportInWorker

import rpcdist
from rpcdist.errors import (
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    StoreValueError,
    UnknownWorkerError,
    WorkerUnavailableError,
)
from rpcdist.store import HashStore, PrefixStore, Store, TCPStore, TorchStore

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)


# ============================================================================ a torch Store in Python
class DictStore(tdist.Store):
    """A ``torch.distributed.Store`` written in Python (as users may write one): it has no
    ``clone()``, so TorchStore shares it between its calls."""

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount  # ValueError on a non-number
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            current = self._data.get(key)
            if (current is None and not expected) or current == bytes(expected):
                self._data[key] = bytes(desired)
                self._cond.notify_all()
                return bytes(desired)
            return bytes(expected) if current is None else current

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), limit):
                raise tdist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)


# ============================================================================ the contract, again
@pytest.fixture(scope="module")
def tcp_master() -> Iterator[tdist.TCPStore]:
    """torch's TCPStore server in this process, on an ephemeral port."""
    master = tdist.TCPStore(HOST, 0, None, True, TIMEOUT, wait_for_workers=False)
    yield master
    del master


class TorchBackend:
    """Makes rpcdist clients of one torch store (same interface as test_store's Backend)."""

    def __init__(self, kind: str, tmp_path: Path, master: tdist.TCPStore) -> None:
        self.kind = kind
        self.master = master
        self.clients: list[Store] = []
        self._shared: tdist.Store | None = None
        if kind == "torch-hash":
            self._shared = tdist.HashStore()
        elif kind == "python-store":
            self._shared = DictStore()
        elif kind == "torch-file":
            self._path = str(tmp_path / "torch-file-store")

    def client(self, timeout: float = 30.0) -> Store:
        store: Store
        if self.kind == "rpcdist-tcp":
            store = TCPStore(HOST, self.master.port, timeout=timedelta(seconds=timeout))
        elif self.kind == "torch-tcp":
            store = TorchStore(tdist.TCPStore(HOST, self.master.port, None, False, TIMEOUT), timeout)
        elif self.kind == "torch-prefix":
            raw = tdist.TCPStore(HOST, self.master.port, None, False, TIMEOUT)
            store = TorchStore(tdist.PrefixStore("torch-prefix", raw), timeout)
        elif self.kind == "torch-file":
            store = TorchStore(tdist.FileStore(self._path, -1), timeout)
        else:
            assert self._shared is not None
            store = TorchStore(self._shared, timeout)
        self.clients.append(store)
        return store


TORCH_BACKENDS = ["rpcdist-tcp", "torch-tcp", "torch-prefix", "torch-hash", "torch-file", "python-store"]


@pytest.fixture(params=TORCH_BACKENDS)
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, tcp_master: tdist.TCPStore
) -> AsyncIterator[TorchBackend]:
    made = TorchBackend(request.param, tmp_path, tcp_master)
    yield made
    for store in made.clients:
        await store.close_async()


@pytest.fixture
def uniq() -> str:
    """A key prefix no other test uses (the TCPStore server is shared within the module)."""
    return f"t{uuid.uuid4().hex[:12]}/"


# test_store's backend-independent tests, collected here with this module's ``backend``.
test_contract_set_get_roundtrip = test_store.test_set_get_roundtrip
test_contract_add = test_store.test_add
test_contract_compare_set_semantics = test_store.test_compare_set_semantics
test_contract_check_delete_num_keys = test_store.test_check_delete_num_keys
test_contract_get_timeout = test_store.test_get_timeout
test_contract_wait_timeout_names_missing_keys = test_store.test_wait_timeout_names_missing_keys
test_contract_default_timeout_applies = test_store.test_default_timeout_applies
test_contract_get_and_wait_wake = test_store.test_get_and_wait_wake_when_another_task_sets
test_contract_blocking_get_from_threads = test_store.test_blocking_get_from_threads
test_contract_async_api_inside_asyncio_run = test_store.test_async_api_inside_asyncio_run
test_contract_async_api = test_store.test_async_api
test_contract_concurrent_adds = test_store.test_concurrent_adds_from_threads_and_tasks
test_contract_prefix_store_isolation = test_store.test_prefix_store_isolation


@pytest.mark.parametrize("bad", [b"abc", b"x1"])
def test_add_on_a_non_number_raises_naming_the_key(backend: TorchBackend, uniq: str, bad: bytes) -> None:
    """torch reads counters as C's stoll does ("12abc" is 12); what it cannot read raises
    StoreValueError naming the key, and the store (a fresh connection, for TCPStore) goes on."""
    store = backend.client()
    store.set(uniq + "x", bad)
    with pytest.raises(StoreValueError) as info:
        store.add(uniq + "x", 1)
    assert isinstance(info.value, ValueError) and isinstance(info.value, tdist.DistStoreError)
    assert uniq + "x" in str(info.value)
    assert store.get(uniq + "x") == bad
    assert store.add(uniq + "n", 2) == 2


# ============================================================================ the adapter itself
async def test_a_wait_does_not_hold_up_the_set_that_ends_it(tcp_master: tdist.TCPStore, uniq: str) -> None:
    """torch's TCPStore client holds its socket during a wait; the adapter's calls use clones,
    so a get blocked on a key is released by a set through the same adapter."""
    store = TorchStore(tdist.TCPStore(HOST, tcp_master.port, None, False, TIMEOUT), timeout=30)
    try:
        waiters = [asyncio.create_task(store.get_async(uniq + "k", timeout=20)) for _ in range(3)]
        waited = asyncio.create_task(store.wait_async([uniq + "k"], timeout=20))
        await asyncio.sleep(0.2)
        await store.set_async(uniq + "k", b"v")  # would wait behind the gets on one socket
        assert await asyncio.gather(*waiters) == [b"v"] * 3
        await waited
    finally:
        await store.close_async()


async def test_unlimited_wait_ends_when_cancelled_or_closed(tcp_master: tdist.TCPStore, uniq: str) -> None:
    store = TorchStore(tdist.TCPStore(HOST, tcp_master.port, None, False, TIMEOUT), timeout=30)
    pending = asyncio.create_task(store.get_async(uniq + "never", timeout=0))
    later = asyncio.create_task(store.wait_async([uniq + "never"], timeout=0))
    await asyncio.sleep(0.2)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await store.close_async()
    with pytest.raises(StoreError):
        await later
    for _ in range(100):  # the polling threads notice and end
        if not [t for t in threading.enumerate() if t.name == "rpcdist-torch-store"]:
            break
        await asyncio.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "rpcdist-torch-store"]
    with pytest.raises(StoreError):
        await store.set_async(uniq + "after", b"1")


def test_torch_store_defaults_and_accessors(tcp_master: tdist.TCPStore) -> None:
    raw = tdist.HashStore()
    raw.set_timeout(timedelta(seconds=12))
    store = TorchStore(raw)
    try:
        assert store.timeout == timedelta(seconds=12)  # torch store's own timeout by default
        assert store.torch_store is raw
        store.set("a", "1")
        assert raw.get("a") == b"1"  # the same data, seen from torch
    finally:
        store.close()
    with pytest.raises(TypeError):
        TorchStore(HashStore())  # type: ignore[arg-type] - an rpcdist store is not a torch one
    assert TorchStore(tdist.HashStore(), timedelta(seconds=3)).timeout == timedelta(seconds=3)


def test_tcp_store_constructor_and_properties() -> None:
    master = TCPStore(HOST, 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore(host_name=HOST, port=master.port, world_size=2, is_master=False, timeout=30)
    try:
        assert master.port > 0 and client.port == master.port
        assert master.host == HOST
        assert isinstance(master.libuvBackend, bool)
        assert isinstance(master.torch_store, tdist.TCPStore)
        client.set("from-client", b"hi")
        assert master.get("from-client") == b"hi"
        assert master.timeout == timedelta(seconds=30)
    finally:
        client.close()
        master.close()
    assert master.port > 0  # still answers after close


async def test_tcp_store_create_async_binds_to_the_running_loop() -> None:
    master = await TCPStore.create_async(HOST, 0, is_master=True, wait_for_workers=False, timeout=30)
    try:
        assert master._loop is asyncio.get_running_loop()
        await master.set_async("k", b"v")
        assert await master.get_async("k") == b"v"
    finally:
        await master.close_async()


def test_torch_store_in_rpcdist_prefix_store(tcp_master: tdist.TCPStore, uniq: str) -> None:
    base = TCPStore(HOST, tcp_master.port, timeout=30)
    try:
        view = PrefixStore(uniq + "p", base)
        view.set("k", b"1")
        assert tcp_master.get(uniq + "p/k") == b"1"  # plain torch sees rpcdist's keys
        tcp_master.set(uniq + "p/from-torch", b"2")
        assert view.get("from-torch") == b"2"
    finally:
        base.close()


# ============================================================================ errors
def test_rpcdist_errors_are_torch_dist_errors() -> None:
    assert rpcdist.DistError is tdist.DistError
    assert rpcdist.DistBackendError is tdist.DistBackendError
    assert rpcdist.DistNetworkError is tdist.DistNetworkError
    assert rpcdist.DistStoreError is tdist.DistStoreError
    assert rpcdist.QueueEmptyError is tdist.QueueEmptyError
    assert issubclass(StoreError, tdist.DistStoreError)
    assert issubclass(StoreTimeoutError, tdist.DistStoreError) and issubclass(StoreTimeoutError, TimeoutError)
    assert issubclass(StoreValueError, tdist.DistStoreError) and issubclass(StoreValueError, ValueError)
    assert issubclass(StoreConnectionError, tdist.DistNetworkError)
    assert issubclass(WorkerUnavailableError, tdist.DistNetworkError)
    assert issubclass(UnknownWorkerError, tdist.DistNetworkError)
    assert issubclass(UnknownWorkerError, ValueError)
    assert issubclass(rpcdist.DistributedError, tdist.DistBackendError)
    assert issubclass(rpcdist.CollectiveTimeoutError, tdist.DistBackendError)
    assert issubclass(rpcdist.CollectiveTimeoutError, TimeoutError)
    for cls in (StoreError, WorkerUnavailableError, rpcdist.DistributedError):  # still ours, as before
        assert issubclass(cls, rpcdist.RpcdistError) and issubclass(cls, RuntimeError)


def test_dist_store_error_catches_rpcdist_store_timeouts() -> None:
    store = HashStore(timeout=0.05)
    try:
        with pytest.raises(tdist.DistStoreError):
            store.get("missing")
        try:
            store.wait(["missing"], timeout=0.05)
        except tdist.DistStoreError as exc:  # as a torch program would write it
            assert isinstance(exc, StoreTimeoutError)
        else:
            raise AssertionError("wait did not time out")
    finally:
        store.close()


def test_tcp_store_unreachable_is_a_dist_network_error() -> None:
    with pytest.raises(tdist.DistNetworkError) as info:
        TCPStore(HOST, free_port(), timeout=timedelta(seconds=1))
    assert isinstance(info.value, StoreConnectionError)
    assert "connect to" in str(info.value)


def test_tcp_store_port_in_use_is_a_dist_network_error() -> None:
    master = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    try:
        with pytest.raises(tdist.DistNetworkError):
            TCPStore(HOST, master.port, is_master=True, wait_for_workers=False, timeout=2)
    finally:
        master.close()


# ============================================================================ several processes
def _sync(store: Store, name: str, rank: int, world_size: int) -> None:
    store.set(f"{name}/{rank}", b"1")
    store.wait([f"{name}/{r}" for r in range(world_size)], timedelta(seconds=60))


def tcp_store_group(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> dict[str, Any]:
    """Rank 0 serves a TCPStore on an ephemeral port (published through a file), every rank
    uses it through rpcdist.TCPStore."""
    port_file = Path(workdir) / "tcp-store-port"
    if rank == 0:
        store = TCPStore(HOST, 0, world_size, True, timedelta(seconds=60), wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 did not publish the store's port")
            time.sleep(0.05)
        store = TCPStore(HOST, int(port_file.read_text()), world_size, False, timedelta(seconds=60))
    others = [r for r in range(world_size) if r != rank]

    with check("set_get"):
        store.set(f"hello/{rank}", f"from {rank}".encode())
        for r in range(world_size):
            assert store.get(f"hello/{r}") == f"from {r}".encode()  # waits for the key

    with check("add"):
        mine = [store.add("counter", 1) for _ in range(10)]
        assert mine == sorted(mine) and len(set(mine)) == 10
        _sync(store, "added", rank, world_size)
        assert int(store.get("counter")) == 10 * world_size
        assert store.add("counter", 0) == 10 * world_size

    with check("compare_set") as elected:
        won = store.compare_set("leader", "", str(rank))  # one rank wins, every rank sees it
        store.set(f"saw/{rank}", won)
        _sync(store, "elected", rank, world_size)
        seen = {store.get(f"saw/{r}") for r in range(world_size)}
        assert len(seen) == 1 and int(seen.pop()) in range(world_size)
        assert store.compare_set("leader", "not-the-value", "x") == won  # unchanged
        elected.value = won.decode()

    with check("wait_timeout"):
        start = time.monotonic()
        with pytest.raises(tdist.DistStoreError) as info:
            store.wait(["never"], timedelta(seconds=0.5))
        assert isinstance(info.value, StoreTimeoutError) and "never" in str(info.value)
        assert time.monotonic() - start >= 0.4
        store.set_timeout(timedelta(seconds=0.3))  # torch's way to bound get
        with pytest.raises(tdist.DistStoreError):
            store.get("never")
        store.set_timeout(timedelta(seconds=60))

    with check("wait_released_by_another_process"):
        if rank == world_size - 1:
            _sync(store, "before-late", rank, world_size)
            time.sleep(0.3)
            store.set("late", b"now")
        else:
            _sync(store, "before-late", rank, world_size)
            store.wait(["late"], timedelta(seconds=30))
            assert store.get("late") == b"now"

    with check("num_keys_delete_key"):
        _sync(store, "quiet", rank, world_size)  # nobody sets keys while rank 0 counts
        if rank == 0:
            before = store.num_keys()
            store.set("temp", b"1")
            assert store.num_keys() == before + 1
            assert store.check(["temp"])
            assert store.delete_key("temp") is True
            assert store.delete_key("temp") is False
            assert not store.check(["temp"])
            assert store.num_keys() == before
            store.set("counted", b"1")
        store.wait(["counted"], timedelta(seconds=30))

    with check("async_api"):

        async def exchange() -> list[bytes]:
            await store.set_async(f"async/{rank}", str(rank))
            # every rank's key, waited for concurrently through one client
            return list(await asyncio.gather(*(store.get_async(f"async/{r}", 30) for r in others)))

        got = asyncio.run(exchange())
        assert got == [str(r).encode() for r in others]

    # The master's server lives as long as its store: rank 0 closes last.
    store.set(f"done/{rank}", b"1")
    if rank == 0:
        store.wait([f"done/{r}" for r in range(world_size)], timedelta(seconds=60))
    store.close()
    return {"port": int(port_file.read_text())}


def unknown_worker_is_dist_network_error(rank: int, world_size: int, init_method: str, **_: Any) -> str:
    """A real RPC call to a worker nobody has: rpcdist's error, caught as torch's."""
    import rpcdist.rpc as rpc

    rpc.init_rpc(
        "solo",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.RpcBackendOptions(init_method=init_method, store_timeout=60.0),
    )
    caught = ""
    try:
        with check("caught_as_dist_network_error"):
            try:
                rpc.rpc_sync("nobody", torch.add, args=(torch.ones(1), 1))
            except tdist.DistNetworkError as exc:  # as a torch program would write it
                assert isinstance(exc, WorkerUnavailableError)
                caught = type(exc).__name__
            else:
                raise AssertionError("rpc_sync to an unknown worker did not raise")
    finally:
        rpc.shutdown()
    return caught


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for fn in (tcp_store_group, unknown_worker_is_dist_network_error):
        setattr(rpc_scenarios, fn.__name__, fn)


_register()
SCENARIO_PARAMS = {"scenarios_module": ImportInWorker("test_tcp_store")}


@pytest.mark.timeout(240)
def test_tcp_store_shared_by_processes(tmp_path: Path) -> None:
    world = 3
    run = run_group(tmp_path, "tcp_store_group", world, "file", params=SCENARIO_PARAMS, timeout=200)
    names = [
        "set_get",
        "add",
        "compare_set",
        "wait_timeout",
        "wait_released_by_another_process",
        "num_keys_delete_key",
        "async_api",
    ]
    for rank in range(world):
        for name in names:
            run.check(name, rank=rank)
    assert len({run.check("compare_set", rank=r) for r in range(world)}) == 1  # one leader for all
    assert {run.value(rank=r)["port"] for r in range(world)} != {0}
    run.assert_clean_exit()


@pytest.mark.timeout(180)
def test_worker_unavailable_is_caught_as_dist_network_error(tmp_path: Path) -> None:
    run = run_group(
        tmp_path, "unknown_worker_is_dist_network_error", 1, "tcp", params=SCENARIO_PARAMS, timeout=150
    )
    run.check("caught_as_dist_network_error")
    assert run.value() == "UnknownWorkerError"
    run.assert_clean_exit()
