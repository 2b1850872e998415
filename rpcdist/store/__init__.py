"""Key-value stores with torch.distributed's c10d ``Store`` semantics.

- :class:`HashStore` — in this process's memory;
- :class:`FileStore` — a file on a filesystem shared by the processes;
- :class:`GrpcStore` — a client of the gRPC store service (``rpcdist-server`` or a
  :class:`StoreServer` embedded in a program);
- :class:`EtcdStore` — keys of one job on an etcd cluster (etcd's v3 gRPC API), failing over
  between its members;
- :class:`PrefixStore` — a namespaced view of another store;
- :class:`TorchStore` — any ``torch.distributed.Store`` (torchrun's agent store, torch's
  TCPStore/FileStore/HashStore/PrefixStore) behind this interface;
- :class:`TCPStore` — torch's TCPStore server/client, with torch's constructor.

Every store has blocking methods with torch's names (``set``, ``get``, ``add``, ``compare_set``,
``wait``, ``check``, ``delete_key``, ``num_keys``) and ``*_async`` coroutines usable from any loop.
"""

from rpcdist.store.api import PrefixStore, Store
from rpcdist.store.etcd_store import EtcdStore
from rpcdist.store.file_store import FileStore
from rpcdist.store.grpc_store import GrpcStore
from rpcdist.store.hash_store import HashStore
from rpcdist.store.memory import KeyValueState
from rpcdist.store.service import StoreLimits, StoreServer
from rpcdist.store.torch_store import TCPStore, TorchStore

__all__ = [
    "Store",
    "PrefixStore",
    "HashStore",
    "FileStore",
    "GrpcStore",
    "EtcdStore",
    "StoreServer",
    "StoreLimits",
    "KeyValueState",
    "TorchStore",
    "TCPStore",
]
