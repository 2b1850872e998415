"""``rpcdist.rpc.functions``: decorators for functions called over RPC."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])
ASYNC_EXECUTION_ATTR = "_rpcdist_async_execution"


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a Future (rpcdist, torch or asyncio) or an awaitable.

    The RPC that calls it completes when that Future does, without holding a worker thread
    meanwhile, as with ``torch.distributed.rpc.functions.async_execution``::

        @rpc.functions.async_execution
        def add_later(x):
            return rpc.rpc_async("ps", torch.add, args=(x, 1)).then(lambda f: f.value() * 2)
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_EXECUTION_ATTR, True)
    # torch's own marker, so torch-decorated functions are recognised and vice versa.
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: Any) -> bool:
    """Whether ``fn`` was decorated with rpcdist's or torch's ``async_execution``."""
    return bool(getattr(fn, ASYNC_EXECUTION_ATTR, False) or hasattr(fn, "_wrapped_async_rpc_function"))


INLINE_ATTR = "_rpcdist_inline"


def inline(func: F) -> F:
    """Internal: mark one of rpcdist's own handlers to run directly on the callee's loop as
    the message arrives (no task, no thread). Only for short functions that never block."""
    setattr(func, INLINE_ATTR, True)
    return func
