"""rpcdist: torch.distributed's RPC, RRefs and stores rebuilt on gRPC and asyncio.

``import rpcdist as dist`` gives the c10d-style namespace; ``rpcdist.rpc`` mirrors
``torch.distributed.rpc``::

    import rpcdist.rpc as rpc
    rpc.init_rpc("trainer", rank=1, world_size=2)
    out = rpc.rpc_sync("ps", torch.add, args=(torch.ones(2), 1))
    rpc.shutdown()
"""

from rpcdist import errors, futures
from rpcdist.errors import (
    RemoteError,
    RpcdistError,
    RpcError,
    RpcTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from rpcdist.store import FileStore, GrpcStore, HashStore, PrefixStore, Store, StoreServer

__version__ = "0.1.0"

__all__ = [
    "FileStore",
    "GrpcStore",
    "HashStore",
    "PrefixStore",
    "RemoteError",
    "RpcError",
    "RpcTimeoutError",
    "RpcdistError",
    "Store",
    "StoreError",
    "StoreServer",
    "StoreTimeoutError",
    "errors",
    "futures",
]
