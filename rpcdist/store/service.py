"""The gRPC Store service (``rpcdist.v1.Store``) and a server that hosts it.

:class:`StoreServicer` serves a :class:`~rpcdist.store.memory.KeyValueState`. Its handlers
receive the request bytes unparsed and decode them themselves, so a malformed or truncated
request is answered with ``INVALID_ARGUMENT`` (instead of gRPC's generic deserialisation
failure) and the server goes on serving everyone else. Errors map to status codes:

=========================  ======================
StoreTimeoutError          DEADLINE_EXCEEDED
StoreValueError            FAILED_PRECONDITION
undecodable request        INVALID_ARGUMENT
a key or value too large   INVALID_ARGUMENT (naming the limit)
a new key above max_keys   RESOURCE_EXHAUSTED (naming the limit)
the data log failed        INTERNAL
=========================  ======================

:class:`StoreLimits` caps what one client can make the server hold (key and value sizes,
the number of keys); a request above a cap is refused before it changes anything, and
everyone else is served as before.

Every handler answers only after ``state.flushed()``: with a durable state (``data_dir``) a
change is answered once it is on disk, and no answer reveals a change that is not. An ``Add``
carrying a request id (``client_id``, ``request_seq``, ``low_seq``) is applied once however
often it is retried (see :class:`~rpcdist.store.memory.RequestId`).

:class:`StoreServer` runs the service in a ``grpc.aio`` server on the running loop, next to
the standard gRPC health service::

    server = await StoreServer.start("127.0.0.1", 0)                    # in memory
    server = await StoreServer.start("0.0.0.0", 29500, data_dir="/var/lib/rpcdist")  # durable
    print(server.port)
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from rpcdist import metrics
from rpcdist.errors import StoreError, StoreTimeoutError, StoreValueError
from rpcdist.security import (
    Security,
    job_token_for,
    new_token,
    publish_job_token,
    server_interceptors,
    withdraw_job_token,
)
from rpcdist.store.durable import DEFAULT_WAL_MAX_BYTES, DurableKeyValueState
from rpcdist.store.memory import CLIENT_ID_BYTES, KeyValueState, RequestId
from rpcdist.v1 import store_pb2

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

__all__ = [
    "SERVICE_NAME",
    "MAX_MESSAGE_BYTES",
    "StoreLimits",
    "StoreServicer",
    "StoreServer",
    "format_address",
]

SERVICE_NAME = "rpcdist.v1.Store"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoreLimits:
    """What the store service accepts (``rpcdist-server --max-key-bytes/--max-value-bytes/--max-keys``).

    Args:
        max_key_bytes: longest key (UTF-8 bytes) in any request.
        max_value_bytes: largest value a ``set``/``compare_set`` may store.
        max_keys: keys the store may hold; a request that would add one more is refused
            (``RESOURCE_EXHAUSTED``) until keys are deleted.
    """

    max_key_bytes: int = 16 * 1024
    max_value_bytes: int = 32 * 1024 * 1024
    max_keys: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


class _Refusal(Exception):
    """Ends a store request with an error status (see :func:`_measured`, which answers it)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    # Not context.abort(): grpc keeps the exception that raises on the call's state, and its
    # traceback holds the handler's frames, which hold the context: a reference cycle that
    # keeps the server alive until a garbage collection (one per timed-out Wait).
    raise _Refusal(code, details)


class StoreServicer:
    """Implements ``rpcdist.v1.Store`` over a KeyValueState (every handler runs on its loop)."""

    def __init__(self, state: KeyValueState | None = None, limits: StoreLimits | None = None) -> None:
        self.state = state if state is not None else KeyValueState()
        self.limits = limits if limits is not None else StoreLimits()

    async def _within_limits(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        keys: Iterable[str],
        values: Iterable[bytes] = (),
        creates: str | None = None,
    ) -> None:
        """Abort the request if a key or value is above its cap, or if it would add key
        ``creates`` to a store already holding ``max_keys``."""
        limits = self.limits
        for key in keys:
            size = len(key.encode("utf-8", "surrogatepass"))
            if size > limits.max_key_bytes:
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: a key of {size} bytes ({key[:40]!r}...) is above the store's "
                    f"max_key_bytes={limits.max_key_bytes}",
                )
        for value in values:
            if len(value) > limits.max_value_bytes:
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: a value of {len(value)} bytes is above the store's "
                    f"max_value_bytes={limits.max_value_bytes}",
                )
        if (
            creates is not None
            and self.state.num_keys() >= limits.max_keys
            and self.state.get_nowait(creates) is None
        ):
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: the store holds {self.state.num_keys()} keys, its max_keys={limits.max_keys}; "
                f"key {creates[:40]!r} was not added (delete keys, or raise rpcdist-server --max-keys)",
            )

    # -- plumbing ------------------------------------------------------------------------------
    async def _parse(self, cls: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
        try:
            return cls.FromString(raw)
        except DecodeError as exc:
            log.warning("malformed %s (%d bytes) from %s: %s", cls.__name__, len(raw), context.peer(), exc)
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed {cls.__name__} ({len(raw)} bytes): {exc}",
            )

    @staticmethod
    async def _fail(exc: Exception, context: grpc.aio.ServicerContext) -> NoReturn:
        if isinstance(exc, StoreTimeoutError):
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        if isinstance(exc, StoreValueError):
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.exception("store request failed", exc_info=exc)
        await _abort(context, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    # -- handlers (request: raw bytes) ---------------------------------------------------------
    async def Set(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.SetResponse:
        req = await self._parse(store_pb2.SetRequest, raw, context)
        await self._within_limits(context, "Set", [req.key], [req.value], creates=req.key)
        try:
            self.state.set(req.key, req.value)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.SetResponse()

    async def Get(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.GetResponse:
        req = await self._parse(store_pb2.GetRequest, raw, context)
        await self._within_limits(context, "Get", [req.key])
        try:
            value = await self.state.get(req.key, req.timeout_seconds)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.GetResponse(value=value)

    async def Add(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.AddResponse:
        req = await self._parse(store_pb2.AddRequest, raw, context)
        await self._within_limits(context, "Add", [req.key], creates=req.key)
        try:
            request = None
            if req.client_id:
                if len(req.client_id) != CLIENT_ID_BYTES:
                    await _abort(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"Add: client_id must be {CLIENT_ID_BYTES} bytes, not {len(req.client_id)}",
                    )
                request = RequestId(req.client_id, req.request_seq, req.low_seq)
            value = self.state.add(req.key, req.amount, request)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.AddResponse(value=value)

    async def CompareSet(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.CompareSetResponse:
        req = await self._parse(store_pb2.CompareSetRequest, raw, context)
        await self._within_limits(
            context,
            "CompareSet",
            [req.key],
            [req.expected, req.desired],
            creates=req.key if not req.expected else None,  # only an empty expected creates
        )
        try:
            value = self.state.compare_set(req.key, req.expected, req.desired)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.CompareSetResponse(value=value)

    async def Wait(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.WaitResponse:
        req = await self._parse(store_pb2.WaitRequest, raw, context)
        await self._within_limits(context, "Wait", req.keys)
        try:
            await self.state.wait(list(req.keys), req.timeout_seconds)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.WaitResponse()

    async def Check(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.CheckResponse:
        req = await self._parse(store_pb2.CheckRequest, raw, context)
        await self._within_limits(context, "Check", req.keys)
        try:
            ready = self.state.check(req.keys)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.CheckResponse(ready=ready)

    async def DeleteKey(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.DeleteKeyResponse:
        req = await self._parse(store_pb2.DeleteKeyRequest, raw, context)
        await self._within_limits(context, "DeleteKey", [req.key])
        try:
            deleted = self.state.delete_key(req.key)
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.DeleteKeyResponse(deleted=deleted)

    async def NumKeys(self, raw: bytes, context: grpc.aio.ServicerContext) -> store_pb2.NumKeysResponse:
        await self._parse(store_pb2.NumKeysRequest, raw, context)
        try:
            count = self.state.num_keys()
            await self.state.flushed()
        except StoreError as exc:
            await self._fail(exc, context)
        return store_pb2.NumKeysResponse(count=count)

    # -- registration --------------------------------------------------------------------------
    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's handlers, each taking the request bytes undeserialised."""
        responses: dict[str, type[Message]] = {
            "Set": store_pb2.SetResponse,
            "Get": store_pb2.GetResponse,
            "Add": store_pb2.AddResponse,
            "CompareSet": store_pb2.CompareSetResponse,
            "Wait": store_pb2.WaitResponse,
            "Check": store_pb2.CheckResponse,
            "DeleteKey": store_pb2.DeleteKeyResponse,
            "NumKeys": store_pb2.NumKeysResponse,
        }
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name, response in responses.items():
            fn: Callable[[bytes, Any], Awaitable[Message]] = getattr(self, name)
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _measured(name, fn), request_deserializer=None, response_serializer=response.SerializeToString
            )
        return handlers

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service on ``server``."""
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, self.method_handlers()),)
        )


def _measured(
    method: str, handler: Callable[[bytes, Any], Awaitable[Message]]
) -> Callable[[bytes, Any], Awaitable[Message | None]]:
    """``handler`` answering a :class:`_Refusal` with its status, and timing its requests into
    rpcdist_store_request_duration_seconds while metrics are on (see :mod:`rpcdist.metrics`)."""

    async def measured(raw: bytes, context: Any) -> Message | None:
        started = time.perf_counter() if metrics.current is not None else None
        outcome = "error"
        try:
            answer = await handler(raw, context)
            outcome = "ok"
            return answer
        except _Refusal as refusal:
            context.set_code(refusal.code)
            context.set_details(refusal.details)
            return None  # (with an error status, no answer is sent)
        finally:
            if started is not None and metrics.current is not None:
                metrics.current.store_seconds.labels(method, outcome).observe(time.perf_counter() - started)

    return measured


def _address_in_use(host: str, port: int) -> OSError | None:
    """After gRPC failed to bind: the OSError a plain bind gets, if any (e.g. EADDRINUSE)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return exc
    for family, socktype, proto, _, addr in infos:
        try:
            with socket.socket(family, socktype, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
        except OSError as exc:
            return exc
    return None


class StoreServer:
    """A running gRPC server hosting the Store service and the gRPC health service.

    Use :meth:`start` (on a running loop); the server's handlers run on that loop.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        state: KeyValueState,
        health: health_aio.HealthServicer,
        host: str,
        port: int,
        owns_state: bool = False,
        security: Security | None = None,
    ) -> None:
        self._server = server
        self.security = security or Security()
        self._published_token: str | None = None
        self.state = state
        self.health = health
        self.host = host
        self.port = port
        self._owns_state = owns_state
        self._stopped = False

    @classmethod
    async def start(
        cls,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        state: KeyValueState | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        data_dir: str | os.PathLike[str] | None = None,
        wal_max_bytes: int | None = None,
        security: Security | None = None,
        job_token: bool = False,
        limits: StoreLimits | None = None,
    ) -> StoreServer:
        """Listen on ``host:port`` (0: an ephemeral port; see :attr:`port`) and serve.

        With ``data_dir`` the keys are durable: every change is logged there and synced to disk
        before it is answered, and what the directory holds is recovered first (see
        :mod:`rpcdist.store.durable`; ``wal_max_bytes`` is the log size that triggers a
        snapshot). Without it (and without ``state``) the keys live in memory only.
        ``limits`` caps key and value sizes and the number of keys (default: :class:`StoreLimits`).

        Raises StoreError if the address cannot be bound (e.g. it is already in use: the
        server never shares a port with another listener), if ``data_dir`` is in use by
        another server, or if its files are corrupt (naming the file and offset).

        ``security`` (default: none) gives the token every call must carry and the TLS files.
        ``job_token=True`` on a loopback address without a token makes one (the one this
        process made for the port before, if any: see :func:`rpcdist.security.job_token_for`)
        and leaves it in this user's private directory for the job's members (see
        :func:`rpcdist.security.read_job_token`); it is removed when the server stops.
        """
        security = security or Security()
        if job_token and security.token is None:
            security = security.with_token(job_token_for(port) if port else new_token())
        else:
            job_token = False
        if data_dir is not None:
            if state is not None:
                raise ValueError("pass either state or data_dir, not both")
            limit = DEFAULT_WAL_MAX_BYTES if wal_max_bytes is None else wal_max_bytes
            durable = await asyncio.to_thread(DurableKeyValueState.open, data_dir, limit)
            try:
                return await cls._start(
                    host,
                    port,
                    durable,
                    max_message_bytes,
                    limits,
                    owns_state=True,
                    security=security,
                    job_token=job_token,
                )
            except BaseException:
                await durable.close()
                raise
        state = state if state is not None else KeyValueState()
        return await cls._start(
            host,
            port,
            state,
            max_message_bytes,
            limits,
            owns_state=False,
            security=security,
            job_token=job_token,
        )

    @classmethod
    async def _start(
        cls,
        host: str,
        port: int,
        state: KeyValueState,
        max_message_bytes: int,
        limits: StoreLimits | None,
        owns_state: bool,
        security: Security,
        job_token: bool,
    ) -> StoreServer:
        interceptors = server_interceptors(security, "the store")
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        StoreServicer(state, limits).add_to_server(server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
        address = format_address(host, port)
        try:
            bound = security.add_port(server, address)
        except RuntimeError:
            bound = 0
        if not bound:
            await server.stop(None)
            cause = _address_in_use(host, port)
            if cause is not None and cause.errno == errno.EADDRINUSE:
                raise StoreError(
                    f"cannot start the store server on {address}: address already in use"
                ) from cause
            why = f": {cause}" if cause is not None else ""
            raise StoreError(f"cannot start the store server on {address}{why}") from cause
        for interceptor in interceptors:
            interceptor.what = f"the store on {format_address(host, bound)}"
        made = cls(server, state, health, host, bound, owns_state, security)
        if job_token and security.token:
            publish_job_token(bound, security.token)  # before serving: members find it at once
            made._published_token = security.token
        await server.start()
        for service in ("", SERVICE_NAME):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "store server listening on %s (%s%s)",
            format_address(host, bound),
            "TLS" if security.tls else "plaintext",
            ", token required" if security.token else ", no token",
        )
        return made

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return format_address(self.host, self.port)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop; calls still running after ``grace`` s are cancelled."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._published_token is not None:
            withdraw_job_token(self.port, self._published_token)
        if self._owns_state:
            await self.state.close()
        log.info("store server on %s stopped", self.address)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Wait until the server stops; returns False if ``timeout`` passed first."""
        return await self._server.wait_for_termination(timeout)

    async def __aenter__(self) -> StoreServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"<StoreServer {self.address} keys={self.state.num_keys()}>"
