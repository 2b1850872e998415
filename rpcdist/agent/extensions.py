"""The explicit interface between the agent and the layers built on it.

The agent carries calls; two things ride along that belong to layers above it:

- **Per-call state** (:class:`CallExtension`): distributed autograd carries the caller's
  context id into the callee, and records the tensors requiring grad that a message
  carries. The agent asks the extension, never the autograd package.
- **Undo for undelivered messages** (:func:`on_undelivered`): an object pickled into a
  message may take a hold that must be given back if the message never reaches its receiver
  (an RRef fork keeps its value alive until the owner registers the receiver). The agent
  collects these while pickling and runs them when a message is refused, cut off or lost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

__all__ = [
    "CallExtension",
    "TensorReducer",
    "collecting_undo",
    "on_undelivered",
    "pickling_message",
    "run_undo",
]

TensorReducer = Callable[[torch.Tensor, tuple[Any, ...]], Any]
"""Given a tensor requiring grad and the default rebuild arguments, the ``(callable, args)``
pair to pickle it as instead, or None for the default (see ``serialization.dumps``)."""


class CallExtension(Protocol):
    """Per-call state that travels from caller to callee with every call."""

    def capture(self) -> Any:
        """At the caller (and at the callee for the result): the state to carry, or None."""

    def enter(self, state: Any) -> None:
        """At the callee, inside the call's own contextvars context: adopt ``state``."""

    def tensor_reducer(self, state: Any, peer: int) -> TensorReducer | None:
        """How a message for ``peer`` made with ``state`` pickles tensors requiring grad."""


_undo = threading.local()


@contextlib.contextmanager
def collecting_undo() -> Iterator[list[Callable[[], None]]]:
    """Collect the :func:`on_undelivered` callbacks of what is pickled in this block (this
    thread); the caller keeps them with the message."""
    previous = getattr(_undo, "callbacks", None)
    callbacks: list[Callable[[], None]] = []
    _undo.callbacks = callbacks
    try:
        yield callbacks
    finally:
        _undo.callbacks = previous


def on_undelivered(callback: Callable[[], None]) -> None:
    """Called while an object is being pickled into a message: run ``callback`` if that
    message never reaches its receiver. Outside a message (plain ``pickle``) it is dropped."""
    callbacks = getattr(_undo, "callbacks", None)
    if callbacks is not None:
        callbacks.append(callback)


def pickling_message() -> bool:
    """Whether this thread is pickling an rpcdist message right now (RRefs and RemoteModules
    refuse plain ``pickle``, as torch's do)."""
    return getattr(_undo, "callbacks", None) is not None


def run_undo(callbacks: Iterable[Callable[[], None]]) -> None:
    """The message these belong to never arrived: give every hold back."""
    for callback in callbacks:
        try:
            callback()
        except Exception:  # noqa: BLE001 - one failed release must not keep the others
            log.exception("releasing a hold of an undelivered message failed")
