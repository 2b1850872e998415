"""The durable store (``rpcdist-server --data-dir``): nothing acknowledged is lost to ``kill -9``.

Real server processes are SIGKILLed under write load and restarted on the same port and data
directory; clients reconnect on their own and retried adds apply once. The log's torn tail,
corruption, compaction and group commit are checked in-process.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from rpcdist.errors import StoreConnectionError, StoreError, StoreTimeoutError
from rpcdist.security import Security, read_job_token
from rpcdist.store import GrpcStore, KeyValueState, StoreServer
from rpcdist.store import durable as durable_module
from rpcdist.store.durable import DurableKeyValueState, log_path
from rpcdist.store.memory import MAX_REQUESTS_PER_CLIENT, RequestId
from rpcdist.store.service import StoreServicer
from rpcdist.v1 import store_pb2, store_pb2_grpc

HOST = "127.0.0.1"
START_TIMEOUT = 30.0  # seconds a server process may take to start (it imports torch)


# -- server processes --------------------------------------------------------------------------
def server_command() -> list[str]:
    script = Path(sys.executable).with_name("rpcdist-server")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "rpcdist.programs.server"]


class ServerProcess:
    """One rpcdist-server process; its stderr goes to a file."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr: Path) -> None:
        self.proc = proc
        self.port = port
        self.stderr = stderr

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator:
    """Starts rpcdist-server processes (``start(*args, port=0)``); kills any left at the end."""
    started: list[ServerProcess] = []

    def start(*args: str, port: int = 0, cwd: Path | None = None) -> ServerProcess:
        stderr = tmp_path / f"server-{len(started)}.err"
        with stderr.open("wb") as err:
            proc = subprocess.Popen(
                [*server_command(), "--host", HOST, "--port", str(port), "--log-level", "INFO", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=cwd,
            )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("rpcdist-server listening on "):
            proc.kill()
            proc.wait(30)
            raise AssertionError(
                f"rpcdist-server did not start ({line!r}, exit {proc.returncode}):\n{stderr.read_text()}"
            )
        server = ServerProcess(proc, int(line.strip().rsplit(":", 1)[1]), stderr)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition()`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def read_all(store: GrpcStore, keys: list[str]) -> dict[str, bytes]:
    values: dict[str, bytes] = {}
    for i in range(0, len(keys), 200):
        chunk = keys[i : i + 200]
        got = await asyncio.gather(*(store.get_async(k, timeout=5) for k in chunk))
        values.update(zip(chunk, got, strict=True))
    return values


# -- kill -9 under load --------------------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_kill9_under_write_load_loses_no_acknowledged_write(servers, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # A small log limit, so that snapshots are taken (and possibly cut short) under the load.
    args = ("--data-dir", str(data), "--wal-max-bytes", "32768")
    server = await asyncio.to_thread(servers, *args)
    port = server.port
    store = GrpcStore(HOST, port, timeout=60)  # long enough to ride out the restart, even under load
    acked: dict[str, bytes] = {}
    add_results: list[int] = []
    stop = asyncio.Event()

    async def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            key, value = f"w{w}/{i}", f"value {w}.{i} ".encode() * (1 + i % 7)
            await store.set_async(key, value)
            acked[key] = value  # acknowledged: must survive
            add_results.append(await store.add_async("counter", 1))
            i += 1

    writers = [asyncio.create_task(writer(w)) for w in range(12)]
    try:
        await until(lambda: len(acked) >= 400, 60, "writes before the kill")
        server.kill9()  # mid-load: every writer has an operation in flight
        at_kill = len(acked)
        await asyncio.sleep(0.3)
        server = await asyncio.to_thread(servers, *args, port=port)
        await until(lambda: len(acked) >= at_kill + 400, 60, "writes after the restart")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*writers), 30)
    finally:
        stop.set()
        for task in writers:
            task.cancel()
        await store.close_async()

    # What was written after the restart must survive a second kill as well.
    server.kill9()
    server = await asyncio.to_thread(servers, *args, port=port)
    check = GrpcStore(HOST, port, timeout=30)
    try:
        assert await read_all(check, list(acked)) == acked
        # Every acknowledged add counted exactly once (retried adds were not applied twice).
        assert int(await check.get_async("counter")) == len(add_results)
        assert sorted(add_results) == list(range(1, len(add_results) + 1))
        assert await check.num_keys_async() == len(acked) + 1
    finally:
        await check.close_async()
    assert server.stop() == 0
    assert len(list(data.glob("wal-*.log"))) == 1  # compacted at every start


# -- clients across a restart --------------------------------------------------------------------
def raw_add(port: int, request: store_pb2.AddRequest) -> int:
    """One Add RPC, exactly as given (no client-side retry), with the token the server left for
    this user's processes (a server on loopback makes one)."""
    metadata = Security(token=read_job_token(port)).metadata()
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        return store_pb2_grpc.StoreStub(channel).Add(request, timeout=30, metadata=metadata).value


@pytest.mark.timeout(60)
async def test_clients_wait_for_a_restarted_server_within_their_timeout(servers, tmp_path: Path) -> None:
    args = ("--data-dir", str(tmp_path / "data"))
    server = await asyncio.to_thread(servers, *args)
    port = server.port
    patient = GrpcStore(HOST, port, timeout=30)
    hasty = GrpcStore(HOST, port, timeout=1.0)
    try:
        await patient.set_async("before", b"1")
        assert await hasty.get_async("before") == b"1"
        # An add whose reply is lost and that is retried after the restart: applied once.
        request = store_pb2.AddRequest(
            key="n", amount=5, client_id=uuid.uuid4().bytes, request_seq=7, low_seq=7
        )
        assert await asyncio.to_thread(raw_add, port, request) == 5

        server.kill9()
        # Issued while the server is down: they complete once it is back.
        got = asyncio.create_task(patient.get_async("before"))
        waited = asyncio.create_task(patient.wait_async(["made-after"], timeout=30))
        added = asyncio.create_task(patient.add_async("n", 1))
        # Too short a timeout: a clear error, soon, not a hang.
        started = time.monotonic()
        with pytest.raises((StoreConnectionError, StoreTimeoutError)):
            await hasty.set_async("lost", b"x")
        with pytest.raises((StoreConnectionError, StoreTimeoutError)):
            await hasty.get_async("before", timeout=0.5)
        assert time.monotonic() - started < 10
        assert not (got.done() or waited.done() or added.done())

        server = await asyncio.to_thread(servers, *args, port=port)
        assert await asyncio.wait_for(got, 30) == b"1"
        assert await asyncio.wait_for(added, 30) == 6
        await patient.set_async("made-after", b"y")
        await asyncio.wait_for(waited, 30)
        assert await asyncio.to_thread(raw_add, port, request) == 5  # remembered across kill -9
        assert await patient.get_async("n") == b"6"
        assert await hasty.get_async("made-after") == b"y"  # the short-timeout client works again
        assert not await patient.check_async(["lost"])
    finally:
        await patient.close_async()
        await hasty.close_async()
    assert server.stop() == 0


@pytest.mark.timeout(60)
async def test_without_data_dir_nothing_is_written_and_kill9_loses_keys(servers, tmp_path: Path) -> None:
    """The in-memory server writes no file; the harness above would notice lost keys."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    server = await asyncio.to_thread(servers, cwd=cwd)
    port = server.port
    store = GrpcStore(HOST, port, timeout=30)
    try:
        await asyncio.gather(*(store.set_async(f"k{i}", b"v") for i in range(50)))
        assert await store.add_async("n", 2) == 2
        server.kill9()
        server = await asyncio.to_thread(servers, port=port, cwd=cwd)
        assert await store.num_keys_async() == 0  # reconnected, to an empty store
    finally:
        await store.close_async()
    assert server.stop() == 0
    assert list(cwd.iterdir()) == []


class LosesReplies(StoreServicer):
    """Applies each Add, then fails it as a broken connection would (the first ``lose`` times)."""

    def __init__(self, state: KeyValueState, lose: int) -> None:
        super().__init__(state)
        self.lose = lose
        self.calls = 0

    async def Add(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.AddResponse:
        self.calls += 1
        reply = await super().Add(raw, context)
        if self.lose > 0:
            self.lose -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost (simulated)")
        return reply


@pytest.mark.timeout(30)
async def test_retried_add_is_applied_once() -> None:
    state = KeyValueState()
    servicer = LosesReplies(state, lose=2)
    server = grpc.aio.server()
    servicer.add_to_server(server)
    port = server.add_insecure_port(f"{HOST}:0")
    await server.start()
    store = GrpcStore(HOST, port, timeout=10)
    try:
        assert await store.add_async("n", 3) == 3  # tried three times
        assert servicer.calls == 3
        assert state.get_nowait("n") == b"3"
        assert await store.add_async("n", 4) == 7
        # Without a request id the same lost reply would have added twice.
        servicer.lose = 1
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Add(store_pb2.AddRequest(key="n", amount=1), timeout=10)
            assert (await stub.Add(store_pb2.AddRequest(key="n", amount=1), timeout=10)).value == 9
    finally:
        await store.close_async()
        await server.stop(0)


def test_remembered_adds_stay_bounded() -> None:
    state = KeyValueState()
    client = uuid.uuid4().bytes
    for seq in range(1, 1001):  # one add in flight at a time: earlier results are forgotten
        state.add("n", 1, RequestId(client, seq, seq))
    assert state.requests()[client] == {1000: ("n", 1000)}
    assert state.add("n", 1, RequestId(client, 1000, 1000)) == 1000  # a retry
    for seq in range(1001, 1001 + MAX_REQUESTS_PER_CLIENT + 10):  # a client that never says
        state.add("n", 1, RequestId(client, seq, 0))
    assert len(state.requests()[client]) == MAX_REQUESTS_PER_CLIENT


# -- the log: torn tail, corruption, compaction, group commit ------------------------------------
def write_keys(directory: Path, values: dict[str, bytes], **options: int) -> None:
    """Open the durable state in ``directory``, set ``values`` one by one, close it."""

    async def run() -> None:
        state = DurableKeyValueState.open(directory, **options)
        try:
            for key, value in values.items():
                state.set(key, value)
                await state.flushed()
        finally:
            await state.close()

    asyncio.run(run())


def newest_log(directory: Path) -> Path:
    return max(directory.glob("wal-*.log"))


async def recover(directory: Path) -> dict[str, bytes]:
    """What a fresh start recovers from ``directory``."""
    state = DurableKeyValueState.open(directory)
    await state.close()
    return state.snapshot()


def recovered(directory: Path) -> dict[str, bytes]:
    return asyncio.run(recover(directory))


@pytest.mark.parametrize("tail", ["partial-record", "garbage", "zeros", "cut-last-record"])
def test_torn_tail_is_ignored(tmp_path: Path, tail: str) -> None:
    values = {f"k{i}": f"value-{i}".encode() * 5 for i in range(20)}
    write_keys(tmp_path, values)
    log = newest_log(tmp_path)
    expected = dict(values)
    with log.open("r+b") as f:
        if tail == "partial-record":  # a header promising 100 bytes, 10 of them written
            f.seek(0, os.SEEK_END)
            f.write((100).to_bytes(4, "little") + b"\x12\x34\x56\x78" + b"S" * 10)
        elif tail == "garbage":
            f.seek(0, os.SEEK_END)
            f.write(b"\xff" * 13)
        elif tail == "zeros":  # blocks allocated but never written
            f.seek(0, os.SEEK_END)
            f.write(bytes(4096))
        else:  # the last record written only in part
            f.truncate(log.stat().st_size - 3)
            del expected["k19"]
    assert recovered(tmp_path) == expected
    # The next start begins a fresh log; the state keeps growing and surviving.
    write_keys(tmp_path, {"after": b"1"})
    assert recovered(tmp_path) == {**expected, "after": b"1"}


def test_corruption_before_the_tail_names_file_and_offset(tmp_path: Path) -> None:
    write_keys(tmp_path, {"a": b"1" * 50, "b": b"2" * 50, "c": b"3" * 50})
    log = newest_log(tmp_path)
    blob = bytearray(log.read_bytes())
    blob[8 + 8 + 10] ^= 0x01  # a payload byte of the first record (8-byte file header, 8-byte record header)
    log.write_bytes(bytes(blob))
    with pytest.raises(StoreError, match=rf"corrupt write-ahead log {log}.* at offset 8: CRC32 mismatch"):
        DurableKeyValueState.open(tmp_path)
    snapshot = tmp_path / "snapshot"
    log.unlink()
    snapshot.write_bytes(snapshot.read_bytes()[:-1] + b"X")
    with pytest.raises(StoreError, match="snapshot .* is corrupt"):
        DurableKeyValueState.open(tmp_path)


def test_corrupt_data_dir_stops_the_program(tmp_path: Path) -> None:
    write_keys(tmp_path, {"a": b"1" * 50, "b": b"2" * 50})
    log = newest_log(tmp_path)
    blob = bytearray(log.read_bytes())
    blob[20] ^= 0xFF
    log.write_bytes(bytes(blob))
    proc = subprocess.run(
        [*server_command(), "--port", "0", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "listening" not in proc.stdout
    assert f"corrupt write-ahead log {log}" in proc.stderr and "at offset 8" in proc.stderr


def test_data_dir_is_used_by_one_server_at_a_time(tmp_path: Path) -> None:
    async def run() -> None:
        first = DurableKeyValueState.open(tmp_path)
        try:
            with pytest.raises(StoreError, match="in use by another server"):
                DurableKeyValueState.open(tmp_path)
        finally:
            await first.close()
        second = DurableKeyValueState.open(tmp_path)  # free again
        await second.close()

    asyncio.run(run())


@pytest.mark.timeout(60)
async def test_snapshots_keep_the_log_bounded_and_state_survives(tmp_path: Path) -> None:
    limit = 8192
    server = await StoreServer.start(HOST, 0, data_dir=tmp_path, wal_max_bytes=limit)
    store = GrpcStore(HOST, server.port, timeout=30)
    expected: dict[str, bytes] = {}
    written = largest = 0
    try:
        for round_ in range(60):
            batch = {f"key{i}": f"{round_}:{i}:".encode() * 20 for i in range(round_ % 5, 100, 5)}
            await asyncio.gather(*(store.set_async(k, v) for k, v in batch.items()))
            expected.update(batch)
            written += sum(len(k) + len(v) for k, v in batch.items())
            assert await store.add_async("count", 1) == round_ + 1
            logs = sum(p.stat().st_size for p in tmp_path.glob("wal-*.log"))
            largest = max(largest, logs)
        expected["count"] = b"60"
        state = server.state
        assert isinstance(state, DurableKeyValueState)
        snapshot_size = (tmp_path / "snapshot").stat().st_size
        assert state.snapshots >= 4
        # Never more than about one log's worth (the limit, or the snapshot size if larger), twice.
        assert largest < 2 * max(limit, snapshot_size) + 8192, (largest, snapshot_size, written)
        assert written > 5 * largest
    finally:
        await store.close_async()
        await server.stop()
    assert await recover(tmp_path) == expected


async def test_concurrent_writers_share_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: writers arriving while a sync runs all go out with the next one."""
    real = durable_module._fdatasync

    def slow_sync(fd: int) -> None:
        time.sleep(0.02)
        real(fd)

    monkeypatch.setattr(durable_module, "_fdatasync", slow_sync)
    state = DurableKeyValueState.open(tmp_path)
    try:
        wal = state.wal
        assert wal is not None

        async def write(i: int) -> None:
            state.set(f"k{i}", b"v")
            await state.flushed()

        started = time.monotonic()
        await asyncio.gather(*(write(i) for i in range(200)))
        assert wal.records == 200
        assert wal.syncs <= 3, wal.syncs
        assert time.monotonic() - started < 2
        # A read waits until what it could see is on disk.
        state.set("late", b"1")
        assert wal.records == 200
        await state.flushed()
        assert wal.records == 201
    finally:
        await state.close()
    assert [p.name for p in tmp_path.glob("wal-*.log")] == [log_path(tmp_path, 0).name]
    assert (await recover(tmp_path))["k199"] == b"v"


async def test_logs_kept_when_snapshots_fail_are_all_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the log was rotated but before its snapshot: every log is replayed."""
    state = DurableKeyValueState.open(tmp_path, wal_max_bytes=1024)

    def disk_full(directory: Path, image: object) -> int:
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(durable_module, "_write_snapshot", disk_full)
    expected = {f"k{i}": bytes([65 + i % 26]) * 100 for i in range(60)}
    try:
        for key, value in expected.items():
            state.set(key, value)
            await state.flushed()
    finally:
        await state.close()
    monkeypatch.undo()
    logs = sorted(tmp_path.glob("wal-*.log"))
    assert len(logs) >= 3
    assert await recover(tmp_path) == expected

    # A log missing from the middle of the sequence is an error, not a silent loss.
    expected["k0"] = b"new"
    state = DurableKeyValueState.open(tmp_path, wal_max_bytes=1024)
    monkeypatch.setattr(durable_module, "_write_snapshot", disk_full)
    try:
        for i in range(30):
            state.set("k0", b"new" + bytes(1000 * (i < 29)))
            await state.flushed()
    finally:
        await state.close()
    monkeypatch.undo()
    logs = sorted(tmp_path.glob("wal-*.log"))
    assert len(logs) >= 3
    logs[1].unlink()
    with pytest.raises(StoreError, match=rf"write-ahead log {logs[1]} is missing"):
        DurableKeyValueState.open(tmp_path)
