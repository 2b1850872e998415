"""``rpcdist.rpc.options``: RpcBackendOptions, WorkerInfo and BackendType, as torch's module.

Defined with the agent that consumes them (:mod:`rpcdist.agent.options`); named here too
because torch users import them from ``torch.distributed.rpc.options``.
"""

from rpcdist.agent.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT,
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_RPC_TIMEOUT",
    "BackendType",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
]
