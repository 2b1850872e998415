"""Elastic membership: workers join and leave a running group.

``init_rpc(name, world_size=None)`` (with no WORLD_SIZE in the environment) joins a *dynamic*
group instead of waiting for a fixed number of workers; ``shutdown()`` leaves it, and the
others go on. RPC, RRefs and distributed autograd work among whoever is present.

The group lives in the rendezvous store (under the RPC prefix):

- ``world_size`` is ``dynamic`` (a fixed-size group refuses dynamic workers and vice versa);
- ``rank/<r>`` and ``name/<n>`` claim a rank and a name (``compare_set``, so two workers never
  get the same one; a missing key or an empty value is free: a leaver deletes its keys, the
  survivors of a dead member empty them); ranks not given are drawn from the ``next_rank``
  counter;
- ``roster`` is the JSON map of the members present, rank -> {name, card}, changed only by
  compare-and-swap.

A joiner claims its rank and name, starts serving, adds itself to the roster and then tells
every member it found there (``_member_joined``): ``init_rpc`` returns once they all know it,
so whoever it calls can call it back. A leaver waits for its own calls, frees its name, takes
itself off the roster and tells every member left (``_member_left``). Each member keeps its
agent's view up to date from these messages and hands them to the program's listeners
(:func:`on_membership_change`, :func:`membership_change`).

The store must outlive the group: a standalone ``rpcdist-server``, or the worker with rank 0,
whose ``shutdown()`` keeps serving the store until every other member has left (or died).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rpcdist import _launch_env
from rpcdist._runtime import wait_for
from rpcdist.agent import Agent, WorkerInfo, current_agent
from rpcdist.agent.markers import inline
from rpcdist.errors import MembershipError, RendezvousError, RpcError, StoreError
from rpcdist.rendezvous import Member
from rpcdist.serialization import trust
from rpcdist.store import Store

log = logging.getLogger(__name__)

__all__ = [
    "MembershipChange",
    "get_worker_infos",
    "is_dynamic_request",
    "membership_change",
    "on_membership_change",
]

DYNAMIC = b"dynamic"
ROSTER = "roster"
JOINED, LEFT = "joined", "left"
MembershipChange = tuple[str, WorkerInfo]
"""``("joined" | "left", the worker's WorkerInfo)``."""

_listeners: list[Callable[[str, WorkerInfo], Any]] = []
_queues: dict[Any, list[MembershipChange]] = {}  # per listener: the change it is hearing, then the rest
_waiters: list[asyncio.Future[MembershipChange]] = []


def is_dynamic_request(world_size: int | None) -> bool:
    """Whether ``init_rpc(..., world_size=world_size)`` asks for a dynamic group: no size
    given, and none from a launcher (WORLD_SIZE; or Slurm's, under ``srun``)."""
    return world_size is None and _launch_env.launch_rank_and_size()[1] is None


# ============================================================================ joining
async def claim(store: Store, name: str, rank: int) -> int:
    """Claim ``name`` and ``rank`` (a free one drawn from the counter when ``rank < 0``) in the
    dynamic group of ``store``; returns the rank."""
    if not name or "/" in name:
        raise MembershipError(f"worker name must be non-empty and contain no '/': {name!r}")
    mode = await store.compare_set_async("world_size", b"", DYNAMIC)
    if mode != DYNAMIC:
        raise MembershipError(
            f"worker {name!r} asked to join a dynamic group (world_size=None), but this group was "
            f"started with a fixed world_size={mode.decode()}"
        )
    if rank < 0:
        while True:  # skip ranks that were given explicitly by others
            rank = await store.add_async("next_rank", 1) - 1
            if await store.compare_set_async(f"rank/{rank}", b"", name) == name.encode():
                break
    else:
        holder = await store.compare_set_async(f"rank/{rank}", b"", name)
        if holder != name.encode():
            raise MembershipError(
                f"rank {rank} is already taken by worker {holder.decode()!r} (not {name!r})"
            )
    owner = await store.compare_set_async(f"name/{name}", b"", str(rank))
    if owner != str(rank).encode():
        await store.delete_key_async(f"rank/{rank}")
        raise MembershipError(f"worker name {name!r} is already taken by rank {owner.decode()} (rank {rank})")
    return rank


async def _change_roster(
    store: Store, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply ``change`` to the roster atomically (compare-and-swap); returns (before, after)."""
    current = await store.compare_set_async(ROSTER, b"", b"{}")  # make it exist; read it
    while True:
        before = json.loads(current)
        after = change(dict(before))
        desired = json.dumps(after, sort_keys=True).encode()
        seen = await store.compare_set_async(ROSTER, current, desired)
        if seen == desired:
            return before, after
        current = seen  # someone else changed it meanwhile: apply ours to theirs


def _member(rank: str, entry: dict[str, Any]) -> Member:
    return Member(entry["name"], int(rank), entry["card"])


async def enter(agent: Agent, store: Store, card: dict[str, str], timeout: float) -> list[Member]:
    """Put this (serving) worker on the roster and make every member present know it; returns
    the members, this one included. A member that cannot be told (it died) is left out."""
    me = agent.info
    before, _ = await _change_roster(
        store, lambda roster: {**roster, str(me.id): {"name": me.name, "card": card}}
    )
    others = [_member(r, e) for r, e in before.items() if int(r) != me.id]
    members = [*others, Member(me.name, me.id, card)]
    agent.set_members(members)
    death_watch = _DeathWatch(agent, store)
    agent.on_peer_lost(death_watch)
    agent.status_sources.append(death_watch.counts)
    news = (me.name, me.id, card)
    told = [
        agent.submit(m.rank, _member_joined, news, None, timeout, function_name="rpcdist.joined")
        for m in others
    ]
    for member, future in zip(others, told, strict=True):
        try:
            await future
        except Exception as exc:  # noqa: BLE001 - a member that is gone does not stop a join
            log.warning("%s: could not tell %s of this join (%s); leaving it out", me.name, member.name, exc)
            agent.remove_member(member.rank)
    return [m for m in members if m.rank in agent.workers_by_rank]


# ============================================================================ leaving
async def leave(agent: Agent, store: Store, timeout: float | None) -> None:
    """Free this worker's name and rank, take it off the roster and tell the members left. The
    store's host (rank 0 with an embedded store) then serves it on until the others have left."""
    me = agent.info
    # Free the name and rank first: the store's host stops serving once the roster is empty,
    # and a leaver that freed them after taking itself off could find the store gone (and
    # wait out the store's timeout). A successor may claim the name while this worker is
    # still listed: members then hear of the new rank before this one leaves, and forgetting
    # this rank keeps the name's new owner (Agent.remove_member).
    for key in (f"name/{me.name}", f"rank/{me.id}"):
        try:
            await store.delete_key_async(key)
        except StoreError as exc:
            log.debug("%s: could not free %s: %s", me.name, key, exc)
    _, after = await _change_roster(store, lambda roster: _without(roster, {str(me.id)}))
    remaining = [int(r) for r in after]
    told = [
        agent.submit(r, _member_left, (me.id,), None, 10.0, function_name="rpcdist.left")
        for r in remaining
        if r in agent.workers_by_rank
    ]
    for future in told:
        try:
            await future
        except Exception as exc:  # noqa: BLE001 - a member that is gone need not hear it
            log.debug("%s: a member did not hear of this leave: %s", me.name, exc)
    if agent.rendezvous.server is not None and remaining:
        await _serve_store_until_empty(agent, store, timeout)


async def _serve_store_until_empty(agent: Agent, store: Store, timeout: float | None) -> None:
    """On the worker that hosts the store: wait until every other member has left (or no
    longer answers), probing the silent ones; ``timeout`` bounds it (None: while they live)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    log.info("%s hosts the group's store: serving it until the other members have left", agent.info.name)
    while True:
        roster = json.loads(await store.compare_set_async(ROSTER, b"", b"{}"))
        if not roster:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise RendezvousError(f"members {sorted(map(int, roster))} did not leave within {timeout:g} s")
        for rank, entry in roster.items():
            if int(rank) not in agent.workers_by_rank:  # joined as this one was leaving
                agent.add_member(_member(rank, entry))
        dead = await agent.find_dead([int(r) for r in roster])
        if dead:  # take the dead off the roster, for them
            gone = {str(r) for r in dead}
            await _change_roster(store, lambda roster, gone=gone: _without(roster, gone))
            continue
        await asyncio.sleep(0.5)


def _without(roster: dict[str, Any], ranks: set[str]) -> dict[str, Any]:
    return {r: e for r, e in roster.items() if r not in ranks}


class _DeathWatch:
    """The peer-lost listener of a dynamic group's member: one check (``_prune_if_dead``) at
    a time per peer. The check's own probe of a dead peer loses a link again; starting another
    check for that would chain checks, each with its store calls, for as long as the peer is
    listed — hundreds per survivor, enough for the store's server to shed calls."""

    def __init__(self, agent: Agent, store: Store) -> None:
        self._agent = agent
        self._store = store
        self._checking: set[WorkerInfo] = set()
        self._started = 0

    def counts(self) -> dict[str, int]:
        """For ``Agent.status()``: ``peer_death_checks``, how many lost links were checked."""
        return {"peer_death_checks": self._started}

    def __call__(self, peer: WorkerInfo, _reason: str) -> None:
        if peer in self._checking:
            return
        self._checking.add(peer)
        self._started += 1
        task = self._agent.loop.create_task(_prune_if_dead(self._agent, self._store, peer))
        task.add_done_callback(lambda _: self._checking.discard(peer))


async def _prune_if_dead(agent: Agent, store: Store, peer: WorkerInfo) -> None:
    """The link to ``peer`` was lost: if it no longer answers (it died; it did not leave, or
    it would have said so), take it off the roster, free its name and rank for a successor,
    and announce that it left. Every survivor may do this; it is idempotent."""
    if agent.closing or peer.id not in agent.workers_by_rank:
        return  # it left properly, or this worker is on its way out
    try:
        if not await agent.find_dead([peer.id]):
            return
        await _change_roster(store, lambda roster: _without(roster, {str(peer.id)}))
        for key, held in ((f"name/{peer.name}", str(peer.id)), (f"rank/{peer.id}", peer.name)):
            # Free it only if the dead member still holds it, in one step: other survivors
            # free it too, and a successor may claim it between a read and a delete (a Get
            # of a key freed meanwhile would also wait for it). An empty value is free: a
            # claim's compare_set(key, "", name) takes it as it takes a missing key.
            await store.compare_set_async(key, held, b"")
    except Exception as exc:  # noqa: BLE001 - the store host may be gone too; still announce it
        log.debug("%s: could not take dead %s off the roster: %s", agent.info.name, peer.name, exc)
    if peer.id in agent.workers_by_rank and not agent.closing:
        log.warning("%s: %s died; it is no longer a member", agent.info.name, peer.name)
        agent.remove_member(peer.id)
        _announce(agent, LEFT, peer)


# ============================================================================ the messages
@trust
@inline
def _member_joined(name: str, rank: int, card: dict[str, str]) -> None:
    """On every member: ``name`` (``rank``) joined; it can be called now."""
    agent = current_agent()
    agent.add_member(Member(name, rank, card))
    agent.watch(rank)  # a link of our own to it, so that its death is noticed (see _prune_if_dead)
    _announce(agent, JOINED, WorkerInfo(name, rank))


@trust
@inline
def _member_left(rank: int) -> None:
    """On every member: ``rank`` left the group."""
    agent = current_agent()
    info = agent.workers_by_rank.get(rank)
    if info is None:
        return
    agent.remove_member(rank)
    _announce(agent, LEFT, info)


def _announce(agent: Agent, event: str, info: WorkerInfo) -> None:
    """Hand a change to the waiters and listeners (``async def`` listeners run on the loop,
    others on the thread pool, so none can stall the loop; each listener hears its events one
    at a time, in order)."""
    for waiter in _waiters:
        if not waiter.done():
            waiter.set_result((event, info))
    _waiters.clear()
    for listener in list(_listeners):
        queue = _queues.setdefault(listener, [])
        queue.append((event, info))
        if len(queue) == 1:  # idle: start it; otherwise the running one starts the next
            _run_next(agent, listener)


def _run_next(agent: Agent, listener: Callable[[str, WorkerInfo], Any]) -> None:
    queue = _queues.get(listener)
    if not queue:
        return
    done = agent.start_user_function(listener, queue[0], {})

    def finished(done: asyncio.Future[Any]) -> None:
        _log_listener_failure(done)
        queue.pop(0)
        _run_next(agent, listener)

    done.add_done_callback(finished)


def _log_listener_failure(done: asyncio.Future[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("a membership listener raised", exc_info=done.exception())


# ============================================================================ the program's view
def get_worker_infos() -> list[WorkerInfo]:
    """The members of the group now, by rank (in a dynamic group, it changes as workers join
    and leave)."""
    agent = current_agent()
    return [agent.workers_by_rank[r] for r in sorted(agent.workers_by_rank)]


def on_membership_change(listener: Callable[[str, WorkerInfo], Any | Awaitable[Any]]) -> Callable[[], None]:
    """Call ``listener(event, worker_info)`` whenever a worker joins (``"joined"``) or leaves
    (``"left"``) this worker's group; returns a function that removes it. An ``async def``
    listener runs on rpcdist's event loop, a plain one on its thread pool."""
    if not callable(listener):
        raise TypeError(f"listener must be callable, not {type(listener).__name__}")
    _listeners.append(listener)

    def remove() -> None:
        if listener in _listeners:
            _listeners.remove(listener)

    return remove


async def membership_change(timeout: float | None = None) -> MembershipChange:
    """Wait for the next join or leave: ``("joined" | "left", worker_info)``. Raises
    ``TimeoutError`` after ``timeout`` seconds (None: no limit)."""
    agent = current_agent()
    waiter: asyncio.Future[MembershipChange] = agent.loop.create_future()
    agent.on_loop(lambda: _waiters.append(waiter))
    if asyncio.get_running_loop() is agent.loop:
        return await wait_for(waiter, timeout)
    on_agent_loop = asyncio.run_coroutine_threadsafe(wait_for(waiter, timeout), agent.loop)
    return await asyncio.wrap_future(on_agent_loop)


def reset() -> None:
    """At shutdown: forget the waiters (they fail) and the listeners."""
    for waiter in _waiters:
        if not waiter.done():
            waiter.get_loop().call_soon_threadsafe(
                lambda w=waiter: w.done() or w.set_exception(RpcError("RPC was shut down"))
            )
    _waiters.clear()
    _listeners.clear()
    _queues.clear()
