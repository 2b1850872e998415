"""rpcdist: torch.distributed's RPC, RRefs and stores rebuilt on gRPC and asyncio.

``import rpcdist as dist`` gives the c10d namespace of ``torch.distributed``
(``init_process_group``, ``all_reduce``, ``send``/``recv``, ...); ``rpcdist.rpc`` mirrors
``torch.distributed.rpc``::

    import rpcdist.rpc as rpc
    rpc.init_rpc("trainer", rank=1, world_size=2)
    out = rpc.rpc_sync("ps", torch.add, args=(torch.ones(2), 1))
    rpc.shutdown()
"""

from rpcdist import errors, futures
from rpcdist.collectives import api as _c10d
from rpcdist.collectives.api import *  # noqa: F403 - the c10d namespace, as torch.distributed
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
group = _c10d.GroupMember  # dist.group.WORLD, as in torch

__all__ = [
    *_c10d.__all__,
    "group",
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
