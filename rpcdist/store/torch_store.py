"""torch's own c10d stores behind rpcdist's :class:`~rpcdist.store.api.Store` interface.

:class:`TorchStore` adapts any ``torch.distributed.Store`` (a ``TCPStore``, the agent store
torchrun's workers connect to, a ``PrefixStore`` over it, torch's ``FileStore`` or
``HashStore``) so rpcdist's rendezvous, process groups and RPC can use it::

    raw = torch.distributed.TCPStore("127.0.0.1", 29500, world_size=2, is_master=True)
    store = TorchStore(raw)
    await store.set_async("k", b"v")          # from async code, never blocking the loop
    store.get("k")                            # blocking, torch's names

:class:`TCPStore` is torch's ``TCPStore`` server/client with torch's constructor, wrapped the
same way (``rpcdist.TCPStore`` is a drop-in for ``torch.distributed.TCPStore``).

How calls run
-------------
torch's store calls block, so each operation runs in a short-lived daemon thread
(``rpcdist-torch-store``), never on the event loop, and the coroutine awaits its result.
The adapter never uses the torch store it was given (whose other users it cannot see): it
works through *clones* (``store.clone()``: another connection to the same server, another
handle on the same data). Short operations (set, add, check...) share one; a ``get``/``wait``
takes one of its own from a small pool, because a torch TCPStore client holds its socket for
the whole of a blocking call: a ``wait`` for a key never holds up the ``set`` that would
satisfy it. A connection that failed is replaced (a new one may take
:data:`_CONNECT_TIMEOUT` seconds at most, so a server that is gone is reported in bounded
time; not less, because torch's server looks up each new client's address in DNS before it
answers it, which takes 5 s or more on a host whose DNS server does not answer). A
store that cannot be cloned (a Python subclass of ``torch.distributed.Store``) is called
directly.

Timeouts and errors
-------------------
rpcdist's timeouts are honoured: ``get``/``wait`` hand theirs to torch (one blocking call),
and every call is also bounded on the loop (its timeout plus a few seconds' grace), so a hung
connection cannot hang the caller. A timeout of 0 (or less) waits without limit, as elsewhere
in rpcdist: torch has no such wait, so the adapter polls ``check`` (1 ms, doubling to 50 ms)
and stops as soon as the caller goes away (cancelled, or the store closed). A limited wait
whose caller went away keeps its daemon thread until the timeout, as torch gives no way to
interrupt it.

torch's errors become rpcdist's, which are still torch's types: a wait that timed out raises
:class:`~rpcdist.errors.StoreTimeoutError` (a ``DistStoreError``), a refused or lost
connection :class:`~rpcdist.errors.StoreConnectionError` (a ``DistNetworkError``), ``add`` on
a value that is not a number :class:`~rpcdist.errors.StoreValueError` naming the key (torch's
TCPStore server drops the connection of a client that does that; the adapter replaces that
clone). Counters otherwise follow torch (``add`` reads a value the way C's ``stoll`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as tdist

from rpcdist.errors import (
    DistNetworkError,
    DistStoreError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    StoreValueError,
)
from rpcdist.store.api import DEFAULT_TIMEOUT, Store, to_seconds
from rpcdist.store.memory import parse_counter, timeout_error

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["TorchStore", "TCPStore"]

_MAX_IDLE_CLIENTS = 8  # clones kept for reuse; more are made on demand and dropped after
_POLL_START = 0.001  # a wait without limit polls check(), from every 1 ms ...
_POLL_CAP = 0.05  # ... doubling to every 50 ms
_GRACE = 5.0  # seconds the loop waits past a timeout before giving up on a torch call
_FOREVER = timedelta(days=365)  # a client timeout that does not run out
# Seconds a new connection of ours may take (a dead server fails then). More than the 5 s a
# resolver waits for an unanswered DNS query: torch's server does a reverse lookup per client.
_CONNECT_TIMEOUT = 15.0


class _Abandoned(Exception):
    """The caller of a get/wait went away (cancelled, or the store closed)."""


def _limited(seconds: float) -> bool:
    return 0 < seconds < math.inf


def _first_line(exc: BaseException) -> str:
    """torch's messages carry a C++ stack after the first line; keep the sentence."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, DistNetworkError):
        return False
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timeout" in text or "timed out" in text)


def _translate(exc: BaseException, what: str, keys: list[str], timeout: float) -> BaseException:
    """The rpcdist error for an exception a torch store call raised (``exc`` is its cause)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, DistNetworkError):
        return StoreConnectionError(f"store {what} failed, no connection to the store: {_first_line(exc)}")
    if _is_timeout(exc):
        if keys:
            return timeout_error(keys, timeout)
        return StoreTimeoutError(f"store {what} timed out: {_first_line(exc)}")
    if isinstance(exc, ValueError):
        return StoreValueError(f"store {what} failed: {_first_line(exc)}")
    if isinstance(exc, RuntimeError):  # includes torch's DistError family
        return StoreError(f"store {what} failed: {_first_line(exc)}")
    return exc


def _clone_of(store: tdist.Store) -> tdist.Store | None:
    """Another handle on ``store`` (a new connection for TCPStore), or None if its kind has
    none (a Python subclass). A failure to connect is raised."""
    try:
        return store.clone()
    except (NotImplementedError, AttributeError) as exc:
        log.debug("%s cannot be cloned (%s)", type(store).__name__, exc)
        return None
    except RuntimeError as exc:
        if isinstance(exc, tdist.DistError):
            raise
        log.debug("%s cannot be cloned (%s)", type(store).__name__, exc)  # "pure virtual"
        return None


def _missing(client: tdist.Store, keys: list[str]) -> list[str]:
    """The keys of a timed-out wait that are still not set (all of them if that fails)."""
    try:
        return [k for k in keys if not client.check([k])] or keys
    except (RuntimeError, ValueError):
        return keys


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled or timed out)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run ``fn`` in a new daemon thread; the returned future (of the running loop) gets its
    outcome. Daemon and short-lived: nothing is left behind when the call is done, and a call
    still blocked in torch never holds the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=run, name="rpcdist-torch-store", daemon=True).start()
    return future


class TorchStore(Store):
    """Any ``torch.distributed.Store`` as an rpcdist :class:`~rpcdist.store.api.Store`.

    Args:
        store: the torch store (``TCPStore``, ``PrefixStore``, ``FileStore``, ``HashStore``,
            torchrun's agent store...). The adapter does not take it over: it works through
            clones of its own, which closing the adapter drops; ``store`` stays as it was.
        timeout: default timeout of ``get``/``wait`` (seconds or ``timedelta``); ``None`` takes
            ``store.timeout``.
    """

    def __init__(self, store: tdist.Store, timeout: float | timedelta | None = None) -> None:
        if not isinstance(store, tdist.Store):
            raise TypeError(f"TorchStore wraps a torch.distributed.Store, not {type(store).__name__}")
        default = DEFAULT_TIMEOUT
        with contextlib.suppress(RuntimeError, AttributeError):  # a Python subclass may have none
            default = store.timeout.total_seconds()
        super().__init__(to_seconds(timeout, default))
        self._torch_store: tdist.Store | None = store
        # Short operations share one clone of our own ("main"); get/wait take pooled clones.
        self._main: tdist.Store | None = None
        self._main_broken = False  # its connection failed: replace it before the next use
        self._main_lock = threading.Lock()  # held for each use of main (torch would serialise)
        self._cloneable = True
        self._idle: list[tdist.Store] = []
        self._pool_lock = threading.Lock()
        self._waiting: set[threading.Event] = set()  # of get/wait calls in progress

    @property
    def torch_store(self) -> tdist.Store:
        """The wrapped ``torch.distributed.Store`` (e.g. to build a torch process group on it)."""
        store = self._torch_store
        if store is None:
            raise StoreError("this store is closed")
        return store

    # -- clients --------------------------------------------------------------------------------
    def _connect_timeout(self) -> timedelta:
        return timedelta(
            seconds=min(_CONNECT_TIMEOUT, self._timeout if _limited(self._timeout) else math.inf)
        )

    def _main_client(self) -> tdist.Store:
        """Our handle for short operations (``_main_lock`` held): a clone of the torch store,
        made on first use and remade (connecting for at most a few seconds) after its
        connection failed; the torch store itself when it cannot be cloned."""
        original = self.torch_store
        if self._main is None and self._cloneable:
            self._main = _clone_of(original)
            self._cloneable = self._main is not None
        if self._main is None:
            return original
        if self._main_broken:
            self._main.set_timeout(self._connect_timeout())
            fresh = _clone_of(self._main)  # raises if the server cannot be reached
            assert fresh is not None
            self._main, self._main_broken = fresh, False
        return self._main

    def _acquire(self) -> tdist.Store:
        """A handle no other operation of this adapter is using, for a get/wait."""
        with self._pool_lock:
            if self._idle:
                return self._idle.pop()
        with self._main_lock:
            main = self._main_client()
            if main is self._torch_store:  # not cloneable: share it
                return main
            main.set_timeout(self._connect_timeout())
            clone = _clone_of(main)
            assert clone is not None
            return clone

    def _release(self, client: tdist.Store, healthy: bool) -> None:
        if client is self._torch_store or not healthy:
            return  # a broken clone is dropped (closing its connection) and replaced on demand
        with self._pool_lock:
            if self._torch_store is not None and len(self._idle) < _MAX_IDLE_CLIENTS:
                self._idle.append(client)

    def _call(
        self,
        what: str,
        op: Callable[[tdist.Store, bool], T],
        keys: list[str],
        timeout: float,
        blocking: bool,
    ) -> T:
        """In a worker thread: run ``op(client, own)`` (``own``: a clone of ours, whose timeout
        is ours to set) on the main client or, for a get/wait, a pooled one; translate torch's
        errors. A TCPStore server drops the connection of a client whose request failed, so a
        client is never reused after a network or value error."""
        try:
            if not blocking:
                with self._main_lock:
                    client = self._main_client()
                    own = client is not self._torch_store
                    try:
                        if own:
                            client.set_timeout(timedelta(seconds=timeout) if _limited(timeout) else _FOREVER)
                        return op(client, own)
                    except (DistNetworkError, ValueError):
                        self._main_broken = own
                        raise
            client = self._acquire()
            own = client is not self._torch_store
            healthy = True
            try:
                if own:
                    client.set_timeout(timedelta(seconds=timeout) if _limited(timeout) else _FOREVER)
                return op(client, own)
            except (DistNetworkError, ValueError):
                healthy = False
                raise
            finally:
                self._release(client, healthy)
        except _Abandoned:
            raise StoreError(f"store {what} abandoned: store closed or call cancelled") from None
        except BaseException as exc:
            translated = _translate(exc, what, keys, timeout)
            if translated is exc:
                raise
            raise translated from exc

    def _blocking_wait(
        self,
        client: tdist.Store,
        own: bool,
        keys: list[str],
        timeout: float,
        abandoned: threading.Event,
        then: Callable[[], T],
    ) -> T:
        """Wait for ``keys``, then return ``then()``: a limited wait is one torch call; one
        without limit polls ``check`` while the caller still wants the answer."""
        if _limited(timeout):
            deadline = time.monotonic() + timeout
            while True:
                step = max(deadline - time.monotonic(), 0.001)
                try:
                    if own:  # a clone of ours: get/wait use its timeout
                        client.set_timeout(timedelta(seconds=step))
                    else:
                        client.wait(keys, timedelta(seconds=step))
                    return then()
                except (DistStoreError, RuntimeError) as exc:
                    if not _is_timeout(exc):
                        raise
                    # torch may round a timeout down: only a timeout at the deadline is final
                    if time.monotonic() >= deadline - 0.01:
                        raise timeout_error(_missing(client, keys), timeout) from exc
        pause = _POLL_START
        while not client.check(keys):
            if abandoned.is_set() or self._torch_store is None:
                raise _Abandoned
            time.sleep(pause)
            pause = min(pause * 2, _POLL_CAP)
        return then()

    async def _run(
        self,
        what: str,
        op: Callable[[tdist.Store, bool], T],
        keys: list[str] | None = None,
        timeout: float | None = None,
        blocking: bool = False,
    ) -> T:
        """Run a torch call in a thread, bounded on the loop by ``timeout`` plus grace."""
        if self._torch_store is None:
            raise StoreError(f"store {what} on a closed store")
        seconds = self._timeout if timeout is None else timeout
        keys = keys or []
        future = _in_thread(lambda: self._call(what, op, keys, seconds, blocking))
        if not _limited(seconds):
            return await future
        try:
            # Not wait_for: the call's own StoreTimeoutError is a TimeoutError too.
            done, _ = await asyncio.wait({future}, timeout=seconds + _GRACE)
        finally:
            future.cancel()  # no-op once done; else (cancelled or too late) nobody wants it
        if not done:
            if keys:
                raise timeout_error(keys, seconds)
            raise StoreTimeoutError(f"store {what} did not complete within {seconds:g} s")
        return future.result()

    async def _run_wait(
        self, what: str, keys: list[str], timeout: float, then: Callable[[tdist.Store], T]
    ) -> T:
        abandoned = threading.Event()
        self._waiting.add(abandoned)
        try:
            return await self._run(
                what,
                lambda client, own: self._blocking_wait(
                    client, own, keys, timeout, abandoned, lambda: then(client)
                ),
                keys,
                timeout,
                blocking=True,
            )
        finally:
            abandoned.set()  # done, failed or cancelled: a polling wait stops
            self._waiting.discard(abandoned)

    # -- the Store interface ------------------------------------------------------------------------
    async def _set(self, key: str, value: bytes) -> None:
        await self._run("set", lambda s, _: s.set(key, value))

    async def _get(self, key: str, timeout: float) -> bytes:
        return await self._run_wait("get", [key], timeout, lambda s: bytes(s.get(key)))

    async def _wait(self, keys: list[str], timeout: float) -> None:
        # On a clone of ours the client's timeout bounds the wait; on a shared store the
        # keys are there already when this runs.
        await self._run_wait("wait", keys, timeout, lambda s: s.wait(keys))

    async def _add(self, key: str, amount: int) -> int:
        try:
            return await self._run("add", lambda s, _: int(s.add(key, amount)))
        except (StoreValueError, StoreConnectionError) as failure:
            # torch says only "stoll" for a value that is not a number, and its TCPStore server
            # drops the connection then: say which key holds what, if that is the case.
            try:
                held = await self._run("add", lambda s, _: s.get(key) if s.check([key]) else None)
            except StoreError:
                raise failure from None
            if held is not None:
                parse_counter(key, bytes(held))  # raises StoreValueError naming the key
            raise

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return await self._run("compare_set", lambda s, _: bytes(s.compare_set(key, expected, desired)))

    async def _check(self, keys: list[str]) -> bool:
        return await self._run("check", lambda s, _: bool(s.check(keys)))

    async def _delete_key(self, key: str) -> bool:
        def op(client: tdist.Store, _: bool) -> bool:
            if isinstance(client, tdist.FileStore):  # torch's FileStore always answers True
                existed = bool(client.check([key]))
                client.delete_key(key)
                return existed
            return bool(client.delete_key(key))

        return await self._run("delete_key", op)

    async def _num_keys(self) -> int:
        return await self._run("num_keys", lambda s, _: int(s.num_keys()))

    async def _close(self) -> None:
        for abandoned in list(self._waiting):  # polling waits end
            abandoned.set()
        with self._pool_lock:
            self._idle.clear()
            self._torch_store = None
        self._main = None  # a call still running keeps its own reference until it ends

    def __repr__(self) -> str:
        inner = "closed" if self._torch_store is None else type(self._torch_store).__name__
        return f"<{type(self).__name__} {inner} timeout={self._timeout:g}s>"


def _make_tcp_store(
    host_name: str,
    port: int,
    world_size: int | None,
    is_master: bool,
    timeout: float,
    wait_for_workers: bool,
    multi_tenant: bool,
    master_listen_fd: int | None,
    use_libuv: bool,
) -> tdist.TCPStore:
    try:
        return tdist.TCPStore(
            host_name,
            port,
            world_size,
            is_master,
            timedelta(seconds=timeout) if _limited(timeout) else _FOREVER,
            wait_for_workers,
            multi_tenant,
            master_listen_fd,
            use_libuv,
        )
    except DistNetworkError as exc:
        role = "serve on" if is_master else "connect to"
        raise StoreConnectionError(f"TCPStore cannot {role} {host_name}:{port}: {_first_line(exc)}") from exc
    except (RuntimeError, ValueError) as exc:
        translated = _translate(exc, f"TCPStore({host_name}:{port}) set-up", [], timeout)
        if translated is exc:
            raise
        raise translated from exc


class TCPStore(TorchStore):
    """torch's ``TCPStore`` (server on ``is_master``, client everywhere), as an rpcdist store.

    Same constructor and semantics as ``torch.distributed.TCPStore``: the master serves on
    ``host_name:port`` (``port=0`` picks a free one, see :attr:`port`) and, with
    ``wait_for_workers``, the constructor returns once ``world_size`` stores have connected;
    clients retry connecting until ``timeout``. The constructor blocks, as torch's does;
    inside async code use ``await TCPStore.create_async(...)``. ``timeout`` may also be given
    in seconds.

    Errors are rpcdist's, which are torch's types too: a refused/lost connection raises
    :class:`~rpcdist.errors.StoreConnectionError` (``DistNetworkError``), a wait that times
    out :class:`~rpcdist.errors.StoreTimeoutError` (``DistStoreError``). A master's server runs
    until the store is closed (or garbage-collected) in its process.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | float = timedelta(seconds=300),  # noqa: B008 - torch's default, immutable
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> None:
        seconds = to_seconds(timeout, DEFAULT_TIMEOUT)
        raw = _make_tcp_store(
            host_name,
            port,
            world_size,
            is_master,
            seconds,
            wait_for_workers,
            multi_tenant,
            master_listen_fd,
            use_libuv,
        )
        super().__init__(raw, seconds)
        self._remember(raw)

    @classmethod
    async def create_async(
        cls,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | float = timedelta(seconds=300),  # noqa: B008
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> TCPStore:
        """The constructor for async code: connects (and waits for workers) in a thread, and
        binds the store to the running loop."""
        seconds = to_seconds(timeout, DEFAULT_TIMEOUT)
        raw = await _in_thread(
            lambda: _make_tcp_store(
                host_name,
                port,
                world_size,
                is_master,
                seconds,
                wait_for_workers,
                multi_tenant,
                master_listen_fd,
                use_libuv,
            )
        )
        store = cls.__new__(cls)
        TorchStore.__init__(store, raw, seconds)
        store._remember(raw)
        return store

    def _remember(self, raw: tdist.TCPStore) -> None:
        # Kept as plain values: after close() the torch store (and a master's server, once
        # no handle is left) is gone, and host/port still answer.
        self._host: str = raw.host
        self._port: int = raw.port
        self._libuv: bool = raw.libuvBackend

    @property
    def host(self) -> str:
        """The host the store serves on / connects to."""
        return self._host

    @property
    def port(self) -> int:
        """The store's port (the one picked when the master was given port 0)."""
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        """Whether the server side uses torch's libuv backend."""
        return self._libuv

    def __repr__(self) -> str:
        return f"<TCPStore {self.host}:{self.port} timeout={self._timeout:g}s>"
