"""Remote references: ``RRef``, ``remote()``, and the reference counting that keeps a remote
value alive exactly as long as some RRef anywhere can reach it.

The protocol (the guarantees torch documents for its RRefs, kept with fewer messages):

- The **owner** keeps each value in an :class:`_OwnerEntry` with a count per rank that
  holds user RRefs to it and the number of RRef objects on the owner itself. The value is
  freed when both are empty.
- A process holds at most one **user RRef** object per value (unpickling an RRef it already
  holds returns that object); the object keeps how many times the owner counted this
  process for it, and when it is garbage-collected, or its process shuts down, it tells the
  owner that number (``_user_deleted``), which the owner subtracts. ``remote()`` counts its
  caller in the same message that creates the value.
- **Forks from the owner** cost no message: the owner counts the receiver while pickling the
  RRef (before the message can leave), so the receiver's deletion, whenever it arrives,
  finds the count it undoes (torch's early fork registration). An owner RRef sent in a
  message that never arrives is uncounted.
- **Forks between users**: whoever pickles an RRef into a message keeps its own RRef alive
  (a "pending child") until the owner has registered (counted) the receiver (``_register``);
  only then may the sender's own deletion reach the owner, so passing an RRef from A to B
  while A drops it never frees the value early. Messages from one worker to another arrive
  in order, so a holder's registration always precedes its deletion.
- A call whose arguments bring a worker a user RRef it did not hold runs only once the owner
  has registered that worker (as torch's: ``confirmed_by_owner()`` is true inside it); if the
  owner cannot confirm it within the call's timeout, the call fails with that error.
- If the function of ``remote()`` fails, every ``to_here()`` raises its error; if the owner
  is gone, ``to_here()`` raises WorkerUnavailableError naming it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import itertools
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from rpcdist import serialization
from rpcdist._runtime import blocking_wait, current_loop
from rpcdist.agent.codec import rebuild_error
from rpcdist.agent.current import NO_AGENT_FOR_RREF
from rpcdist.agent.extensions import (
    confirmation_gate,
    decoded_in_order,
    message_receiver,
    on_unconfirmed,
    on_undelivered,
    ordered_receiver,
    pickling_message,
)
from rpcdist.agent.markers import (
    ASYNC_EXECUTION_ATTR,
    RunAsCall,
    ValueAnswer,
    ValueNotSent,
    answers_value_with,
    inline,
    is_async_execution,
    prompt,
)
from rpcdist.agent.options import WorkerInfo
from rpcdist.errors import RestrictedError, RpcError, RpcTimeoutError, annotate_remote
from rpcdist.futures import Future
from rpcdist.rpc import profiling
from rpcdist.serialization import trust

if TYPE_CHECKING:
    from rpcdist.agent import Agent

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RRef", "attach", "create_remote", "debug_info", "detach", "release_all_users"]

RRefId = tuple[int, int, int]  # (owner rank, rank that created it, counter there)
_counter = itertools.count(1)
NO_HOLD = 0  # the fork token of an RRef sent to its owner in a call: nothing to release
OWNER_COUNTED = -1  # the fork token of an RRef its owner sent, having counted the receiver
_current: RRefContext | None = None


def attach(agent: Agent) -> RRefContext:
    """Start the RRef protocol on ``agent`` (``init_rpc``); this process's RRefs use it."""
    global _current
    _current = RRefContext(agent)
    agent.status_sources.append(_current.debug_info)  # rpcdist-status and the metrics show them
    return _current


def detach() -> None:
    """Stop the RRef protocol (``shutdown``): owned values are dropped, no messages sent."""
    global _current
    context, _current = _current, None
    if context is not None:
        context.close()


def release_all_users() -> None:
    """At graceful shutdown: tell every owner this process holds no RRefs any more."""
    if _current is not None:
        _current.release_all_users()


def _context() -> RRefContext:
    context = _current
    if context is None:
        raise RpcError(NO_AGENT_FOR_RREF)
    return context


def _agent() -> Agent:
    return _context().agent


class _OwnerEntry:
    __slots__ = ("value", "holders", "local_refs", "waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.value: asyncio.Future[Any] = loop.create_future()
        # rank -> how many times it was counted and has not said so back (never 0: the key
        # goes; below 0 while an uncounting overtook its count, which keeps the value: safe)
        self.holders: dict[int, int] = {}
        self.local_refs = 0
        # Fetches waiting for a value still being made (None: none yet), answered by the pool
        # thread that makes it (see made; then _MADE). Each also waits on ``value``, which the
        # loop sets: a fetch that came too late for this list, a failure, another way of making.
        self.waiters: list[Future[Any]] | None = None

    def wait(self) -> Future[Any]:
        """A Future of the value (still being made), from whichever settles it first: the
        thread that makes it, or the loop (any thread; ``value`` is not done yet)."""
        waiter: Future[Any] = Future()
        waiters = self.waiters
        if waiters is None:
            self.waiters = [waiter]
        elif waiters is not _MADE:
            waiters.append(waiter)
        return waiter

    def made(self, value: Any) -> None:
        """On the pool thread that made the value, before the loop learns it: the fetches that
        wait for it are answered from there (a wake-up of the loop fewer before the answer)."""
        waiters, self.waiters = self.waiters, _MADE
        if waiters is not None and waiters is not _MADE:
            for waiter in waiters:
                waiter._try_complete(value, None)


_MADE: list[Future[Any]] = []
"""``_OwnerEntry.waiters`` once the value's maker has answered them (never appended to)."""


class RRefContext:
    """One per agent: the owner table, the user RRefs of this process, and pending forks."""

    def __init__(self, agent: Agent) -> None:
        self._agent = weakref.ref(agent)  # never keeps a shut-down agent alive
        self.owned: dict[RRefId, _OwnerEntry] = {}
        self.users: dict[RRefId, weakref.ref[RRef[Any]]] = {}
        self.pending_children: dict[int, RRef[Any]] = {}
        # remote() calls to other workers not encoded yet -> [their timeout, the to_here()
        # Future riding on them or None] (see ride_on_creation)
        self.unsent_creations: dict[RRefId, list[Any]] = {}
        # users/pending_children, and the owner's entries and counts (made on the loop, and
        # by a thread that pickles an owner RRef: see count_holder), are touched from any thread;
        # re-entrant because the garbage collector may run an RRef finalizer (which takes it)
        # inside any locked block.
        self._lock = threading.RLock()
        self._tokens = itertools.count(NO_HOLD + 1)
        self._closed = False

    @property
    def agent(self) -> Agent:
        agent = self._agent()
        if agent is None:
            raise RpcError("RPC agent is gone (shut down)")
        return agent

    # -- owner side (on the loop, but count_holder) ----------------------------------------------
    def entry(self, rref_id: RRefId) -> _OwnerEntry:
        """The owner's entry for ``rref_id``, made on first mention (creation, fetch or fork)."""
        entry = self.owned.get(rref_id)
        if entry is None:
            with self._lock:
                entry = self.owned.get(rref_id)
                if entry is None:
                    entry = self.owned[rref_id] = _OwnerEntry(self.agent.loop)
        return entry

    def count_holder(self, rref_id: RRefId, rank: int) -> None:
        """``rank`` holds one more user RRef to ``rref_id`` (any thread)."""
        with self._lock:
            holders = self.entry(rref_id).holders
            count = holders.get(rank, 0) + 1
            if count:
                holders[rank] = count
            else:
                del holders[rank]

    def uncount_holder(self, rref_id: RRefId, rank: int, count: int) -> None:
        """``rank`` said it no longer holds ``count`` of its counted RRefs to ``rref_id``."""
        with self._lock:
            entry = self.owned.get(rref_id)
            if entry is None:  # (freed at shutdown, or never made: its creation failed first)
                return
            left = entry.holders.get(rank, 0) - count
            if left:
                entry.holders[rank] = left
            else:
                entry.holders.pop(rank, None)
        self.maybe_free(rref_id)

    def maybe_free(self, rref_id: RRefId) -> None:
        with self._lock:
            entry = self.owned.get(rref_id)
            if entry is None or entry.holders or entry.local_refs > 0 or not entry.value.done():
                return
            del self.owned[rref_id]
        if not entry.value.cancelled():
            entry.value.exception()  # mark a failure as retrieved: nobody can fetch it now

    # -- a user's first to_here() riding on its remote() (any thread) -----------------------------
    def ride_on_creation(self, rref_id: RRefId, fetch: Future[Any], seconds: float, owner: str) -> bool:
        """Have the creating call of ``rref_id``, if not encoded yet, ask for the value in its
        answer, which then completes ``fetch``; False: it left already (or another fetch rides
        on it). ``seconds``: the fetch's timeout (0: none); if shorter than the creation's, a
        timer of its own fails the fetch once it passes (the creation goes on)."""
        with self._lock:
            unsent = self.unsent_creations.get(rref_id)
            if unsent is None or unsent[1] is not None:
                return False
            unsent[1] = fetch
            creation_seconds = unsent[0]
        if seconds > 0 and (creation_seconds == 0 or seconds < creation_seconds):
            deadline = time.monotonic() + seconds
            self._on_loop(lambda: self._expire_fetch(fetch, deadline, seconds, owner), sends=False)
        return True

    def creation_encoded(self, rref_id: RRefId) -> bool:
        """The creating call of ``rref_id`` is being encoded (on the thread sending it): True if
        a ``to_here()`` rides on it (the owner answers the creation with the value); a later one
        sends a fetch of its own."""
        with self._lock:
            unsent = self.unsent_creations.pop(rref_id, None)
        return unsent is not None and unsent[1] is not None

    def _expire_fetch(self, fetch: Future[Any], deadline: float, seconds: float, owner: str) -> None:
        """(loop) Fail ``fetch`` at ``deadline`` unless the creation's answer completed it."""
        if not fetch.done():
            _time_out_after(
                self.agent.loop,
                fetch,
                max(0.0, deadline - time.monotonic()),
                f"call to RRef.to_here on worker {owner} timed out after {seconds:g} s (the value "
                "was asked for with the call that creates it, which goes on)",
            )

    def owner_ref_gone(self, rref_id: RRefId) -> None:
        entry = self.owned.get(rref_id)
        if entry is not None:
            entry.local_refs -= 1
            self.maybe_free(rref_id)

    # -- user side -------------------------------------------------------------------------------
    def adopt_user(self, owner: WorkerInfo, rref_id: RRefId, sender: int, token: int) -> RRef[Any]:
        """Rebuild a pickled user RRef here; registers this worker with the owner if new (and
        the owner did not count it when it sent the RRef)."""
        me = self.agent.info.id
        counted = token == OWNER_COUNTED and sender == owner.id
        with self._lock:
            existing = self.users.get(rref_id)
            rref = existing() if existing is not None else None
            if rref is not None:
                fresh = False
            else:
                rref = self._new_user(owner, rref_id, 0)
                fresh = True
            if counted or fresh:  # (fresh: the registration below counts it, ahead of any deletion)
                rref._counted[0] += 1
        if counted:
            return rref  # confirmed: the owner counted us before the RRef left it
        if fresh and sender == owner.id:
            # The owner forked it to us and keeps its fork hold until it hears from us: the
            # value cannot go meanwhile, so the RRef is confirmed now (torch's early fork
            # registration) and our registration is a notice, not a call to wait for. (It
            # travels after any deletion of an earlier RRef of ours to this value.)
            told = (rref_id, me, sender, token)
            self.agent.notify(owner, _register, told, function_name="rpcdist.rref.register", plain=True)
        elif fresh:
            registered = self.agent.submit(
                owner,
                _register,
                (rref_id, me, sender, token),
                None,
                0,
                function_name="rpcdist.rref.register",
            )
            _await_confirmation(rref, registered)
            registered.add_done_callback(lambda done: self._registration_failed(done, sender, token))
            # As torch: a call that receives a new user RRef runs once the owner has confirmed
            # it (confirmed_by_owner() is true inside the function).
            on_unconfirmed(registered, f"the RRef {rref_id} owned by {owner.name}")
        elif (confirmation := rref._confirmed) is None or confirmation.done():
            self.child_accepted_at(sender, token)
        else:
            # Our own registration is still in flight: the sender must keep its hold until
            # the owner has it, or the sender's deletion could overtake it.
            confirmation.add_done_callback(lambda _: self.child_accepted_at(sender, token))
        return rref

    def _new_user(self, owner: WorkerInfo, rref_id: RRefId, counted: int) -> RRef[Any]:
        """A user RRef object for ``rref_id`` (under ``_lock``), the one this process holds;
        ``counted``: how many times the owner counts this process for it so far."""
        rref = RRef._make(owner, rref_id)
        rref._counted = [counted]
        self.users[rref_id] = weakref.ref(rref)
        weakref.finalize(rref, self._user_finalized, rref_id, rref._counted)
        return rref

    def _registration_failed(self, registered: Future[Any], sender: int, token: int) -> None:
        """If the owner could not register us (it is gone or out of reach: this RRef's
        ``to_here()`` raises that), the sender's hold protects nothing: let it go, or the
        sender would keep its RRef until shutdown."""
        if registered.exception() is None or self._closed:
            return
        try:
            self.child_accepted_at(sender, token)
        except RpcError as exc:  # shutting down: the sender's holds go with its context
            log.debug("could not release fork %s of worker %s: %s", token, sender, exc)

    def adopt_owned(self, rref_id: RRefId, sender: int, token: int) -> RRef[Any]:
        """Rebuild a pickled RRef on its owner: an owner RRef over the existing value."""
        rref = RRef._make(self.agent.info, rref_id)
        self.track_owner_ref(rref)
        if token != NO_HOLD:
            self.child_accepted_at(sender, token)
        return rref

    def track_owner_ref(self, rref: RRef[Any]) -> None:
        rref_id = rref._id
        agent = self.agent
        if threading.get_ident() == agent.loop_thread_id:
            # On the loop (an owner RRef unpickled from a message): count it now. Queued behind
            # the inbox, a holder's deletion handled inline meanwhile could free the value
            # under it (and a later local_value() would wait for a value that never comes).
            self._add_local_ref(rref_id)
        else:
            self._on_loop(lambda: self._add_local_ref(rref_id), sends=False)
        weakref.finalize(rref, self._owner_finalized, rref_id)

    def _add_local_ref(self, rref_id: RRefId) -> None:
        self.entry(rref_id).local_refs += 1

    def child_accepted_at(self, sender: int, token: int) -> None:
        """Tell ``sender`` its fork ``token`` is registered (locally if that is us)."""
        if sender == self.agent.info.id:
            self.release_child(token)
        else:
            self.agent.notify(
                sender, _child_accepted, (token,), function_name="rpcdist.rref.accepted", plain=True
            )

    def hold_child(self, rref: RRef[Any]) -> int:
        token = next(self._tokens)
        with self._lock:
            self.pending_children[token] = rref
        return token

    def release_child(self, token: int) -> None:
        with self._lock:
            child = self.pending_children.pop(token, None)
        del child  # possibly the last reference: its finalizer runs here, outside the lock

    def _user_finalized(self, rref_id: RRefId, counted: list[int]) -> None:
        with self._lock:
            ref = self.users.get(rref_id)
            if ref is not None and ref() is None:
                del self.users[rref_id]
            count, counted[0] = counted[0], 0
        if count:
            self._notify_deleted(rref_id, count)

    def _notify_deleted(self, rref_id: RRefId, count: int) -> None:
        if self._closed:
            return
        owner = self.agent.workers_by_rank.get(rref_id[0])
        if owner is None:
            return
        try:
            # A notice: nothing waits for the owner's answer, so none comes back (a call cost
            # the owner an answer and this worker a wake-up to read it, for every RRef dropped).
            told = (rref_id, self.agent.info.id, count)
            self.agent.notify(owner, _user_deleted, told, function_name="rpcdist.rref.deleted", plain=True)
        except Exception as exc:  # shutting down: the owner frees it at its own shutdown
            log.debug("could not tell %s that %s was deleted: %s", owner.name, rref_id, exc)

    def _owner_finalized(self, rref_id: RRefId) -> None:
        if not self._closed:
            self._on_loop(lambda: self.owner_ref_gone(rref_id), sends=False)

    def _on_loop(self, fn: Callable[[], Any], sends: bool = True) -> None:
        """Run ``fn`` on the loop, after anything posted before it (order matters: an owner
        RRef's registration must precede its finalizer's release). ``sends=False``: ``fn``
        sends no call or notice (see ``LoopInbox.post``)."""
        try:
            self.agent.on_loop(fn, sends)
        except RuntimeError:  # loop closed, or the agent is gone
            pass

    def release_all_users(self) -> None:
        """At shutdown: tell every owner this process holds no RRefs any more.

        Forks still on their way (``pending_children``) keep their holds: this worker may be
        the owner whose value a peer is about to register for (a parameter server that calls
        ``shutdown()`` while its trainers start), and dropping the hold would free the value
        under the receiver. The holds go as their receivers register, or with the context."""
        with self._lock:
            forking = {child._id for child in self.pending_children.values()}
            held = [(rref_id, ref()) for rref_id, ref in self.users.items()]
            self.users.clear()
        for rref_id, rref in held:
            # A fork in flight tells its owner when its hold ends (the object's finalizer).
            if rref is not None and rref_id not in forking:
                rref._released = True
                with self._lock:
                    count, rref._counted[0] = rref._counted[0], 0
                if count:
                    self._notify_deleted(rref_id, count)

    def close(self) -> None:
        self._closed = True
        self.owned.clear()

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            users = [ref() for ref in self.users.values()]
            live_users = [r for r in users if r is not None]
            return {
                "owned_rrefs": len(self.owned),
                "user_rrefs": len(live_users),
                "pending_children": len(self.pending_children),
                "pending_users": sum(1 for r in live_users if not r.confirmed_by_owner()),
            }


class RRef(Generic[T]):
    """A reference to a value owned by one worker, as ``torch.distributed.rpc.RRef``.

    ``RRef(value)`` makes this worker the owner of ``value``; ``rpc.remote(...)`` returns an
    RRef owned by the worker that ran the function. RRefs may be passed in arguments and
    results, nested in containers, to and between any workers.
    """

    _owner: WorkerInfo
    _id: RRefId
    _confirmed: Future[Any] | None
    _released: bool
    _counted: list[int]  # (a user RRef) how many times its owner counts this process for it

    def __init__(self, value: Any = None, type_hint: Any = None) -> None:
        agent = _agent()
        self._owner = agent.info
        self._id = (agent.info.id, agent.info.id, next(_counter))
        self._confirmed = None
        self._released = False
        context = _context()
        rref_id = self._id

        def install() -> None:
            entry = context.entry(rref_id)
            entry.value.set_result(value)

        # (bookkeeping only: a call this thread makes next, passing this RRef, may be written
        # at once; a fetch that overtakes it finds the entry and waits for its value)
        context._on_loop(install, sends=False)
        context.track_owner_ref(self)

    @classmethod
    def _make(cls, owner: WorkerInfo, rref_id: RRefId, confirmed: Future[Any] | None = None) -> RRef[Any]:
        rref = cls.__new__(cls)
        rref._owner = owner
        rref._id = rref_id
        rref._confirmed = confirmed
        rref._released = False
        return rref

    # -- identity ------------------------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The WorkerInfo of the owner."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self._owner.name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._owner.id == _agent().info.id

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner)."""
        return self._confirmed is None or self._confirmed.done()

    # -- value -----------------------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner (raises RpcError elsewhere)."""
        agent = _agent()
        if self._owner.id != agent.info.id:
            raise RpcError(
                f"local_value() called on worker {agent.info.name}, but this RRef is owned by "
                f"{self._owner.name}; use to_here()"
            )
        entry = _context().owned.get(self._id)
        if entry is None or not entry.value.done():
            return self.to_here()
        return _value_or_copy_of_error(entry.value)

    def to_here_async(self, timeout: float = -1.0) -> Future[T]:
        """A Future of the value, copied from the owner (on the owner: the value itself);
        awaitable, or ``wait()`` on it."""
        return self._fetch_value(timeout, waited=False)

    def _fetch_value(self, timeout: float, waited: bool) -> Future[T]:
        """:meth:`to_here_async`; ``waited``: the calling thread waits for it next."""
        if self._released and _current is None:  # used after shutdown (torch's wording)
            raise RpcError(
                f"User RRef owned by {self._owner.name} was released (at shutdown): "
                "Cannot call to_here() on it after deletion."
            )
        agent = _agent()
        created = self._confirmed
        if created is not None and created.done() and created.exception() is not None:
            failed: Future[T] = Future(loop=agent.loop)
            failed.set_exception(created.exception())  # type: ignore[arg-type]
            return failed
        if self._owner.id != agent.info.id:
            if (
                created is not None
                and not created.done()
                and (agent.extension is None or agent.extension.capture() is None)
            ):
                riding = self._ride_on_creation(agent, created, timeout)
                if riding is not None:
                    return riding
            # A thread that waits for a value its owner has confirmed (it exists, or did) asks
            # for it as a plain call (see _fetch_owned); one still being made is waited for by
            # the owner's loop, which has the creation in hand.
            fetch = agent.submit(
                self._owner,
                _fetch_owned if waited and created is None else _fetch,
                (self._id,),
                None,
                timeout,
                function_name="RRef.to_here",
                waited=waited,
                pulled=waited,
            )
            if created is not None:
                # If the creating call fails before the owner runs it (the function cannot be
                # imported there, say), the fetch would wait for a value that never comes. (Also
                # when it failed since the check above: its answer may come while this thread
                # sends the fetch, and the callback then runs at once.)
                created.add_done_callback(
                    lambda c: c.exception() is not None and fetch._try_complete(None, c.exception())
                )
            return fetch
        result: Future[T] = Future(loop=agent.loop)
        rref_id = self._id
        context = _context()
        seconds = agent.options.rpc_timeout if timeout is None or timeout < 0 else timeout

        def watch() -> None:
            value = context.entry(rref_id).value
            value.add_done_callback(
                lambda v: (
                    result._try_complete(None, copy.copy(v.exception()).with_traceback(None))
                    if v.exception() is not None
                    else result._try_complete(v.result(), None)
                )
            )
            if seconds > 0 and not value.done():
                _time_out_after(
                    agent.loop,
                    result,
                    seconds,
                    f"RRef.to_here on its owner {agent.info.name} timed out after {seconds:g} s: "
                    f"the value of {rref_id} was not created within that time",
                )

        if created is not None and not created.done():
            # The creating call to ourselves may fail before it runs: no value would come.
            created.add_done_callback(
                lambda c: c.exception() is not None and result._try_complete(None, c.exception())
            )
        context._on_loop(watch)
        return result

    def _ride_on_creation(self, agent: Agent, created: Future[Any], timeout: float) -> Future[T] | None:
        """A Future of the value from the answer of this RRef's creating call, if that call
        has not left yet (it then asks the owner for the value: one request and one answer,
        not two of each); None: fetch it as usual."""
        seconds = agent.options.rpc_timeout if timeout is None or timeout < 0 else timeout
        fetch: Future[T] = Future(loop=agent.loop)
        owner = self._owner.name
        if not _context().ride_on_creation(self._id, fetch, seconds, owner):
            return None

        def answered(done: Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                fetch._try_complete(None, error)
                return
            value = done.value()
            if type(value) is ValueNotSent:  # created, but the value could not travel
                error = rebuild_error(value.payload, value.buffers, "RRef.to_here", owner, agent.decode)
                fetch._try_complete(None, error)
            else:
                fetch._try_complete(value, None)

        created.add_done_callback(answered)
        return fetch

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied from the owner; raises the creating call's error if it failed."""
        return self._fetch_value(timeout, waited=True).wait()

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """torch's ``RRef._get_type``: the type of the value, asked of the owner once and then
        kept; ``blocking=False`` gives a Future of it (the same one on every call)."""
        known: Future[Any] | None = getattr(self, "_type_future", None)
        if known is None:
            if self.is_owner():
                known = Future()
                known.set_result(type(self.local_value()))
            else:
                # As rpc_async would (a profiler sees the call too).
                known = profiling.profiled_call(
                    _agent(), "async", self._owner, _rref_typeof_on_owner, (self,), None, timeout
                )
            self._type_future = known
        return known.wait() if blocking else known

    # -- autograd --------------------------------------------------------------------------------
    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass from the tensor this RRef holds, on its owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward pass in that context
        (``rpcdist.autograd.backward(ctx, [value])``); without it (owners only) local autograd
        (``torch.autograd.backward(value)``). The value must be a tensor (a scalar without
        explicit gradients).
        """
        if self.is_owner():
            _backward_value(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError(  # torch's wording
                "User RRefs require 'dist_autograd_ctx_id' to be specified: the backward pass of "
                f"an RRef owned by {self._owner.name} runs there, in a distributed autograd context"
            )
        call_args = (self, dist_autograd_ctx_id, retain_graph)
        _agent().submit(self._owner, _backward_owned, call_args, None, -1.0).wait()

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
        if not pickling_message():
            raise RuntimeError(  # torch's wording; the owner would never learn of the copy
                "Can not pickle rref in python pickler, rref can only be pickled when using RPC"
            )
        context = _context()
        me = context.agent.info.id
        decoded_in_order()  # (its protocol relies on the receiver's loop decoding it in order)
        if self._owner.id == me and (receiver := message_receiver()) is not None:
            # Counted now, before the message can leave: the receiver's deletion, whenever it
            # comes, undoes a count that is there. Nothing to hold, nothing to hear back.
            context.count_holder(self._id, receiver)
            uncount = functools.partial(context.uncount_holder, self._id, receiver, 1)
            on_undelivered(functools.partial(context._on_loop, uncount))
            return (_rebuild_rref, (self._owner, self._id, me, OWNER_COUNTED))
        if self._owner.id != me and ordered_receiver() == self._owner.id:
            # A call to the owner: it adopts the RRef while decoding the call, before it can
            # see this worker's deletion of it (same link, arrival order). No fork hold, and
            # no acknowledgment to wait for (token 0).
            return (_rebuild_rref, (self._owner, self._id, me, NO_HOLD))
        token = context.hold_child(self)
        # If the message never reaches its receiver, the hold is given back.
        on_undelivered(functools.partial(context.release_child, token))
        return (_rebuild_rref, (self._owner, self._id, me, token))

    def __repr__(self) -> str:
        try:
            kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        except RpcError:
            kind = "RRef"
        return f"{kind}(owner={self._owner.name}, id={self._id})"


@trust
def _rebuild_rref(owner: WorkerInfo, rref_id: RRefId, sender: int, token: int) -> RRef[Any]:
    context = _context()
    if owner.id == context.agent.info.id:
        return context.adopt_owned(rref_id, sender, token)
    return context.adopt_user(owner, rref_id, sender, token)


class _Proxy:
    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            agent = _agent()
            call_args = (rref, method, args, kwargs)
            if mode == "remote":
                _check_attribute(agent, rref, method, timeout)
                return create_remote(agent, rref.owner(), _call_method, call_args, None, timeout)
            if mode == "sync" and rref._confirmed is None:
                # This thread holds the RRef until the answer, so the owner's value stays, and
                # the owner confirmed it (it exists): see _call_owned. A value still being made
                # is waited for by the owner's loop (_call_method), which has the creation in hand.
                owned_args = (rref._id, method, args, kwargs)
                owned = agent.submit(
                    rref.owner(), _call_owned, owned_args, None, timeout, waited=True, pulled=True
                )
                return owned.wait()
            sync = mode == "sync"
            future = agent.submit(
                rref.owner(), _call_method, call_args, None, timeout, waited=sync, pulled=sync
            )
            return future.wait() if sync else future

        call.__name__ = method
        return call


def _check_attribute(agent: Agent, rref: RRef[Any], method: str, timeout: float) -> None:
    """As torch's ``rref.remote().method``: a method the value lacks is an AttributeError at
    once, here (not an RRef whose ``to_here()`` fails later). Asks the owner once per method."""
    known: set[str] | None = getattr(rref, "_known_attributes", None)
    if (known is not None and method in known) or current_loop() is agent.loop:
        return  # (on the loop it cannot wait for the owner: the RRef's to_here() raises it)
    if rref.is_owner():
        present = hasattr(rref.local_value(), method)
    else:
        present = agent.submit(rref.owner(), _has_attribute, (rref, method), None, timeout).wait()
    if not present:
        owner = rref.owner_name()
        raise AttributeError(f"the value of the RRef owned by {owner} has no attribute '{method}'")
    rref._known_attributes = (known or set()) | {method}  # type: ignore[attr-defined]


# -- the messages (each runs on the receiving worker's loop, in arrival order) ----------------------
def _value_or_copy_of_error(value: asyncio.Future[Any]) -> Any:
    error = value.exception()
    if error is not None:
        raise copy.copy(error).with_traceback(None)
    return value.result()


def _when_owned(rref_id: RRefId, then: Callable[[Any], Any]) -> Any:
    """On the owner: ``then(value)`` at once if the value exists (no task, no extra loop
    turn), else a future of it once the value arrives. A creation error is raised as a copy."""
    entry = _context().entry(rref_id)
    if entry.value.done():
        return then(_value_or_copy_of_error(entry.value))
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def arrived(value: asyncio.Future[Any]) -> None:
        try:
            outcome = then(_value_or_copy_of_error(value))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            result.set_exception(exc)
            return
        if isinstance(outcome, asyncio.Future):
            outcome.add_done_callback(lambda done: _copy_outcome(done, result))
        else:
            result.set_result(outcome)

    entry.value.add_done_callback(arrived)
    return result


def _copy_outcome(source: asyncio.Future[Any], target: asyncio.Future[Any]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())


@trust
@inline
def _fetch(rref_id: RRefId) -> Any:
    """On the owner: the value of ``rref_id`` once it exists (a Future of it while it is being
    made: answered by the thread that makes it, see ``_OwnerEntry.made``)."""
    entry = _context().entry(rref_id)
    if entry.value.done():
        return _value_or_copy_of_error(entry.value)
    waiter = entry.wait()
    entry.value.add_done_callback(lambda value: _settle_waiter(waiter, value))
    return waiter


def _settle_waiter(waiter: Future[Any], value: asyncio.Future[Any]) -> None:
    try:
        waiter._try_complete(_value_or_copy_of_error(value), None)
    except BaseException as exc:  # noqa: BLE001 - the creation's error, for the caller
        waiter._try_complete(None, exc)


@trust
@prompt
def _fetch_owned(rref_id: RRefId) -> Future[Any]:
    """:func:`_fetch` run as a plain call, for a thread that waits for the value next: on the
    thread that reads it (a reply channel's, co-located), a value that exists is answered at
    once, without the owner's loop; one still being made is answered once it is, from the
    loop. ``async_execution``: the callee answers with the Future's outcome. ``prompt``: it
    takes no place in the worker pool (read on the link, the loop runs it), so user functions
    blocked on the pool cannot hold up the fetch of a value one of them may be waiting for."""
    entry = _context().owned.get(rref_id)
    if entry is not None and entry.value.done():
        done: Future[Any] = Future()
        _settle_waiter(done, entry.value)
        return done
    # (an entry not made yet: the loop makes it, and the fetch waits there)
    done = entry.wait() if entry is not None else Future()

    def watch() -> None:  # on the loop (which makes the owner's entries)
        value = _context().entry(rref_id).value
        if value.done():
            _settle_waiter(done, value)
        else:
            value.add_done_callback(lambda value: _settle_waiter(done, value))

    _agent().on_loop(watch, sends=False)
    return done


setattr(_fetch_owned, ASYNC_EXECUTION_ATTR, True)  # (returns a Future; see above)


@trust
@inline
def _rref_typeof_on_owner(rref: RRef[Any]) -> Any:  # (torch's name: profiles show it)
    """On the owner: the type of the value, once it exists."""
    return _when_owned(rref._id, type)


@trust
@inline
def _has_attribute(rref: RRef[Any], name: str) -> Any:
    """On the owner: whether the value has attribute ``name``."""
    return _when_owned(rref._id, lambda value: hasattr(value, name))


def _check_restricted(agent: Agent, method: str) -> None:
    if agent.options.restricted and (not isinstance(method, str) or method.startswith("_")):
        raise RestrictedError(
            f"restricted mode refused calling {method!r} through an RRef: only public methods "
            "(names without a leading underscore) of an RRef's value can be called"
        )


@trust
@inline
def _call_method(rref: RRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner: ``getattr(value, method)(*args, **kwargs)``, run as calls are run."""
    agent = _agent()
    _check_restricted(agent, method)
    entry = _context().entry(rref._id)
    if entry.value.done():
        # The usual case: the method runs as a plain call to it would (a pool thread answers),
        # once the RRefs in its arguments are confirmed if some are not yet (see RunAsCall).
        return RunAsCall(getattr(_value_or_copy_of_error(entry.value), method), args, kwargs)
    return _when_owned(
        rref._id, lambda value: agent.start_user_function(getattr(value, method), args, kwargs)
    )


@trust
def _call_owned(rref_id: RRefId, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner, on the thread that runs the call: ``rref.rpc_sync().method(...)``. Its
    caller holds the RRef until the answer, so the value cannot go meanwhile: it is looked up
    by id (no RRef is sent, so none is rebuilt and counted, which only the loop may do), and
    a plain method runs right on that thread (a pool thread, or the thread reading the
    caller's reply channel). An ``async def`` or ``async_execution`` method's coroutine or
    Future is the answer's (this function is ``async_execution``: the callee awaits it)."""
    agent = _agent()
    _check_restricted(agent, method)
    entry = _context().owned.get(rref_id)
    if entry is None or not entry.value.done():  # (being created: remote() just before, say)
        _wait_for_value(agent, rref_id)
        entry = _context().owned.get(rref_id)
        if entry is None:
            raise RpcError(f"the RRef {rref_id} owned by {agent.info.name} was deleted")
    bound = getattr(_value_or_copy_of_error(entry.value), method)
    result = bound(*args, **kwargs)
    if is_async_execution(bound) or inspect.iscoroutine(result):
        return result
    done: Future[Any] = Future()
    done.set_result(result)
    return done


setattr(_call_owned, ASYNC_EXECUTION_ATTR, True)  # (returns a Future or a coroutine; see above)


def _wait_for_value(agent: Agent, rref_id: RRefId) -> None:
    """Wait (on a thread, not the loop) until the owner's value of ``rref_id`` exists."""
    arrived = threading.Event()
    context = _context()
    agent.on_loop(
        lambda: context.entry(rref_id).value.add_done_callback(lambda _: arrived.set()), sends=False
    )
    limit = agent.options.rpc_timeout
    with blocking_wait():
        if not arrived.wait(limit if limit > 0 else None):
            raise RpcTimeoutError(
                f"the value of RRef {rref_id} does not exist on {agent.info.name} after {limit:g} s"
            )


@trust
@inline
def _backward_owned(rref: RRef[Any], context_id: int, retain_graph: bool) -> Any:
    """On the owner: :meth:`RRef.backward` of the value, run as calls are run."""
    agent = _agent()
    return _when_owned(
        rref._id,
        lambda value: agent.start_user_function(_backward_value, (value, context_id, retain_graph), {}),
    )


def _backward_value(value: Any, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"RRef should contain a tensor for .backward(), not {type(value).__name__}")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
    else:
        import rpcdist.autograd  # (rpcdist.autograd builds on this module's agent layer)

        rpcdist.autograd.backward(context_id, [value], retain_graph=retain_graph)


@trust
@inline
def _create_answering_value(
    rref_id: RRefId, creator: int, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float = 0.0
) -> asyncio.Future[ValueAnswer]:
    """:func:`_create` for a creator whose first ``to_here()`` rides on it (the request's
    ``Envelope.with_value``): answered with the value it makes (a copy, as a fetch's), not None."""
    return _start_creation(rref_id, creator, func, args, kwargs, timeout, answer_value=True)


@trust
@answers_value_with(_create_answering_value)
@inline
def _create(
    rref_id: RRefId, creator: int, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float = 0.0
) -> asyncio.Future[None]:
    """On the owner: register the creator at once (in arrival order, before any deletion the
    creator sends next), then run ``func`` and keep its result (or error)."""
    return _start_creation(rref_id, creator, func, args, kwargs, timeout, answer_value=False)


def _start_creation(
    rref_id: RRefId,
    creator: int,
    func: Callable[..., Any],
    args: Any,
    kwargs: Any,
    timeout: float,
    answer_value: bool,
) -> asyncio.Future[Any]:
    context = _context()
    if creator >= 0:
        context.count_holder(rref_id, creator)
    agent = context.agent
    # The pool thread that makes the value answers the creator's fetch itself when the creator
    # is co-located (it reads the answer on a reply channel). Over gRPC its answer would only
    # go out through the loop anyway, in a frame of its own ahead of the creation's answer.
    made = context.entry(rref_id).made if creator >= 0 and agent.transport.on_unix_socket(creator) else None
    started = None
    if confirmation_gate.get() is None:
        # Started now (a plain function handed to the pool), not at the task's first step, a
        # turn of the loop later: the fetch that usually follows waits for it.
        started = agent.start_user_function(func, args, kwargs, made=made)
    return agent.loop.create_task(
        _run_create(context, rref_id, func, args, kwargs, timeout, started, made, answer_value)
    )


async def _run_create(
    context: RRefContext,
    rref_id: RRefId,
    func: Callable[..., Any],
    args: Any,
    kwargs: Any,
    timeout: float = 0.0,
    started: asyncio.Future[Any] | None = None,
    made: Callable[[Any], None] | None = None,
    answer_value: bool = False,
) -> ValueAnswer | None:
    """Run ``func`` (or await ``started``, its run begun already) and keep its result (or its
    error) as the value of ``rref_id``; ``made``: see ``Agent.run_user_function``;
    ``answer_value``: settle with the value (as a :class:`ValueAnswer`), for the creator."""
    agent = context.agent
    entry = context.entry(rref_id)
    try:
        if started is None:
            value = await agent.run_user_function(func, args, kwargs, made=made)
        else:
            value = await started
            if inspect.isawaitable(value):  # (as run_user_function: a plain function's awaitable)
                value = await value
    except BaseException as exc:
        if not entry.value.done():
            if isinstance(exc, asyncio.CancelledError):
                # The creating call was given up (its timeout passed, or its caller is gone):
                # whoever waits for the value learns that, never a bare CancelledError.
                limit = f" after {timeout:g} s" if timeout > 0 else ""
                error: BaseException = RpcTimeoutError(
                    f"remote() of {_qualname(func)} on worker {agent.info.name} was cancelled{limit}: "
                    "the call that creates the value timed out or its caller went away"
                )
            else:
                text = "".join(traceback.format_exception(exc))
                error = annotate_remote(exc, agent.info.name, _qualname(func), text)
            entry.value.set_exception(error)
        context.maybe_free(rref_id)
        raise
    if not entry.value.done():
        entry.value.set_result(value)
    context.maybe_free(rref_id)  # the creator may have dropped it already
    if answer_value:
        return ValueAnswer(_value_or_copy_of_error(entry.value), "RRef.to_here")
    return None


@trust
@inline
def _register(rref_id: RRefId, user: int, sender: int, token: int) -> None:
    """On the owner: ``user`` now holds an RRef that ``sender`` forked to it."""
    context = _context()
    context.count_holder(rref_id, user)
    context.child_accepted_at(sender, token)


@trust
@inline
def _child_accepted(token: int) -> None:
    """On a fork's sender: the owner knows the receiver; our own hold may go. (A notice that
    arrives once this worker has shut its RRefs down has nothing left to release.)"""
    context = _current
    if context is not None:
        context.release_child(token)


@trust
@inline
def _user_deleted(rref_id: RRefId, user: int, count: int = 1) -> None:
    """On the owner: ``user`` no longer holds the RRef to ``rref_id`` it was counted for
    ``count`` times. (A notice that arrives once this worker has shut its RRefs down finds
    what it owned freed already.)"""
    context = _current
    if context is not None:
        context.uncount_holder(rref_id, user, count)


def _time_out_after(
    loop: asyncio.AbstractEventLoop, future: Future[Any], seconds: float, message: str
) -> None:
    """(loop) Fail ``future`` with an RpcTimeoutError(``message``) in ``seconds`` unless it is
    done by then (the timer goes as soon as it is)."""
    timer = loop.call_later(seconds, lambda: future._try_complete(None, RpcTimeoutError(message)))
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(timer.cancel))


def _qualname(func: Any) -> str:
    return f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', repr(func))}"


def create_remote(
    agent: Agent,
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
) -> RRef[Any]:
    """``rpc.remote``: start ``func`` on ``to`` and return an RRef at once."""
    dest = agent.worker(to)
    name = serialization.check_importable(func)
    context = _context()
    rref_id: RRefId = (dest.id, agent.info.id, next(_counter))
    seconds = agent.options.rpc_timeout if timeout is None or timeout < 0 else timeout
    if dest.id == agent.info.id:
        call_args = (rref_id, -1, func, tuple(args or ()), dict(kwargs or {}), seconds)  # owner refs count it
        rref = RRef._make(dest, rref_id)
        context.track_owner_ref(rref)
        _await_confirmation(rref, agent.submit(dest, _create, call_args, None, timeout, function_name=name))
        return rref
    call_args = (rref_id, agent.info.id, func, tuple(args or ()), dict(kwargs or {}), seconds)
    # Until the call is encoded, a to_here() may ride on it (see RRefContext.ride_on_creation);
    # not one made in a distributed autograd context (a fetch there records its own send and
    # receive), nor on a creation made in one.
    rides = agent.extension is None or agent.extension.capture() is None
    with context._lock:
        rref = context._new_user(dest, rref_id, 1)  # (_create counts its creator)
        if rides:
            context.unsent_creations[rref_id] = [seconds, None]
    try:
        # (waited: remote() calls seldom come in bursts, and a pipeline's next call depends on it)
        created = agent.submit(
            dest,
            _create,
            call_args,
            None,
            timeout,
            function_name=name,
            waited=True,
            asks_value=functools.partial(context.creation_encoded, rref_id) if rides else None,
        )
    except BaseException:
        context.unsent_creations.pop(rref_id, None)
        raise
    _await_confirmation(rref, created)
    return rref


def _await_confirmation(rref: RRef[Any], confirmation: Future[Any]) -> None:
    """Keep the owner's confirmation of ``rref`` until it arrives; a successful one is then
    dropped (``confirmed_by_owner()`` is true without it), so a live RRef does not keep a
    future alive. A failed one stays: ``to_here`` raises its error."""
    rref._confirmed = confirmation
    held = weakref.ref(rref)

    def arrived(done: Future[Any]) -> None:
        owner_rref = held()
        if owner_rref is not None and owner_rref._confirmed is done and done.exception() is None:
            owner_rref._confirmed = None
        if unsent_creations:  # (a call that failed before it was ever encoded)
            unsent_creations.pop(rref_id, None)

    unsent_creations = _context().unsent_creations
    rref_id = rref._id

    confirmation.add_done_callback(arrived)


@trust
def debug_info() -> dict[str, int]:
    """Counts of this worker's RRef state, to check for leaks::

    {"owned_rrefs": values owned here, "user_rrefs": live user RRefs held here,
     "pending_children": forks waiting for the owner's confirmation,
     "pending_users": user RRefs the owner has not confirmed yet}
    """
    return _context().debug_info()
