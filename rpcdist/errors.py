"""The errors rpcdist raises, as one tree.

Catch the branch you care about; every class is also a ``RuntimeError`` (as torch's RPC
errors are), the timeout/value/type branches are also the matching builtin, and where the
meaning matches a class also derives from torch.distributed's ``DistError`` family (marked
``torch:``), so code written for torch (``except torch.distributed.DistNetworkError``) catches
rpcdist's errors too::

    RpcdistError (RuntimeError)
    ├── BlockingCallError            a blocking call made on the event loop it would block
    ├── StoreError                   the rendezvous/key-value store failed   torch: DistStoreError
    │   ├── StoreTimeoutError        (TimeoutError) keys did not appear in time
    │   ├── StoreValueError          (ValueError) e.g. add() on a non-integer value
    │   └── StoreConnectionError     the store server is unreachable          torch: DistNetworkError
    ├── RendezvousError              joining the group failed
    │   └── MembershipError          (ValueError) duplicate name, bad rank, world-size mismatch
    ├── DistributedError             a collective failed (rpcdist.collectives) torch: DistBackendError
    │   ├── CollectiveTimeoutError   (TimeoutError) a peer's message did not arrive in time
    │   └── PeerLostError            a peer the operation waited for is gone (also WorkerDiedError)
    └── RpcError                     a remote call failed
        ├── RpcTimeoutError          (TimeoutError) the call ran past its timeout
        ├── RemoteError              the remote function raised (type not rebuildable here)
        ├── WorkerUnavailableError   the peer is unknown, gone, or unreachable torch: DistNetworkError
        │   ├── UnknownWorkerError   (ValueError) no worker has that name/rank
        │   └── WorkerDiedError      its connection closed or it stopped answering heartbeats
        ├── PayloadTooLargeError     (ValueError) message above the configured maximum
        └── SerializationError       (TypeError) arguments/results that cannot be pickled
            └── RestrictedError      restricted mode refused a function or class in a message

``DistError``, ``DistBackendError``, ``DistNetworkError``, ``DistStoreError`` and
``QueueEmptyError`` are torch's own classes, re-exported here (``rpcdist.DistError is
torch.distributed.DistError``). ``DistributedError``, ``CollectiveTimeoutError`` and
``PeerLostError`` are defined with the process groups (``rpcdist.collectives.group``).

Exceptions raised by a remote function are re-raised at the caller with their own type when
it can be rebuilt there; their ``remote_traceback`` attribute (and the message) carry the
callee's traceback, and ``remote_worker``/``remote_function`` say where it happened.
"""

from __future__ import annotations

try:
    from torch.distributed import (
        DistBackendError,
        DistError,
        DistNetworkError,
        DistStoreError,
        QueueEmptyError,
    )
except ImportError:  # a torch built without distributed support: same names, same tree

    class DistError(RuntimeError):  # type: ignore[no-redef]
        """Base of torch.distributed's errors."""

    class DistBackendError(DistError):  # type: ignore[no-redef]
        """A collective backend failed."""

    class DistNetworkError(DistError):  # type: ignore[no-redef]
        """A network operation failed."""

    class DistStoreError(DistError):  # type: ignore[no-redef]
        """A store operation failed (e.g. a wait timed out)."""

    class QueueEmptyError(DistStoreError):  # type: ignore[no-redef]
        """A store queue was empty."""


__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
    "RpcdistError",
    "BlockingCallError",
    "AuthenticationError",
    "StoreError",
    "StoreTimeoutError",
    "StoreValueError",
    "StoreConnectionError",
    "RendezvousError",
    "MembershipError",
    "RpcError",
    "RpcTimeoutError",
    "RemoteError",
    "WorkerUnavailableError",
    "UnknownWorkerError",
    "WorkerDiedError",
    "PayloadTooLargeError",
    "SerializationError",
    "RestrictedError",
    "annotate_remote",
]


class RpcdistError(RuntimeError):
    """Base of every error rpcdist raises itself."""


class BlockingCallError(RpcdistError):
    """A blocking API was called from the event loop it needs; use its ``await`` form."""


class AuthenticationError(RpcdistError, PermissionError):
    """A store or worker refused this process: its auth token is missing or wrong, or its TLS
    certificate was not accepted (gRPC status UNAUTHENTICATED)."""


class StoreError(RpcdistError, DistStoreError):
    """A store operation failed (also torch's ``DistStoreError``)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """``get``/``wait`` gave up before the keys were set."""


class StoreValueError(StoreError, ValueError):
    """A store operation met a value it cannot work on (e.g. ``add`` on non-integer bytes)."""


class StoreConnectionError(StoreError, DistNetworkError):
    """The store server could not be reached or the connection to it broke (also torch's
    ``DistNetworkError``, which torch's TCPStore raises in that case)."""


class RendezvousError(RpcdistError):
    """Joining the group (init method, registration, barrier) failed."""


class MembershipError(RendezvousError, ValueError):
    """Registration conflicts: duplicate name or rank, rank out of range, world-size mismatch."""


class RpcError(RpcdistError):
    """A remote call did not produce a result."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call ran past its timeout; the callee was told to cancel its work."""


class RemoteError(RpcError):
    """The remote function raised an exception whose type cannot be rebuilt on the caller.

    ``remote_type`` names the original type; ``remote_traceback`` holds the callee's traceback.
    """

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class WorkerUnavailableError(RpcError, DistNetworkError):
    """The destination worker is gone, unreachable, or shut down (also torch's
    ``DistNetworkError``)."""


class UnknownWorkerError(WorkerUnavailableError, ValueError):
    """No worker in the group has the given name or rank."""


class WorkerDiedError(WorkerUnavailableError):
    """The connection to a worker closed while calls to it were pending: it died (or left
    without answering them). Raised at once, not at the calls' timeouts."""


class PayloadTooLargeError(RpcError, ValueError):
    """A message is larger than the configured ``max_payload_bytes``."""


class SerializationError(RpcError, TypeError):
    """Arguments or a result could not be pickled (raised before anything is sent)."""


class RestrictedError(SerializationError):
    """Restricted mode refused to decode a message: it names a function or class that is not
    exposed (``rpcdist.rpc.expose``), allowlisted or registered (``register_safe_class``)."""


def annotate_remote(exc: BaseException, worker: str, function: str, remote_traceback: str) -> BaseException:
    """Mark ``exc`` as raised on ``worker`` in ``function``, with the remote traceback attached."""
    if getattr(exc, "remote_worker", None) is None:
        exc.remote_traceback = remote_traceback  # type: ignore[attr-defined]
        exc.remote_worker = worker  # type: ignore[attr-defined]
        exc.remote_function = function  # type: ignore[attr-defined]
        if hasattr(exc, "add_note"):
            exc.add_note(f"Raised on worker {worker} in {function}. Remote traceback:\n{remote_traceback}")
    return exc
