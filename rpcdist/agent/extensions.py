"""The explicit interface between the agent and the layers built on it.

The agent carries calls; two things ride along that belong to layers above it:

- **Per-call state** (:class:`CallExtension`): distributed autograd carries the caller's
  context id into the callee, and records the tensors requiring grad that a message
  carries. The agent asks the extension, never the autograd package.
- **Undo for undelivered messages** (:func:`on_undelivered`): an object pickled into a
  message may take a hold that must be given back if the message never reaches its receiver
  (an RRef fork keeps its value alive until the owner registers the receiver). The agent
  collects these while pickling and runs them when a message is refused, cut off or lost.
- **Confirmations a call waits for** (:func:`on_unconfirmed`): an object unpickled from a
  request may need a third party's confirmation before the call may use it (a user RRef
  forked to this worker, until its owner has registered it). The callee collects these
  while unpickling a request and runs the call only once all have arrived.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import torch

log = logging.getLogger(__name__)

__all__ = [
    "CallExtension",
    "TensorReducer",
    "CollectingUndo",
    "CollectingUnconfirmed",
    "Unconfirmed",
    "confirmation_gate",
    "on_undelivered",
    "on_unconfirmed",
    "Holds",
    "decoded_in_order",
    "message_receiver",
    "ordered_receiver",
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


class Holds(list):  # type: ignore[type-arg]
    """The undo callbacks of one message (see :class:`CollectingUndo`), and whether it carries
    something its receiver must decode on its loop, in arrival order with everything else it
    receives (an RRef: see :func:`decoded_in_order`)."""

    ordered = False


class CollectingUndo:
    """``with CollectingUndo() as undo:`` collects the :func:`on_undelivered` callbacks of
    what is pickled in the block (this thread); the caller keeps them with the message.
    (A class, not a generator context manager: every message goes through it.)

    ``ordered_to``: the rank of the receiver when the message goes out on this worker's own
    link to it (a call or a notice, not an answer), so that the receiver decodes it before
    anything this worker sends it afterwards (see :func:`ordered_receiver`). ``receiver``:
    the rank of the one worker the message is for (any message; see :func:`message_receiver`)."""

    __slots__ = ("callbacks", "ordered_to", "receiver", "_previous")

    def __init__(self, ordered_to: int | None = None, receiver: int | None = None) -> None:
        self.ordered_to = ordered_to
        self.receiver = receiver

    def __enter__(self) -> Holds:
        self._previous = (
            getattr(_undo, "callbacks", None),
            getattr(_undo, "ordered_to", None),
            getattr(_undo, "receiver", None),
        )
        self.callbacks: Holds = Holds()
        _undo.callbacks = self.callbacks
        _undo.ordered_to = self.ordered_to
        _undo.receiver = self.receiver
        return self.callbacks

    def __exit__(self, *exc: object) -> None:
        _undo.callbacks, _undo.ordered_to, _undo.receiver = self._previous


def on_undelivered(callback: Callable[[], None]) -> None:
    """Called while an object is being pickled into a message: run ``callback`` if that
    message never reaches its receiver. Outside a message (plain ``pickle``) it is dropped."""
    callbacks = getattr(_undo, "callbacks", None)
    if callbacks is not None:
        callbacks.append(callback)


def decoded_in_order() -> None:
    """Called while an object is being pickled into a message: its receiver must decode it on
    its event loop, in arrival order with the other messages it gets (an RRef, whose protocol
    relies on that order). Such a message never takes a reply channel (a call's arguments, or
    an answer: see ``rpcdist.transport.reply_channel``)."""
    callbacks = getattr(_undo, "callbacks", None)
    if callbacks is not None:
        callbacks.ordered = True


def ordered_receiver() -> int | None:
    """While pickling a call or notice: the receiver's rank. The receiver decodes it on its
    loop before any message this worker sends it later (one ordered link per caller and peer,
    decoded in arrival order), so an object it carries needs no hold against this worker's own
    later messages (an RRef sent to its owner: the user's deletion cannot overtake it).
    None while pickling an answer or outside a message."""
    return getattr(_undo, "ordered_to", None)


def message_receiver() -> int | None:
    """While pickling a message (a call, a notice or an answer) for one other worker: its
    rank. None for a message to this worker itself, or outside a message."""
    return getattr(_undo, "receiver", None)


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


class Unconfirmed(NamedTuple):
    """A confirmation a call must wait for: a future (an rpcdist Future) that completes when
    it arrives, and what it confirms (for the error if it fails)."""

    future: Any
    what: str


_unconfirmed = threading.local()


class CollectingUnconfirmed:
    """``with CollectingUnconfirmed() as pending:`` collects the :func:`on_unconfirmed`
    confirmations of what is unpickled in the block (this thread): the callee's request decode."""

    __slots__ = ("pending", "_previous")

    def __enter__(self) -> list[Unconfirmed]:
        self._previous = getattr(_unconfirmed, "pending", None)
        self.pending: list[Unconfirmed] = []
        _unconfirmed.pending = self.pending
        return self.pending

    def __exit__(self, *exc: object) -> None:
        _unconfirmed.pending = self._previous


def on_unconfirmed(future: Any, what: str) -> None:
    """Called while an object is being unpickled from a request: the call must not run before
    ``future`` completes. Outside a request decode (a result, plain ``pickle``) it is dropped."""
    pending = getattr(_unconfirmed, "pending", None)
    if pending is not None:
        pending.append(Unconfirmed(future, what))


confirmation_gate: contextvars.ContextVar[asyncio.Future[None] | None] = contextvars.ContextVar(
    "rpcdist_confirmation_gate", default=None
)
"""Inside one of rpcdist's inline handlers whose request carried unconfirmed objects: the loop
future that completes once they are all confirmed (fails if one cannot be). The user function
the handler starts (``Agent.start_user_function``/``run_user_function``) waits for it; the
handler's own bookkeeping (registering the caller of ``remote()``) does not, so it keeps the
arrival order its protocol relies on."""
