"""TLS and mTLS: a store and a group of workers that verify every peer against the job's CA.

Certificates are made at test time (``_tls.make_pki``): a CA with server/client certificates
for 127.0.0.1/localhost, an expired one, and one from another CA. Plaintext clients, clients
without a certificate, with an expired one or one from another CA, and clients that do not
trust the server's CA are all refused with a clear error; members with the right files work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from _harness import HOST, GroupRun, InitMethod, Launch, ProcSpec
from _tls import make_pki
from test_durable_store import servers  # noqa: F401 - the rpcdist-server fixture

from rpcdist.errors import AuthenticationError, StoreConnectionError
from rpcdist.security import REFUSED, Security, read_job_token
from rpcdist.store import GrpcStore, StoreServer

EXCHANGE = "/rpcdist.v1.Agent/Exchange"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client(pki: dict[str, str], who: str, ca: str = "ca", token: str | None = "tok") -> Security:
    cert, key = (pki[f"{who}_cert"], pki[f"{who}_key"]) if who else (None, None)
    return Security(token=token, tls_cert=cert, tls_key=key, tls_ca=pki[ca] if ca else None)


@pytest.mark.timeout(120)
def test_store_with_mtls_admits_members_only(pki: dict[str, str]) -> None:
    async def run() -> dict[str, str]:
        server = await StoreServer.start(HOST, 0, security=_client(pki, "server"))
        outcomes: dict[str, str] = {}
        try:
            member = GrpcStore(HOST, server.port, timeout=10, security=_client(pki, "client"))
            await member.set_async("k", b"v")
            outcomes["member"] = (await member.get_async("k")).decode()
            await member.close_async()
            refused = {
                "plaintext": Security(token="tok"),
                "no_client_cert": _client(pki, "", "ca"),
                "expired_cert": _client(pki, "expired"),
                "other_ca_cert": _client(pki, "foreign"),
                "distrusts_server": _client(pki, "client", ca="other_ca"),
            }
            for label, security in refused.items():
                client = GrpcStore(HOST, server.port, timeout=5, connect_timeout=1, security=security)
                try:
                    await client.set_async("k", b"evil")
                    outcomes[label] = "accepted"
                except StoreConnectionError as exc:
                    outcomes[label] = str(exc)
                finally:
                    await client.close_async()
            outcomes["value_after"] = server.state.get_nowait("k").decode()
        finally:
            await server.stop()
        return outcomes

    outcomes = asyncio.run(run())
    assert outcomes.pop("member") == "v"
    assert outcomes.pop("value_after") == "v", "a refused client changed the store"
    for label, message in outcomes.items():
        assert "unreachable" in message and "UNAVAILABLE" in message, f"{label}: {message}"
    assert "RPCDIST_TLS_CA" in outcomes["plaintext"]  # says what the plaintext client lacks


# -- a group over TLS ---------------------------------------------------------------------------
def _tls_env(pki: dict[str, str]) -> dict[str, str]:
    # Each worker is both a server and a client: one certificate serves both ends.
    return {
        "RPCDIST_TLS_CERT": pki["server_cert"],
        "RPCDIST_TLS_KEY": pki["server_key"],
        "RPCDIST_TLS_CA": pki["ca"],
    }


async def _exchange_status(address: str, security: Security) -> str:
    """Open an Exchange stream to a worker and say nothing; the status it ends with."""
    async with security.channel(address) as channel:
        call = channel.stream_stream(EXCHANGE, request_serializer=None, response_deserializer=None)(
            metadata=security.metadata()
        )
        with contextlib.suppress(Exception):  # a stream refused at once cannot even be closed
            await call.done_writing()
        return (await asyncio.wait_for(call.code(), 30)).name


def _tcp_attempt(address: str, context: ssl.SSLContext | None, hello: bytes) -> str:
    """Connect to a worker's framed TCP port (over TLS with ``context``), send ``hello``; what
    came back before it closed."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            sock.sendall(hello)
            return sock.recv(8).decode(errors="replace") or "closed"
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}"


@pytest.fixture(scope="module", params=["grpc", "tcp"])
def tls_group(
    request: pytest.FixtureRequest, pki: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[GroupRun, dict[str, Any]]:
    transport = request.param
    workdir = tmp_path_factory.mktemp(f"tls-{transport}")
    init = InitMethod("env", workdir)
    init.env.update(_tls_env(pki))
    launch = Launch(workdir, init)
    opts = {"transport": transport, "shm_threshold_bytes": 0}  # no shared memory: network links
    for rank in range(2):
        launch.start(ProcSpec("security_member", rank, 2, opts))
    member = _client(pki, "client", token=None)
    out: dict[str, Any] = {}
    try:
        store = GrpcStore(HOST, init.port, timeout=60, security=member)
        try:
            store.wait(["rpc/address/0", "rpc/address/1"])
            card = json.loads(store.get("rpc/address/1"))
            token = read_job_token(init.port)
            out["member"] = asyncio.run(_exchange_status(card["address"], member.with_token(token)))
            out["plaintext"] = asyncio.run(_exchange_status(card["address"], Security(token=token)))
            out["other_ca"] = asyncio.run(
                _exchange_status(card["address"], _client(pki, "foreign", token=token))
            )
            if card["tcp"]:
                tls = member.ssl_context(server_side=False)
                out["tcp_plaintext"] = _tcp_attempt(card["tcp"], None, member.with_token(token).hello())
                out["tcp_wrong_token"] = _tcp_attempt(card["tcp"], tls, Security(token="x").hello())
                out["tcp_member"] = _tcp_attempt(card["tcp"], tls, member.with_token(token).hello())
            store.set("security/attacked", b"1")
        finally:
            store.close()
    except BaseException:
        launch.kill_all()
        raise
    return launch.finish(timeout=120), out


@pytest.mark.timeout(240)
def test_group_over_mtls(tls_group: Any) -> None:
    run, out = tls_group
    transport = run.outcomes[0].spec.params["transport"]
    assert run.check("members_keep_working", rank=0) == ["w1", [2.0, 2.0]], run.report()
    assert run.check("members_keep_working", rank=1) == ["w0"], run.report()
    expected_link = {"grpc": "GrpcLink", "tcp": "TcpLink"}[transport]
    for rank in range(2):
        value = run.value(rank)
        assert value["tls"] and value["token"], value
        assert set(value["links"].values()) == {expected_link}, value
    assert out["member"] == "OK"  # the right certificate and token: the stream is served
    assert out["plaintext"] == "UNAVAILABLE"  # no TLS handshake, no stream
    assert out["other_ca"] == "UNAVAILABLE"
    if transport == "tcp":
        assert out["tcp_plaintext"] in ("closed", "ConnectionResetError"), out
        assert out["tcp_wrong_token"] == REFUSED.decode(), out
        assert out["tcp_member"] == "RPCD-OK\x00", out


# -- the program --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_rpcdist_server_takes_a_token_file_and_tls_files(
    request: pytest.FixtureRequest, pki: dict[str, str], tmp_path: Path
) -> None:
    start_server = request.getfixturevalue("servers")  # test_durable_store's rpcdist-server processes
    token_file = tmp_path / "token"
    token_file.write_text("server-token-123\n")
    token_file.chmod(0o600)
    flags = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"]]
    server = await asyncio.to_thread(start_server, "--auth-token-file", str(token_file), *flags)
    member = GrpcStore(
        HOST, server.port, timeout=10, security=_client(pki, "client", token="server-token-123")
    )
    guesser = GrpcStore(HOST, server.port, timeout=10, security=_client(pki, "client", token="guess"))
    try:
        await member.set_async("k", b"v")
        with pytest.raises(AuthenticationError, match="refused Get"):
            await guesser.get_async("k")
        assert await member.get_async("k") == b"v"
    finally:
        await member.close_async()
        await guesser.close_async()
    assert server.stop() == 0
    log = server.stderr.read_text()
    assert "TLS, token required" in log
    assert "server-token-123" not in log and "guess" not in log
