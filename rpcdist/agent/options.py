"""Configuration and identity of RPC workers: RpcBackendOptions, WorkerInfo, BackendType."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any

from rpcdist import metrics
from rpcdist.errors import MembershipError
from rpcdist.security import Security
from rpcdist.serialization import trust

__all__ = ["BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions", "WorkerInfo"]

DEFAULT_RPC_TIMEOUT = 60.0
MAX_NAME_LEN = 128
_VALID_NAME = re.compile(r"[A-Za-z0-9_:\-]+")
DEFAULT_INIT_METHOD = "env://"
DEFAULT_MAX_INFLIGHT_CALLS_PER_PEER = 1024


def _restricted_from_env() -> bool:
    """``RPCDIST_RESTRICTED=1`` turns restricted mode on for every worker of the process."""
    return os.environ.get("RPCDIST_RESTRICTED", "").strip().lower() in ("1", "true", "yes", "on")


class BackendType(enum.Enum):
    """Accepted for torch compatibility: every backend is rpcdist's gRPC transport."""

    GRPC = "GRPC"
    TENSORPIPE = "GRPC"  # alias: code written for torch keeps working


@trust
@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and id (its rank), as ``torch.distributed.rpc.WorkerInfo``."""

    name: str
    id: int

    def __post_init__(self) -> None:
        if not _VALID_NAME.fullmatch(self.name or "") or len(self.name) >= MAX_NAME_LEN:
            raise MembershipError(  # torch's wording (a RuntimeError, and a ValueError)
                f"Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than "
                f"{MAX_NAME_LEN} chars, but got {self.name}"
            )

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


@dataclass
class RpcBackendOptions:
    """Options of ``init_rpc``.

    Args:
        init_method: ``env://`` (MASTER_ADDR/MASTER_PORT), ``tcp://host:port`` or ``file:///path``.
        rpc_timeout: default timeout of every call, seconds (0: none).
        num_worker_threads: threads that run blocking (non-``async``) user functions; at most
            one per core runs at a time (the interpreter lock makes more only hand it over),
            a function waiting for an rpcdist future lends its place, and a call queued for
            10 ms starts anyway, up to this many threads.
        max_payload_bytes: largest message (pickle plus tensor bytes) sent or accepted.
        chunk_bytes: size of the pieces large payloads are streamed in.
        shm_threshold_bytes: buffers at least this large go to peers on the same host through
            shared memory (/dev/shm) instead of the stream; 0 turns that off. From 4 MiB the
            receiver's tensor lives in the sender's shared memory (no copy) until it is freed.
        transport: ``"auto"`` (gRPC between hosts, a Unix socket between workers of one host),
            ``"grpc"`` (gRPC streams for every peer) or ``"tcp"`` (rpcdist's framing straight on
            TCP between hosts, a Unix socket on one host: faster than gRPC, but TCP (TLS with
            the ``tls_*`` files) that only rpcdist speaks; every worker of the group must use it).
        listen_host: interface this worker serves on (default: loopback when the store is on
            loopback, else all interfaces).
        advertise_host: address peers use to reach this worker (default: derived).
        heartbeat_interval: seconds a peer may stay silent on a gRPC link before it is sent a
            heartbeat; one that answers none for ``heartbeat_interval * (heartbeat_misses + 1)``
            seconds is declared dead and every wait on it fails with ``WorkerDiedError``
            (a killed process is noticed at once, by its closed connection; heartbeats find
            hosts that vanish, links that are cut and processes that hang on other hosts).
            0 turns heartbeats off.
        heartbeat_misses: heartbeats a peer may leave unanswered (see ``heartbeat_interval``).
        restricted: restricted mode (default: ``RPCDIST_RESTRICTED=1`` in the environment):
            peers may call only functions exposed with ``@rpcdist.rpc.expose`` or named in
            ``allowlist``, and messages are decoded by a restricted unpickler that admits
            tensors, numpy arrays, Python primitives and containers, RRefs, rpcdist's own
            messages and classes registered with ``rpcdist.rpc.register_safe_class``;
            anything else is refused with ``RestrictedError`` before it is imported or run.
        allowlist: qualified names of further functions or classes peers may name in restricted
            mode (``"torch.add"``, ``"mypkg.model.forward"``), imported at ``init_rpc``.
        max_inflight_calls_per_peer: calls this worker keeps in flight to one peer; further
            calls wait, in order, until replies come back (their timeout runs meanwhile). A
            callee refuses a call from a peer that already has this many running on it (a call
            whose answer is on its way no longer counts: the caller may have it already).
        auth_token: the job's shared secret: every store call and every link to a worker must
            carry it (default: ``RPCDIST_AUTH_TOKEN``, or the file ``RPCDIST_AUTH_TOKEN_FILE``;
            without either, a job whose store is on loopback gets a generated one). Never
            logged nor shown in ``repr``.
        tls_cert, tls_key, tls_ca: PEM files: this worker's certificate and key, and the CA
            peers are verified against (given a CA, servers require client certificates:
            mTLS). Default: ``RPCDIST_TLS_CERT``/``RPCDIST_TLS_KEY``/``RPCDIST_TLS_CA``.
        metrics_port: serve Prometheus metrics of this process at ``http://HOST:PORT/metrics``
            (0: a free port, see ``rpcdist.metrics.address()``), on the interface the worker
            listens on. ``None`` (default): as ``RPCDIST_METRICS_PORT`` says, off when unset.
        device_maps, devices, _transports, _channels: torch TensorPipe fields, accepted for
            compatibility; only CPU tensors are supported, so device maps must be empty.
    """

    init_method: str = DEFAULT_INIT_METHOD
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    num_worker_threads: int = 16
    max_payload_bytes: int = 16 << 30
    chunk_bytes: int = 1 << 20
    shm_threshold_bytes: int = 512 << 10
    transport: str = "auto"
    listen_host: str | None = None
    advertise_host: str | None = None
    device_maps: dict[str, Any] | None = None
    devices: list[Any] | None = None
    _transports: list[str] | None = None
    _channels: list[str] | None = None
    store_timeout: float = 300.0
    heartbeat_interval: float = 1.0
    heartbeat_misses: int = 3
    restricted: bool = field(default_factory=_restricted_from_env)
    allowlist: list[str] = field(default_factory=list)
    max_inflight_calls_per_peer: int = DEFAULT_MAX_INFLIGHT_CALLS_PER_PEER
    metrics_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    auth_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds, got {self.rpc_timeout}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        if self.transport not in ("auto", "grpc", "tcp"):
            raise ValueError(f'transport must be "auto", "grpc" or "tcp", not {self.transport!r}')
        if self.device_maps:
            raise ValueError("device_maps are not supported: rpcdist moves CPU tensors only")
        if self.heartbeat_interval < 0:
            raise ValueError(f"heartbeat_interval must be >= 0 seconds, got {self.heartbeat_interval}")
        if self.heartbeat_misses < 1:
            raise ValueError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        if self.max_inflight_calls_per_peer < 1:
            raise ValueError(
                f"max_inflight_calls_per_peer must be >= 1, got {self.max_inflight_calls_per_peer}"
            )
        if isinstance(self.allowlist, str) or not all(isinstance(n, str) for n in self.allowlist):
            raise ValueError(f"allowlist must be a list of qualified names, got {self.allowlist!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be a port in 0..65535 (0: any free one), got {self.metrics_port}"
            )

    def security(self) -> Security:
        """The credentials these options give, completed from the environment."""
        return Security.resolve(self.auth_token, self.tls_cert, self.tls_key, self.tls_ca)

    def resolved_metrics_port(self) -> int | None:
        """The metrics port to serve: ``metrics_port``, else ``RPCDIST_METRICS_PORT``'s, else None."""
        return self.metrics_port if self.metrics_port is not None else metrics.port_from_env()

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """torch compatibility; CPU-only, so any non-empty map is refused."""
        if device_map:
            raise ValueError("device maps are not supported: rpcdist moves CPU tensors only")


def TensorPipeRpcBackendOptions(  # noqa: N802 - torch's name
    num_worker_threads: int = 16,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    init_method: str = DEFAULT_INIT_METHOD,
    device_maps: dict[str, Any] | None = None,
    devices: list[Any] | None = None,
    _transports: list[str] | None = None,
    _channels: list[str] | None = None,
) -> RpcBackendOptions:
    """torch's ``TensorPipeRpcBackendOptions`` signature, giving :class:`RpcBackendOptions`."""
    return RpcBackendOptions(
        init_method=init_method,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads,
        device_maps=device_maps,
        devices=devices,
        _transports=_transports,
        _channels=_channels,
    )
