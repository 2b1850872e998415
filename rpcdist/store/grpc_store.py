"""GrpcStore: the client of the gRPC Store service (``rpcdist-server`` or a StoreServer).

One long-lived ``grpc.aio`` channel per store object, created on first use on the store's loop.
Blocking operations wait on the server: the request carries the timeout, and the call's gRPC
deadline is set a little later so that nothing hangs if the server never answers::

    store = GrpcStore("127.0.0.1", 29500)
    store.set("x", b"1")
    value = store.get("x")

Errors: keys not set in time raise StoreTimeoutError naming them; ``add`` on a non-integer
raises StoreValueError; a server that cannot be reached within ``connect_timeout`` raises
StoreConnectionError saying so.

A server that goes away (restarted, or a connection that broke) is reconnected to, with
backoff, and the operation retried: every operation is safe to retry (``add`` carries a
request id that the server remembers, so a retried add is applied once and returns the first
result). The wait for the server to come back is bounded by ``connect_timeout`` and by the
operation's own limit (``timeout`` for ``get``/``wait``, the store's timeout for the others);
once it passes the operation raises StoreConnectionError, never hanging. Caveats of a retry:
``delete_key`` may then answer False for a key it deleted, and ``get``/``wait`` go on waiting
for the time left.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf.message import Message

from rpcdist._runtime import wait_for
from rpcdist.errors import (
    AuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    StoreValueError,
)
from rpcdist.security import Security, read_job_token
from rpcdist.store.api import DEFAULT_TIMEOUT, Store, to_seconds
from rpcdist.store.memory import INT64_MAX, INT64_MIN
from rpcdist.store.service import MAX_MESSAGE_BYTES, format_address
from rpcdist.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["GrpcStore"]

# How much later than the server-side timeout the client's own gRPC deadline falls.
DEADLINE_SLACK = 2.0

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Workers often start before the store: retry the connection quickly, not with gRPC's
    # default backoff that grows to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Backoff between attempts of an operation whose connection broke (doubling up to the max).
RETRY_BACKOFF = 0.05
RETRY_BACKOFF_MAX = 1.0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class GrpcStore(Store):
    """A client of the Store service at ``host:port``.

    ``timeout`` is the default for ``get``/``wait`` (and bounds every other call, retries
    included); ``connect_timeout`` bounds waiting for the server to accept a connection, at the
    start or after the connection broke (default: the same as ``timeout``, as torch's TCPStore
    client waits). Timeouts ``<= 0`` mean no limit.

    ``security`` gives the token sent with every call and the TLS files (default: from
    ``RPCDIST_AUTH_TOKEN``/``RPCDIST_AUTH_TOKEN_FILE``/``RPCDIST_TLS_*``). ``job_token=True``
    (default: when the store is on loopback) and no token: use the token a single-host job's
    store published for its port in this user's private directory (read again when the store
    refuses it: a restarted store makes a new one).
    A store that refuses the token raises :class:`~rpcdist.errors.AuthenticationError`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        connect_timeout: float | timedelta | None = None,
        *,
        security: Security | None = None,
        job_token: bool | None = None,
    ) -> None:
        super().__init__(timeout)
        self._security = security if security is not None else Security.resolve()
        if job_token is None:  # a process of this user may use its own jobs' stores
            job_token = _is_loopback(host)
        self._job_token = job_token and self._security.token is None
        self._token_proven = False  # a job token the store has accepted once
        self.host = host
        self.port = int(port)
        self.connect_timeout = to_seconds(connect_timeout, self._timeout)
        self._target = format_address(host, self.port)
        self._channel: grpc.aio.Channel | None = None
        self._stub: store_pb2_grpc.StoreStub | None = None
        # Request ids of adds: this client's random id, the next sequence number, and the
        # sequence numbers still awaiting a reply (the lowest is sent along).
        self._client_id = uuid.uuid4().bytes
        self._next_seq = 1
        self._adds_in_flight: set[int] = set()

    @property
    def address(self) -> str:
        """``host:port`` of the store server."""
        return self._target

    # -- channel -------------------------------------------------------------------------------
    async def _connected_stub(self, limit: float | None) -> store_pb2_grpc.StoreStub:
        """The stub, once the channel is connected; waits at most ``limit`` seconds (None: no
        limit), else raises StoreConnectionError."""
        if self._closed:
            raise StoreError(f"this client of the store at {self._target} is closed")
        if self._channel is None or self._stub is None:
            if self._job_token:
                self._security = self._security.with_token(read_job_token(self.port))
            self._channel = self._security.channel(self._target, options=_CHANNEL_OPTIONS)
            self._stub = store_pb2_grpc.StoreStub(self._channel)
        channel = self._channel
        if channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY:
            try:
                await wait_for(channel.channel_ready(), limit)
            except asyncio.TimeoutError:
                hint = "" if self._security.tls else "; if it serves TLS, set RPCDIST_TLS_CA"
                why = await self._why_unconnected(self._stub)
                raise StoreConnectionError(
                    f"the store at {self._target} is unreachable "
                    f"(no connection within {limit or 0:g} s{hint}){why}"
                ) from None
        if self._job_token and not self._token_proven:
            # Read again now that the store serves (it publishes its token first): the file read
            # when the channel was made may have been missing or an earlier job's, and a call
            # with it would be refused (and logged as refused by the store).
            token = read_job_token(self.port)
            if token is not None and token != self._security.token:
                self._security = self._security.with_token(token)
        return self._stub

    async def _why_unconnected(self, stub: store_pb2_grpc.StoreStub) -> str:
        """gRPC's reason for the failed connection (a refused TLS handshake, say), from one try."""
        try:
            await stub.NumKeys(store_pb2.NumKeysRequest(), timeout=1.0, metadata=self._security.metadata())
        except grpc.aio.AioRpcError as exc:
            return f": {exc.code().name}: {exc.details()}"
        return ""

    def _deadline(self, timeout: float) -> float | None:
        return timeout + DEADLINE_SLACK if 0 < timeout < math.inf else None

    async def _call(
        self,
        method_name: str,
        request: Message,
        *,
        keys: Sequence[str],
        timeout: float | None = None,
    ) -> Any:
        """Send ``request`` to ``method_name``, retrying it while the connection is broken.

        ``timeout`` is the server-side wait of Get/Wait (the request's ``timeout_seconds``,
        lowered on each retry by the time already spent); other calls are bounded by the
        store's timeout. Waiting for a connection is bounded by ``connect_timeout`` too.
        """
        size = request.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise StoreValueError(
                f"store request for key(s) {list(keys)!r} is {size} bytes, "
                f"above the {MAX_MESSAGE_BYTES}-byte limit"
            )
        loop = asyncio.get_running_loop()
        start = loop.time()
        budget = self._timeout if timeout is None else timeout
        op_end = start + budget if 0 < budget < math.inf else None
        connect_limit = self.connect_timeout if 0 < self.connect_timeout < math.inf else None
        outage_end: float | None = None  # when the current outage exceeds connect_timeout
        backoff = RETRY_BACKOFF
        attempt = 0
        while True:
            now = loop.time()
            remaining = None if op_end is None else op_end - now
            if remaining is not None and remaining <= 0 and attempt > 0:
                raise self._gave_up(method_name, keys, timeout, now - start)
            limits = [x for x in (remaining, connect_limit) if x is not None]
            if outage_end is not None and outage_end < math.inf:
                limits.append(max(0.0, outage_end - now))
            stub = await self._connected_stub(min(limits) if limits else None)
            if timeout is not None:
                # Get/Wait: the server waits for what is left of the caller's timeout.
                request.timeout_seconds = max(remaining, 1e-3) if remaining is not None else timeout
            method: Callable[..., Awaitable[Any]] = getattr(stub, method_name)
            left = budget if remaining is None else remaining
            attempt += 1
            sent = self._security.token
            try:
                response = await method(
                    request, timeout=self._deadline(left), metadata=self._security.metadata()
                )
                self._token_proven = True
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED and self._job_token:
                    # A store publishes its job token before it serves: a refusal means the
                    # token sent was an earlier one (the store restarted). Retry with the new one.
                    token = read_job_token(self.port)
                    if token != sent:
                        if token != self._security.token:
                            self._security = self._security.with_token(token)
                        continue
                    raise self._translate(exc, method_name, keys, timeout) from exc
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise self._translate(exc, method_name, keys, timeout) from exc
                now = loop.time()
                if outage_end is None:
                    outage_end = now + connect_limit if connect_limit is not None else math.inf
                if now >= outage_end or (op_end is not None and now >= op_end):
                    raise self._translate(exc, method_name, keys, timeout) from exc
                log.debug(
                    "%s on the store at %s failed (%s); retrying (attempt %d)",
                    method_name,
                    self._target,
                    exc.details(),
                    attempt + 1,
                )
            pause = backoff if op_end is None else min(backoff, max(0.0, op_end - loop.time()))
            await asyncio.sleep(pause)
            backoff = min(backoff * 2, RETRY_BACKOFF_MAX)

    def _gave_up(
        self, method_name: str, keys: Sequence[str], timeout: float | None, spent: float
    ) -> StoreError:
        """The error of an operation whose time ran out while its broken connection was being
        retried (a connection error even for Get/Wait: whether the keys are set is unknown)."""
        return StoreConnectionError(
            f"{method_name} on key(s) {list(keys)!r}: the connection to the store at {self._target} "
            f"broke and the store did not answer a retry within {spent:.3g} s"
        )

    def _translate(
        self, exc: grpc.aio.AioRpcError, method_name: str, keys: Sequence[str], timeout: float | None
    ) -> StoreError:
        code = exc.code()
        details = exc.details() or ""
        where = f"the store at {self._target}"
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(
                f"{where} refused {method_name}: {details} (set the job's token with RPCDIST_AUTH_TOKEN, "
                "RPCDIST_AUTH_TOKEN_FILE or auth_token=)"
            )
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            if method_name in ("Get", "Wait"):
                wanted = ", ".join(map(repr, keys))
                # The server's message names the keys still missing; the client's own
                # deadline (server gone quiet) only says "Deadline Exceeded".
                if "waiting for store" in details:
                    return StoreTimeoutError(f"{details} in {where}")
                return StoreTimeoutError(
                    f"timed out after {timeout:g} s waiting for store key(s) {wanted} in {where}"
                )
            return StoreTimeoutError(
                f"{method_name} on key(s) {list(keys)!r} got no answer from {where} "
                f"within {self._timeout:g} s"
            )
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            return StoreValueError(details)
        if code is grpc.StatusCode.INVALID_ARGUMENT:  # e.g. a key or value above the store's limits
            return StoreValueError(f"{method_name} on key(s) {list(keys)!r} refused by {where}: {details}")
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return StoreValueError(f"{method_name} on key(s) {list(keys)!r} rejected by {where}: {details}")
        if code is grpc.StatusCode.UNAVAILABLE:
            return StoreConnectionError(f"{where} is unreachable ({method_name}: {details})")
        if code is grpc.StatusCode.CANCELLED:
            return StoreError(f"{method_name} on {where} was cancelled: {details}")
        return StoreError(f"{method_name} on {where} failed: {code.name}: {details}")

    # -- Store ---------------------------------------------------------------------------------
    async def _set(self, key: str, value: bytes) -> None:
        await self._call("Set", store_pb2.SetRequest(key=key, value=value), keys=[key])

    async def _get(self, key: str, timeout: float) -> bytes:
        request = store_pb2.GetRequest(key=key, timeout_seconds=timeout)
        response = await self._call("Get", request, keys=[key], timeout=timeout)
        return bytes(response.value)

    async def _add(self, key: str, amount: int) -> int:
        if not INT64_MIN <= amount <= INT64_MAX:
            raise StoreValueError(f"cannot add {amount} to store key {key!r}: amount outside int64")
        seq = self._next_seq
        self._next_seq += 1
        self._adds_in_flight.add(seq)
        try:
            # Retries resend this same request: the server recognises the id and adds once.
            request = store_pb2.AddRequest(
                key=key,
                amount=amount,
                client_id=self._client_id,
                request_seq=seq,
                low_seq=min(self._adds_in_flight),
            )
            response = await self._call("Add", request, keys=[key])
        finally:
            self._adds_in_flight.discard(seq)
        return int(response.value)

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        request = store_pb2.CompareSetRequest(key=key, expected=expected, desired=desired)
        response = await self._call("CompareSet", request, keys=[key])
        return bytes(response.value)

    async def _wait(self, keys: list[str], timeout: float) -> None:
        request = store_pb2.WaitRequest(keys=keys, timeout_seconds=timeout)
        await self._call("Wait", request, keys=keys, timeout=timeout)

    async def _check(self, keys: list[str]) -> bool:
        response = await self._call("Check", store_pb2.CheckRequest(keys=keys), keys=keys)
        return bool(response.ready)

    async def _delete_key(self, key: str) -> bool:
        response = await self._call("DeleteKey", store_pb2.DeleteKeyRequest(key=key), keys=[key])
        return bool(response.deleted)

    async def _num_keys(self) -> int:
        response = await self._call("NumKeys", store_pb2.NumKeysRequest(), keys=[])
        return int(response.count)

    async def _close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    @property
    def security(self) -> Security:
        """The credentials this client uses (with the job token it read, if any)."""
        return self._security

    def __repr__(self) -> str:
        return f"<GrpcStore {self._target}>"
