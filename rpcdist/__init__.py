"""rpcdist: torch.distributed's RPC, RRefs and stores rebuilt on gRPC and asyncio.

``import rpcdist as dist`` gives the c10d namespace of ``torch.distributed``
(``init_process_group``, ``all_reduce``, ``send``/``recv``, ...); ``rpcdist.rpc`` mirrors
``torch.distributed.rpc``::

    import rpcdist.rpc as rpc
    rpc.init_rpc("trainer", rank=1, world_size=2)
    out = rpc.rpc_sync("ps", torch.add, args=(torch.ones(2), 1))
    rpc.shutdown()
"""

from rpcdist import _grpc_engine  # noqa: F401, I001 - first: it chooses gRPC's engine before grpc loads
from torch.distributed import GradBucket

from rpcdist import constants, errors, futures, rendezvous
from rpcdist._launch_env import is_launched
from rpcdist.collectives import api as _c10d
from rpcdist.collectives import torch_backend as _torch_backend
from rpcdist.collectives.api import *  # noqa: F403 - the c10d namespace, as torch.distributed
from rpcdist.constants import default_pg_timeout
from rpcdist.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
    RemoteError,
    RpcdistError,
    RpcError,
    RpcTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from rpcdist.store import (
    EtcdStore,
    FileStore,
    GrpcStore,
    HashStore,
    PrefixStore,
    Store,
    StoreServer,
    TCPStore,
    TorchStore,
)

__version__ = "0.1.0"
_torch_backend.register()  # torch.distributed.init_process_group("rpcdist", ...)
group = _c10d.GroupMember  # dist.group.WORLD, as in torch
rendezvous.__class__ = _c10d._CallableRendezvousModule  # the module, callable as torch's function

__all__ = [
    *_c10d.__all__,
    "group",
    "EtcdStore",
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
    "is_launched",  # started by rpcdist-run, torchrun or srun
    # torch.distributed names: stores, errors, constants, rendezvous
    "TCPStore",
    "TorchStore",
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
    "GradBucket",
    "constants",
    "default_pg_timeout",
    "rendezvous",
]
