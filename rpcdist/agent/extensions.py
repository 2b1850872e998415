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

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

__all__ = [
    "CallExtension",
    "TensorReducer",
    "CollectingUndo",
    "on_undelivered",
    "pickling_message",
    "run_undo",
]

TensorReducer = Callable[[torch.Tensor, Callable[..., torch.Tensor], tuple[Any, ...]], Any]
"""Given a tensor requiring grad and the default ``(rebuild, args)`` that remake it, the
``(callable, args)`` pair to pickle it as instead, or None for the default (see
``serialization.dumps``)."""


class CallExtension(Protocol):
    """Per-call state that travels from caller to callee with every call."""

    def capture(self) -> Any:
        """At the caller (and at the callee for the result): the state to carry, or None."""

    def enter(self, state: Any) -> None:
        """At the callee, inside the call's own contextvars context: adopt ``state``."""

    def tensor_reducer(self, state: Any, peer: int) -> TensorReducer | None:
        """How a message for ``peer`` made with ``state`` pickles tensors requiring grad."""


_undo = threading.local()


class CollectingUndo:
    """``with CollectingUndo() as undo:`` collects the :func:`on_undelivered` callbacks of
    what is pickled in the block (this thread); the caller keeps them with the message.
    (A class, not a generator context manager: every message goes through it.)"""

    __slots__ = ("callbacks", "_previous")

    def __enter__(self) -> list[Callable[[], None]]:
        self._previous = getattr(_undo, "callbacks", None)
        self.callbacks: list[Callable[[], None]] = []
        _undo.callbacks = self.callbacks
        return self.callbacks

    def __exit__(self, *exc: object) -> None:
        _undo.callbacks = self._previous


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
