"""``rpcdist.rpc``: remote calls and remote references, as ``torch.distributed.rpc``.

import rpcdist.rpc as rpc
rpc.init_rpc("worker0", rank=0, world_size=2)
rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
rpc.shutdown()
"""

from rpcdist.errors import RemoteError, RestrictedError, RpcError, RpcTimeoutError
from rpcdist.futures import Future
from rpcdist.rpc import constants, functions
from rpcdist.rpc.api import (
    _get_current_rpc_agent,  # noqa: F401 - torch's private helpers, which torch users call
    _set_rpc_timeout,  # noqa: F401
    backend_registered,
    construct_rpc_backend_options,
    get_all_worker_infos,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    init_rpc_async,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
    shutdown_async,
)
from rpcdist.rpc.elastic import get_worker_infos, membership_change, on_membership_change
from rpcdist.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from rpcdist.rpc.rref import RRef, debug_info
from rpcdist.serialization import expose, register_safe_class

__all__ = [
    "BackendType",
    "Future",
    "RRef",
    "RemoteError",
    "RestrictedError",
    "RpcBackendOptions",
    "RpcError",
    "RpcTimeoutError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "backend_registered",
    "constants",
    "construct_rpc_backend_options",
    "get_rpc_timeout",
    "is_available",
    "debug_info",
    "expose",
    "register_safe_class",
    "functions",
    "get_all_worker_infos",
    "get_worker_info",
    "get_worker_infos",
    "membership_change",
    "on_membership_change",
    "init_rpc",
    "init_rpc_async",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "shutdown_async",
]
