"""What calls, results and errors look like as messages: pickling within the size limit, and
the error description that carries a remote failure back to its caller."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

from rpcdist import serialization
from rpcdist.agent.extensions import CollectingUndo, TensorReducer, run_undo
from rpcdist.errors import PayloadTooLargeError, RemoteError, annotate_remote

__all__ = ["pickle_message", "describe_error", "rebuild_error"]


def pickle_message(
    obj: Any,
    what: str,
    max_bytes: int,
    tensor_reducer: TensorReducer | None = None,
    ordered_to: int | None = None,
    receiver: int | None = None,
) -> tuple[bytes, list[memoryview], list[Callable[[], None]]]:
    """Pickle one message; returns it with the undo callbacks of what it carries (given
    back at once if it cannot be pickled or is above ``max_bytes``). ``ordered_to`` and
    ``receiver``: see :class:`CollectingUndo`."""
    with CollectingUndo(ordered_to, receiver) as undo:
        try:
            payload, buffers = serialization.dumps(obj, grad_reducer=tensor_reducer)
            size = len(payload)
            if buffers:
                size += sum(len(b) for b in buffers)
            if size > max_bytes:
                raise PayloadTooLargeError(
                    f"{what} carries {size} bytes, above max_payload_bytes={max_bytes}"
                )
        except BaseException:
            run_undo(undo)  # what it carried never left
            raise
    return payload, buffers, undo


def describe_error(
    worker: str, function: str, exc: BaseException, loading: bool = False
) -> tuple[bytes, list[memoryview]]:
    """The ERROR message for ``exc`` raised on ``worker`` in ``function``."""
    what = f"loading the call to {function}" if loading else function
    text = "".join(traceback.format_exception(exc))
    description = {
        "worker": worker,
        "function": function,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": f"{type(exc).__name__}: {exc}" + (f" (while {what})" if loading else ""),
        "traceback": text,
        "exception": b"",
    }
    # The exception travels as nested pickle bytes: if the caller cannot rebuild it (its
    # class exists only there), the description above still arrives intact.
    try:
        description["exception"] = pickle.dumps(exc, protocol=5)
    except Exception:  # noqa: BLE001 - unpicklable exception: the description stands in
        pass
    return serialization.dumps(description)


def rebuild_error(
    payload: bytes | memoryview,
    buffers: list[memoryview],
    function: str,
    dest: str,
    decode: Callable[..., Any] = serialization.loads,
) -> BaseException:
    """The exception the caller sees: the remote type when it rebuilds here, else RemoteError.

    ``decode(payload, buffers)`` unpickles (the agent's: restricted in restricted mode)."""
    try:
        info = decode(payload, buffers)
    except Exception as exc:
        return RemoteError(f"{function} failed on worker {dest} (error not readable: {exc})")
    where = f"on worker {info['worker']} in {info['function']}"
    exc: Any = None
    if info.get("exception"):
        try:
            exc = decode(info["exception"])
        except Exception:  # noqa: BLE001 - the class is not importable here
            exc = None
    if isinstance(exc, BaseException):
        return annotate_remote(exc, info["worker"], info["function"], info["traceback"])
    error = RemoteError(
        # torch's wording ("Original exception on remote side was"), which its users match
        f"{function} failed {where} and its exception could not be rebuilt here. Original exception "
        f"on remote side was: {info['message']}\nRemote traceback:\n{info['traceback']}",
        remote_type=info["type"],
        remote_traceback=info["traceback"],
    )
    error.remote_worker = info["worker"]  # type: ignore[attr-defined]
    error.remote_function = info["function"]  # type: ignore[attr-defined]
    return error
