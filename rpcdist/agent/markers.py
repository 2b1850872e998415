"""How a function tells the agent the way to run it.

- ``async def`` functions run as tasks on the callee's event loop;
- functions marked :func:`async_execution` (rpcdist's or torch's decorator) return a Future
  or awaitable, and the call completes when it does, without holding a thread;
- rpcdist's own short handlers are marked :func:`inline` and run directly on the loop; one
  may return :class:`RunAsCall` to have a user function run as the call itself;
- everything else runs on the callee's thread pool.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from rpcdist.errors import RpcError
from rpcdist.serialization import trust

F = TypeVar("F", bound=Callable[..., Any])

ASYNC_EXECUTION_ATTR = "_rpcdist_async_execution"
TORCH_ASYNC_EXECUTION_ATTR = "_wrapped_async_rpc_function"  # torch's own marker
INLINE_ATTR = "_rpcdist_inline"
ANYWHERE_ATTR = "_rpcdist_anywhere"
PROMPT_ATTR = "_rpcdist_prompt"
FOR_CONTEXT_ATTR = "_rpcdist_for_context"


def is_async_execution(fn: Any) -> bool:
    """Whether ``fn`` was decorated with rpcdist's or torch's ``async_execution``."""
    return bool(getattr(fn, ASYNC_EXECUTION_ATTR, False) or hasattr(fn, TORCH_ASYNC_EXECUTION_ATTR))


def is_inline(fn: Any) -> bool:
    """Whether ``fn`` is one of rpcdist's own loop-side handlers."""
    return bool(getattr(fn, INLINE_ATTR, False))


def runs_on_thread(fn: Any) -> bool:
    """Whether the callee runs ``fn`` on a thread (a plain function, ``async_execution`` or
    not), rather than on its loop (``async def``, or one of rpcdist's inline handlers)."""
    return not (is_inline(fn) or runs_as_coroutine(fn))


# Plain functions already asked about: inspect's answer walks partials, methods and code flags,
# asked at every call a callee runs (0.54 µs against 0.10 µs for this lookup).
_COROUTINE_FUNCTIONS: dict[types.FunctionType, bool] = {}
_COROUTINE_FUNCTIONS_MAX = 4096


def runs_as_coroutine(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine to await: ``async def``, or torch's
    ``async_execution`` wrapper around one."""
    if type(fn) is not types.FunctionType:
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, TORCH_ASYNC_EXECUTION_ATTR, None)
        )
    known = _COROUTINE_FUNCTIONS.get(fn)
    if known is None:
        if len(_COROUTINE_FUNCTIONS) >= _COROUTINE_FUNCTIONS_MAX:
            _COROUTINE_FUNCTIONS.clear()  # (a program that makes functions on the fly)
        known = _COROUTINE_FUNCTIONS[fn] = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, TORCH_ASYNC_EXECUTION_ATTR, None)
        )
    return known


def inline(func: F) -> F:
    """Internal: mark one of rpcdist's own handlers to run directly on the callee's loop as
    the message arrives (no task, no thread). Only for short functions that never block."""
    setattr(func, INLINE_ATTR, True)
    return func


def anywhere(func: F) -> F:
    """Internal: mark an :func:`inline` handler that is safe on any thread (it locks what it
    touches), so a callee may run it on the thread that read it (a reply channel's)."""
    setattr(func, ANYWHERE_ATTR, True)
    return func


def runs_anywhere(fn: Any) -> bool:
    """Whether ``fn`` is an inline handler marked :func:`anywhere`."""
    return bool(getattr(fn, ANYWHERE_ATTR, False))


def prompt(func: F) -> F:
    """Internal: mark one of rpcdist's own plain handlers (not :func:`inline`: a caller may send
    it as a plain call, see ``rpcdist.transport.reply_channel``) that never blocks and is safe
    on any thread: it returns at once, a value or a Future it settles later (a fetch of an
    RRef's value). A callee runs it where it reads it (the loop, or a reply channel's thread)
    without a place in the worker pool, so a pool whose places are all held by user functions
    blocked on their own waits cannot hold it up (they may be waiting for what it answers)."""
    setattr(func, PROMPT_ATTR, True)
    return func


def is_prompt(fn: Any) -> bool:
    """Whether ``fn`` is a plain handler marked :func:`prompt`."""
    return bool(getattr(fn, PROMPT_ATTR, False))


def for_context(func: F) -> F:
    """Internal: mark one of rpcdist's own functions that works on the distributed autograd
    context it is given (a backward pass, an optimizer step), as a call made inside a context
    does: the releases of other contexts its caller deferred may go out after such a call and
    run after it (see ``Caller.notify``'s ``deferred``), as nothing it does depends on them."""
    setattr(func, FOR_CONTEXT_ATTR, True)
    return func


def is_for_context(fn: Any) -> bool:
    """Whether ``fn`` is marked :func:`for_context`."""
    return bool(getattr(fn, FOR_CONTEXT_ATTR, False))


class RunAsCall(NamedTuple):
    """What an :func:`inline` handler returns to have ``func(*args, **kwargs)`` run as the call
    it handles is run, exactly as if the caller had called ``func`` (a plain function on a pool
    thread that answers itself, ``async def`` on the loop, ...): an RRef's method called through
    its proxy once the handler has found the value, without a hop back to the loop (once the
    RRefs in the call's arguments are confirmed, if it awaits that: ``confirmation_gate``)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


WITH_VALUE_ATTR = "_rpcdist_with_value"


def answers_value_with(variant: Callable[..., Any]) -> Callable[[F], F]:
    """Internal: mark one of rpcdist's own handlers as having ``variant``, which takes the same
    arguments and answers with the value the call makes (as a :class:`ValueAnswer`); a request
    whose ``Envelope.with_value`` is set runs it instead (an RRef's creation that a
    ``to_here()`` rides on)."""

    def mark(func: F) -> F:
        setattr(func, WITH_VALUE_ATTR, variant)
        return func

    return mark


def with_value_variant(fn: Any, function: str) -> Callable[..., Any]:
    """The variant of ``fn`` that answers with its value (see :func:`answers_value_with`);
    RpcError when it has none (a request may not ask that of any other function)."""
    variant = getattr(fn, WITH_VALUE_ATTR, None)
    if variant is None:
        raise RpcError(f"{function} cannot answer with the value it makes (Envelope.with_value)")
    return variant


class ValueAnswer:
    """What a with-value variant's call settles with: the callee answers ``value`` itself. If
    that cannot be pickled, it answers :class:`ValueNotSent` instead of an error: the call
    succeeded (an RRef was created), only its value could not travel. ``fetch`` names, for that
    error, what the caller asked the value with (``"RRef.to_here"``)."""

    __slots__ = ("value", "fetch")

    def __init__(self, value: Any, fetch: str) -> None:
        self.value = value
        self.fetch = fetch


@trust
class ValueNotSent:
    """The answer of a with-value call whose value could not be pickled: the ERROR message a
    separate fetch of the value would have had (``rpcdist.agent.codec.describe_error``), for
    the caller to raise (``rpcdist.agent.codec.rebuild_error``)."""

    __slots__ = ("payload", "buffers")

    def __init__(self, payload: bytes, buffers: list[bytes]) -> None:
        self.payload = payload
        self.buffers = buffers

    def __reduce__(self) -> tuple[Any, ...]:
        return (ValueNotSent, (self.payload, self.buffers))
