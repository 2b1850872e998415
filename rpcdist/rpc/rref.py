"""Remote references: ``RRef`` and ``remote()``.

The owner of an RRef holds its value in the agent's table of owned values, keyed by the
RRef's id (the creating worker's rank and a counter there). Every worker may hold user RRefs
to it and fetch the value (``to_here``) or call its methods through the proxies
``rref.rpc_sync()``, ``rref.rpc_async()`` and ``rref.remote()``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rpcdist import serialization
from rpcdist.errors import RpcError
from rpcdist.futures import Future
from rpcdist.rpc.options import WorkerInfo

T = TypeVar("T")

__all__ = ["RRef", "create_remote"]

_local_ids = itertools.count(1)
RRefId = tuple[int, int]


def _agent() -> Any:
    from rpcdist.rpc import api

    return api._current_agent()


def _owned(agent: Any) -> dict[RRefId, asyncio.Future[Any]]:
    table = getattr(agent, "owned_values", None)
    if table is None:
        table = agent.owned_values = {}
    return table


def _slot(agent: Any, rref_id: RRefId) -> asyncio.Future[Any]:
    """The owner's future for ``rref_id``, created on first mention (creation or fetch)."""
    table = _owned(agent)
    slot = table.get(rref_id)
    if slot is None:
        slot = table[rref_id] = agent.loop.create_future()
    return slot


class RRef(Generic[T]):
    """A reference to a value owned by one worker, as ``torch.distributed.rpc.RRef``.

    ``RRef(value)`` makes this worker the owner of ``value``; ``rpc.remote(...)`` returns an
    RRef owned by the worker that ran the function.
    """

    def __init__(self, value: Any = None, type_hint: Any = None) -> None:
        agent = _agent()
        self._owner: WorkerInfo = agent.info
        self._id: RRefId = (agent.info.id, next(_local_ids))
        self._created: Future[None] = Future(loop=agent.loop)
        self._created.set_result(None)
        self._local: Future[Any] = Future(loop=agent.loop)
        self._local.set_result(value)
        loop = agent.loop
        if _on_loop(loop):
            _slot(agent, self._id).set_result(value)
        else:
            asyncio.run_coroutine_threadsafe(_set_owned(agent, self._id, value), loop).result()

    @classmethod
    def _make(cls, owner: WorkerInfo, rref_id: RRefId, created: Future[None] | None) -> RRef[Any]:
        rref = cls.__new__(cls)
        rref._owner = owner
        rref._id = rref_id
        if created is None:
            created = Future()
            created.set_result(None)
        rref._created = created
        rref._local = None  # type: ignore[assignment]
        return rref

    # -- identity ------------------------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The WorkerInfo of the owner."""
        return self._owner

    def owner_name(self) -> str:
        return self._owner.name

    def is_owner(self) -> bool:
        return self._owner.id == _agent().info.id

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has confirmed it holds (or failed to make) the value."""
        return self._created.done()

    # -- value -----------------------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner (raises RpcError elsewhere)."""
        agent = _agent()
        if self._owner.id != agent.info.id:
            raise RpcError(
                f"local_value() called on worker {agent.info.name}, but this RRef is owned by "
                f"{self._owner.name}; use to_here()"
            )
        slot = _owned(agent).get(self._id)
        if slot is None or not slot.done():
            return self.to_here()
        return slot.result()

    def to_here_async(self, timeout: float = -1.0) -> Future[T]:
        """A Future of the value, copied from the owner (or the value itself on the owner)."""
        from rpcdist.rpc import api

        return api.rpc_async(self._owner, _fetch, args=(self._id,), timeout=timeout)

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied from the owner; raises the creating call's error if it failed."""
        return self.to_here_async(timeout).wait()

    # -- proxies ---------------------------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner and waits."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_async().method(*args)`` returns a Future of ``method``'s result."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """``rref.remote().method(*args)`` returns an RRef (on the owner) to the result."""
        return _Proxy(self, "remote", timeout)

    # -- pickling ----------------------------------------------------------------------------------
    def __reduce__(self) -> Any:
        return (_rebuild_rref, (self._owner, self._id))

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self._local is not None else "UserRRef"
        return f"{kind}(owner={self._owner.name}, id={self._id})"


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def _set_owned(agent: Any, rref_id: RRefId, value: Any) -> None:
    _slot(agent, rref_id).set_result(value)


def _rebuild_rref(owner: WorkerInfo, rref_id: RRefId) -> RRef[Any]:
    return RRef._make(owner, rref_id, None)


class _Proxy:
    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        from rpcdist.rpc import api

        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            call_args = (rref, method, args, kwargs)
            if mode == "remote":
                return api.remote(rref.owner(), _call_method, call_args, timeout=timeout)
            future = api.rpc_async(rref.owner(), _call_method, call_args, timeout=timeout)
            return future.wait() if mode == "sync" else future

        call.__name__ = method
        return call


async def _fetch(rref_id: RRefId) -> Any:
    """On the owner: the value of ``rref_id`` once it exists."""
    return await asyncio.shield(_slot(_agent(), rref_id))


async def _call_method(rref: RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner: ``getattr(value, method)(*args, **kwargs)`` run as calls are run."""
    agent = _agent()
    value = await asyncio.shield(_slot(agent, rref._id))
    return await agent.run_user_function(getattr(value, method), args, kwargs)


async def _create(rref_id: RRefId, func: Callable[..., Any], args: Any, kwargs: Any) -> None:
    """On the owner: run ``func`` and keep its result (or error) under ``rref_id``."""
    agent = _agent()
    slot = _slot(agent, rref_id)
    try:
        value = await agent.run_user_function(func, args, kwargs)
    except BaseException as exc:
        if not slot.done():
            slot.set_exception(exc)
        raise
    if not slot.done():
        slot.set_result(value)


def create_remote(
    agent: Any,
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
) -> RRef[Any]:
    """``rpc.remote``: start ``func`` on ``to`` and return a user RRef at once."""
    dest = agent.worker(to)
    name = serialization.check_importable(func)
    rref_id: RRefId = (agent.info.id, next(_local_ids))
    created = agent.submit(
        dest,
        _create,
        (rref_id, func, tuple(args or ()), dict(kwargs or {})),
        None,
        timeout,
        function_name=name,
    )
    rref = RRef._make(dest, rref_id, created)
    return rref
