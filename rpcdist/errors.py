"""The errors rpcdist raises, as one tree.

Catch the branch you care about; every class is also a ``RuntimeError`` (as torch's RPC
errors are), and the timeout/value/type branches are also the matching builtin::

    RpcdistError (RuntimeError)
    ├── BlockingCallError            a blocking call made on the event loop it would block
    ├── StoreError                   the rendezvous/key-value store failed
    │   ├── StoreTimeoutError        (TimeoutError) keys did not appear in time
    │   └── StoreValueError          (ValueError) e.g. add() on a non-integer value
    ├── RendezvousError              joining the group failed
    │   └── MembershipError          (ValueError) duplicate name, bad rank, world-size mismatch
    └── RpcError                     a remote call failed
        ├── RpcTimeoutError          (TimeoutError) the call ran past its timeout
        ├── RemoteError              the remote function raised (type not rebuildable here)
        ├── WorkerUnavailableError   the peer is unknown, gone, or unreachable
        │   └── UnknownWorkerError   (ValueError) no worker has that name/rank
        ├── PayloadTooLargeError     (ValueError) message above the configured maximum
        └── SerializationError       (TypeError) arguments/results that cannot be pickled

Exceptions raised by a remote function are re-raised at the caller with their own type when
it can be rebuilt there; their ``remote_traceback`` attribute (and the message) carry the
callee's traceback, and ``remote_worker``/``remote_function`` say where it happened.
"""

from __future__ import annotations

__all__ = [
    "RpcdistError",
    "BlockingCallError",
    "StoreError",
    "StoreTimeoutError",
    "StoreValueError",
    "RendezvousError",
    "MembershipError",
    "RpcError",
    "RpcTimeoutError",
    "RemoteError",
    "WorkerUnavailableError",
    "UnknownWorkerError",
    "PayloadTooLargeError",
    "SerializationError",
    "annotate_remote",
]


class RpcdistError(RuntimeError):
    """Base of every error rpcdist raises itself."""


class BlockingCallError(RpcdistError):
    """A blocking API was called from the event loop it needs; use its ``await`` form."""


class StoreError(RpcdistError):
    """A store operation failed."""


class StoreTimeoutError(StoreError, TimeoutError):
    """``get``/``wait`` gave up before the keys were set."""


class StoreValueError(StoreError, ValueError):
    """A store operation met a value it cannot work on (e.g. ``add`` on non-integer bytes)."""


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


class WorkerUnavailableError(RpcError):
    """The destination worker is gone, unreachable, or shut down."""


class UnknownWorkerError(WorkerUnavailableError, ValueError):
    """No worker in the group has the given name or rank."""


class PayloadTooLargeError(RpcError, ValueError):
    """A message is larger than the configured ``max_payload_bytes``."""


class SerializationError(RpcError, TypeError):
    """Arguments or a result could not be pickled (raised before anything is sent)."""


def annotate_remote(exc: BaseException, worker: str, function: str, remote_traceback: str) -> BaseException:
    """Mark ``exc`` as raised on ``worker`` in ``function``, with the remote traceback attached."""
    if getattr(exc, "remote_worker", None) is None:
        exc.remote_traceback = remote_traceback  # type: ignore[attr-defined]
        exc.remote_worker = worker  # type: ignore[attr-defined]
        exc.remote_function = function  # type: ignore[attr-defined]
        if hasattr(exc, "add_note"):
            exc.add_note(f"Raised on worker {worker} in {function}. Remote traceback:\n{remote_traceback}")
    return exc
