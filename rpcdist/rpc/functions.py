"""``rpcdist.rpc.functions``: decorators for functions called over RPC."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from rpcdist.agent.markers import ASYNC_EXECUTION_ATTR, TORCH_ASYNC_EXECUTION_ATTR

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


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
    setattr(wrapper, TORCH_ASYNC_EXECUTION_ATTR, fn)
    return wrapper  # type: ignore[return-value]
