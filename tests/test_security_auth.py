"""Outsiders get nothing from a job: no call runs, no store key is read, written or deleted,
nobody joins, another user cannot even reach the sockets, and the members keep working.

One group of two workers (rank 0 serves the store, on loopback, with no token configured: the
job generates its own) is attacked from the test process with hand-written clients: a gRPC
client without or with a wrong token, raw bytes on the Unix socket, a store client with a wrong
token, and a process running as ``nobody``. Each attack that carries a call is paired with
the same bytes sent *with* the job's token, which must run (so the refusal is what stopped it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from _harness import HOST, GroupRun, Launch, ProcSpec, free_port

from rpcdist import rendezvous as rdv
from rpcdist import serialization
from rpcdist.errors import AuthenticationError
from rpcdist.rpc import RpcBackendOptions
from rpcdist.security import (
    ACCEPTED,
    REFUSED,
    Security,
    job_token_path,
    private_directory,
    publish_job_token,
    read_job_token,
)
from rpcdist.store import GrpcStore, StoreServer
from rpcdist.transport import frames
from rpcdist.v1 import store_pb2, store_pb2_grpc

EXCHANGE = "/rpcdist.v1.Agent/Exchange"
REFUSAL_WAIT = 3.0  # seconds a refused stream takes at most to end, before anything is sent


def _call_frame(marker: Path) -> bytes:
    """A complete REQUEST frame asking the callee to run ``os.mkdir(marker)``."""
    payload, buffers = serialization.dumps((os.mkdir, (str(marker),), {}))
    entries = frames.encode_message(7, frames.REQUEST, payload, buffers, function="os.mkdir", caller_rank=1)
    return b"".join(bytes(piece) for entry in entries for piece in entry)


async def _exchange(address: str, frame: bytes, metadata: tuple[tuple[str, str], ...]) -> str:
    """Send one frame on a fresh Exchange stream; the stream's final status code."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(EXCHANGE, request_serializer=None, response_deserializer=None)(
            metadata=metadata
        )
        # A refusal comes before any message is read: take it before writing, since grpc's
        # aio client reports a write that races the server's early status as INTERNAL
        # instead of that status (grpc/grpc#36066).
        status = asyncio.ensure_future(call.code())
        done, _ = await asyncio.wait([status], timeout=REFUSAL_WAIT)
        if done:
            return status.result().name
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.write(frame)
            await call.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:
                pass
        return (await asyncio.wait_for(status, 30)).name


def _socket_exchange(path: str, hello: bytes, frame: bytes) -> bytes:
    """Raw bytes on a worker's Unix socket: ``hello``, then one length-prefixed frame; returns
    everything the worker answered until it closed (or went quiet)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(hello + len(frame).to_bytes(8, "little") + frame)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
        return answer


def _store_attempts(port: int, metadata: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Every store method from a hand-written client; the status code of each."""
    codes = {}
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        m = metadata
        attempts = {
            "set": lambda: stub.Set(store_pb2.SetRequest(key="rpc/rank/0", value=b"evil"), metadata=m),
            "get": lambda: stub.Get(store_pb2.GetRequest(key="rpc/address/1", timeout_seconds=1), metadata=m),
            "delete": lambda: stub.DeleteKey(store_pb2.DeleteKeyRequest(key="rpc/name/w1"), metadata=m),
            "add": lambda: stub.Add(store_pb2.AddRequest(key="rpc/joined", amount=5), metadata=m),
            "compare_set": lambda: stub.CompareSet(
                store_pb2.CompareSetRequest(key="rpc/rank/1", expected=b"w1", desired=b"evil"), metadata=m
            ),
            "num_keys": lambda: stub.NumKeys(store_pb2.NumKeysRequest(), metadata=m),
            "wait": lambda: stub.Wait(store_pb2.WaitRequest(keys=["x"], timeout_seconds=1), metadata=m),
            "check": lambda: stub.Check(store_pb2.CheckRequest(keys=["rpc/rank/0"]), metadata=m),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
                codes[name] = "OK"
            except grpc.RpcError as exc:
                codes[name] = exc.code().name
    return codes


_AS_NOBODY = r"""
import json, os, socket, sys
unix_path, token_path, probe_path = sys.argv[1:4]
out = {"uid": os.getuid()}
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(unix_path)
    out["connect"] = "connected"
except OSError as exc:
    out["connect"] = type(exc).__name__
for name, path in (("token", token_path), ("shm", probe_path)):
    try:
        open(path, "rb").close()
        out[name] = "opened"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


def _as_nobody(*args: str) -> dict[str, Any] | None:
    """Run the probe above as the user ``nobody`` (the child drops root with setuid); None when
    that is impossible here."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    done = subprocess.run(
        [python, "-c", _AS_NOBODY, *args], user="nobody", capture_output=True, text=True, timeout=60, cwd="/"
    )
    if done.returncode != 0:
        return None  # e.g. the interpreter is not reachable for nobody
    return json.loads(done.stdout)


def _wait_for(path: Path, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    return path.exists()


def _attack(port: int, cards: dict[int, dict[str, str]], markers: Path) -> dict[str, Any]:
    """Every attempt of an outsider against the running group, and its member-side control."""
    token = read_job_token(port)
    assert token, "the job published no token for its store"
    member = Security(token=token)
    outsider, wrong = Security(), Security(token="not-the-token")
    out: dict[str, Any] = {}

    # The store: every method, without and with a wrong token.
    out["store_no_token"] = _store_attempts(port, outsider.metadata())
    out["store_wrong_token"] = _store_attempts(port, wrong.metadata())

    async def store_client_and_join() -> dict[str, str]:
        got = {}
        intruder = GrpcStore(HOST, port, timeout=10, security=wrong, job_token=False)
        try:
            for name, op in {
                "get": lambda: intruder.get_async("rpc/address/1"),
                "set": lambda: intruder.set_async("rpc/rank/0", b"evil"),
                "delete": lambda: intruder.delete_key_async("rpc/name/w1"),
                "join": lambda: rdv.join_group(intruder, "w9", 1, 2, {"address": "127.0.0.1:1"}, 10),
            }.items():
                try:
                    await op()
                    got[name] = "OK"
                except AuthenticationError as exc:
                    got[name] = f"AuthenticationError: {exc}"
        finally:
            await intruder.close_async()
        return got

    out["store_client"] = asyncio.run(store_client_and_join())

    # A call to w1 over its gRPC port: without, with a wrong, and with the job's token.
    grpc_address = cards[1]["address"]
    for label, security in (("none", outsider), ("wrong", wrong), ("member", member)):
        frame = _call_frame(markers / f"grpc-{label}")
        out[f"grpc_{label}"] = asyncio.run(_exchange(grpc_address, frame, security.metadata()))

    # The same call as raw bytes on w1's Unix socket.
    unix_path = cards[1]["unix"]
    for label, hello in (
        ("no_hello", b""),
        ("wrong", wrong.hello()),
        ("member", member.hello()),
    ):
        answer = _socket_exchange(unix_path, hello, _call_frame(markers / f"unix-{label}"))
        out[f"unix_{label}"] = answer[:8].decode(errors="replace")
    out["markers_before_wait"] = sorted(p.name for p in markers.iterdir())
    out["member_calls_ran"] = _wait_for(markers / "grpc-member") and _wait_for(markers / "unix-member")
    out["markers"] = sorted(p.name for p in markers.iterdir())

    # Files: the socket's directory, the token file, a shared-memory probe.
    out["unix_dir_mode"] = stat.S_IMODE(os.stat(os.path.dirname(unix_path)).st_mode)
    out["unix_mode"] = stat.S_IMODE(os.stat(unix_path).st_mode)
    out["token_mode"] = stat.S_IMODE(os.stat(job_token_path(port)).st_mode)
    probe = os.path.join("/dev/shm", cards[1]["shm_probe"])
    out["probe_mode"] = stat.S_IMODE(os.stat(probe).st_mode)
    out["nobody"] = _as_nobody(unix_path, job_token_path(port), probe)
    return out


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> tuple[GroupRun, dict[str, Any], dict[str, bytes]]:
    workdir = tmp_path_factory.mktemp("security")
    markers = workdir / "markers"
    markers.mkdir()
    launch = Launch(workdir, "tcp")
    for rank in range(2):
        launch.start(ProcSpec("security_member", rank, 2))
    port = launch.init.port
    try:
        store = GrpcStore(HOST, port, timeout=60)  # this user's process: reads the job's token
        try:
            store.wait(["rpc/address/0", "rpc/address/1"])
            cards = {r: json.loads(store.get(f"rpc/address/{r}")) for r in range(2)}
            keys_before = {
                k: store.get(k) for k in ("rpc/rank/0", "rpc/rank/1", "rpc/name/w1", "rpc/address/1")
            }
            count_before = store.num_keys()
            results = _attack(port, cards, markers)
            keys_after = {k: store.get(k) for k in keys_before}
            results["store_intact"] = keys_after == keys_before and store.num_keys() == count_before
            store.set("security/attacked", b"1")
        finally:
            store.close()
    except BaseException:
        launch.kill_all()
        raise
    run = launch.finish(timeout=120)
    return run, results, keys_before


@pytest.mark.timeout(240)
def test_store_refuses_outsiders_and_stays_intact(attacked: Any) -> None:
    run, results, keys = attacked
    for attempt in ("store_no_token", "store_wrong_token"):
        codes = results[attempt]
        assert codes and set(codes.values()) == {"UNAUTHENTICATED"}, f"{attempt}: {codes}"
    refused = results["store_client"]
    for name, outcome in refused.items():
        assert outcome.startswith("AuthenticationError"), f"{name}: {outcome}"
        assert "not-the-token" not in outcome
    assert "refused Get" in refused["get"] and "RPCDIST_AUTH_TOKEN" in refused["get"]
    assert results["store_intact"], "an outsider changed the store"
    assert keys["rpc/rank/0"] == b"w0"


@pytest.mark.timeout(240)
def test_calls_without_the_token_run_nothing(attacked: Any) -> None:
    run, results, _ = attacked
    assert results["grpc_none"] == "UNAUTHENTICATED"
    assert results["grpc_wrong"] == "UNAUTHENTICATED"
    assert results["grpc_member"] == "OK"
    assert results["unix_no_hello"] == REFUSED.decode()
    assert results["unix_wrong"] == REFUSED.decode()
    assert results["unix_member"] == ACCEPTED.decode()
    # The same frame sent with the token ran (so the refusals are what stopped the others).
    assert results["member_calls_ran"], results["markers"]
    assert results["markers"] == ["grpc-member", "unix-member"], results["markers"]


@pytest.mark.timeout(240)
def test_members_keep_working_after_the_attacks(attacked: Any) -> None:
    run, _, _ = attacked
    assert run.check("members_keep_working", rank=0) == ["w1", [2.0, 2.0]], run.report()
    assert run.check("members_keep_working", rank=1) == ["w0"], run.report()
    for rank in range(2):
        value = run.value(rank)
        assert value["token"], "the job ran without a token"
        assert set(value["links"].values()) == {"UnixLink"}, value  # co-located: the socket


@pytest.mark.timeout(240)
def test_sockets_and_files_are_owner_only(attacked: Any) -> None:
    _, results, _ = attacked
    assert results["unix_dir_mode"] == 0o700
    assert results["unix_mode"] == 0o600
    assert results["token_mode"] == 0o600
    assert results["probe_mode"] == 0o600
    nobody = results["nobody"]
    if nobody is None:
        pytest.skip("cannot run a process as nobody here (not root, or no such user)")
    assert nobody["uid"] != os.getuid()
    assert nobody == {
        "uid": nobody["uid"],
        "connect": "PermissionError",
        "token": "PermissionError",
        "shm": "PermissionError",
    }


# -- without a group ---------------------------------------------------------------------------
def test_the_token_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    options = RpcBackendOptions(auth_token="s3cret-token-value")
    assert "s3cret-token-value" not in repr(options)
    assert "s3cret-token-value" not in repr(options.security())
    assert options.security().token == "s3cret-token-value"

    async def refused() -> None:
        server = await StoreServer.start(HOST, 0, security=Security(token="s3cret-token-value"))
        client = GrpcStore(
            HOST, server.port, timeout=5, security=Security(token="wrong-guess"), job_token=False
        )
        try:
            with pytest.raises(AuthenticationError, match="refused Set"):
                await client.set_async("k", b"v")
            assert server.state.num_keys() == 0
        finally:
            await client.close_async()
            await server.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(refused())
    assert "refused a call" in caplog.text
    assert "s3cret-token-value" not in caplog.text and "wrong-guess" not in caplog.text


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    monkeypatch.delenv("RPCDIST_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RPCDIST_AUTH_TOKEN_FILE", str(token_file))
    assert Security.resolve().token == "from-file"
    monkeypatch.setenv("RPCDIST_AUTH_TOKEN", "from-env")
    assert Security.resolve().token == "from-env"
    assert RpcBackendOptions(auth_token="explicit").security().token == "explicit"
    assert Security.resolve(auth_token_file=str(token_file)).token == "from-file"
    token_file.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        Security.resolve(auth_token_file=str(token_file))
    with pytest.raises(ValueError, match="tls_key"):
        Security(tls_cert="cert.pem")


def test_job_token_file_is_private_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    publish_job_token(4242, "tok-1")
    assert read_job_token(4242) == "tok-1"
    assert stat.S_IMODE(os.stat(private_directory()).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(job_token_path(4242)).st_mode) == 0o600
    publish_job_token(4242, "tok-2")  # a newer job on the port replaces it
    assert read_job_token(4242) == "tok-2"
    os.chmod(private_directory(), 0o755)  # a directory others can enter is refused
    with pytest.raises(PermissionError, match="not a private directory"):
        job_token_path(4242)


_LAUNCHED_WORKER = r"""
# A hand-written store client (grpc only: no torch to import): SetRequest{key, value} bytes.
import os, sys
import grpc

token = os.environ.get("RPCDIST_AUTH_TOKEN")
assert token, "the launcher gave no token"
with grpc.insecure_channel(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}") as channel:
    set_key = channel.unary_unary("/rpcdist.v1.Store/Set")
    try:
        set_key(b"\x0a\x04evil\x12\x011", timeout=30)
        sys.exit("the launcher's store accepted a client without the token")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
    set_key(b"\x0a\x02ok\x12\x011", timeout=30, metadata=(("rpcdist-auth", token),))
print("launched worker: refused without the token, served with it")
"""


@pytest.mark.timeout(120)
def test_a_standalone_launch_guards_its_store(tmp_path: Path) -> None:
    """rpcdist-run --standalone makes a token for its run: its workers get it, and its store
    refuses whoever has not."""
    program = tmp_path / "worker.py"
    program.write_text(_LAUNCHED_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDIST_AUTH")}
    done = subprocess.run(
        [sys.executable, "-m", "rpcdist.run", "--standalone", "--nproc-per-node", "1", str(program)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused without the token, served with it" in done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_init_process_group_takes_the_token() -> None:
    """The collectives' own agent and store use ``init_process_group(auth_token=...)``."""
    import rpcdist
    from rpcdist.collectives import group

    port = free_port()
    rpcdist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{port}", rank=0, world_size=1, auth_token="pg-token-42"
    )
    try:
        state = group._state
        assert state is not None and state.agent.transport.security.token == "pg-token-42"

        async def probe() -> int:
            outsider = GrpcStore(HOST, port, timeout=5, security=Security(), job_token=False)
            member = GrpcStore(HOST, port, timeout=5, security=Security(token="pg-token-42"))
            try:
                with pytest.raises(AuthenticationError):
                    await outsider.num_keys_async()
                return await member.num_keys_async()
            finally:
                await outsider.close_async()
                await member.close_async()

        assert asyncio.run(probe()) > 0  # the group's registration keys, read with the token
    finally:
        rpcdist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_stale_job_token_file_is_replaced_and_removed(caplog: pytest.LogCaptureFixture) -> None:
    """A crashed job's token file on the same port does not lock the next job out (a client
    that read it reads the new one once the store serves, so the store refuses nothing and logs
    no refusal); a store removes its own file when it stops, and refusals are quick once
    nothing newer exists."""
    port = free_port()
    publish_job_token(port, "stale-token-of-a-crashed-job")

    async def run() -> None:
        early = GrpcStore(HOST, port, timeout=30)
        pending = asyncio.create_task(early.set_async("k", b"v"))  # waits for the store...
        await asyncio.sleep(0)
        assert early.security.token == "stale-token-of-a-crashed-job"  # ... with the stale token
        server = await StoreServer.start(HOST, port, job_token=True)
        late = GrpcStore(HOST, port, timeout=10)
        wrong = GrpcStore(HOST, port, timeout=30, security=Security(token="nope"))
        try:
            assert read_job_token(port) not in (None, "stale-token-of-a-crashed-job")
            with caplog.at_level(logging.WARNING, logger="rpcdist"):
                await pending
                assert await late.get_async("k") == b"v"
            assert "refused" not in caplog.text, caplog.text
            started = time.monotonic()
            with pytest.raises(AuthenticationError):
                await wrong.get_async("k")
            assert time.monotonic() - started < 20  # at once, not after the timeouts
        finally:
            for client in (early, late, wrong):
                await client.close_async()
            await server.stop()
        assert read_job_token(port) is None

    asyncio.run(run())


async def test_a_worker_names_every_address_it_listens_on(caplog: pytest.LogCaptureFixture) -> None:
    from rpcdist.transport.endpoint import Transport

    transport = Transport(
        "w-listening",
        handler=None,  # type: ignore[arg-type] - nothing connects in this test
        make_session=None,  # type: ignore[arg-type]
        tcp_links=True,
        heartbeat_interval=0,
        security=Security(token="some-token-value"),
    )
    with caplog.at_level(logging.INFO, logger="rpcdist.transport.endpoint"):
        await transport.start(HOST)
    try:
        lines = [r.getMessage() for r in caplog.records if "listens on" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        line = lines[0]
        assert f"gRPC {HOST}:{transport.port} (plaintext)" in line
        assert f"TCP {HOST}:{transport.tcp_port}" in line
        if transport.unix_path:
            assert f"Unix socket {transport.unix_path}" in line
        assert "auth token required" in line and "some-token-value" not in line
    finally:
        await transport.close(graceful=False)
