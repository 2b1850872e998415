"""Joining a group: from an ``init_method`` to a store, then name/rank/address registration.

Three init methods, as torch users know them:

- ``env://`` reads ``MASTER_ADDR``/``MASTER_PORT`` (under Slurm's ``srun``, when unset: the
  first host of ``SLURM_JOB_NODELIST`` and port 29500); rank 0 embeds the gRPC store service in
  its own process unless something already serves that address (a standalone
  ``rpcdist-server``), in which case it uses that one like everybody else. Under ``rpcdist-run``
  (``RPCDIST_AGENT_STORE=1``) the launcher serves it and rank 0 only connects.
- ``tcp://host:port``: the same with the address in the URL.
- ``file:///path``: a file-backed store on a (shared) filesystem.
- ``etcd://host:2379/prefix`` (or ``etcd://h1:2379,h2:2379,h3:2379/prefix`` for a cluster,
  failing over between its members): the job's keys under ``prefix`` on etcd
  (:class:`~rpcdist.store.etcd_store.EtcdStore`); nobody hosts anything. ``?lease_ttl=S``: how
  long the keys outlive the job's last process (10 s).

Under torch's own launcher (``torchrun`` / ``python -m torch.distributed.run``), whose elastic
agent already serves a ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT`` and says so with
``TORCHELASTIC_USE_AGENT_STORE=True``, ``env://`` connects to that store as torch's workers
do (through :class:`~rpcdist.store.torch_store.TCPStore`) instead of serving its own, so
rpcdist programs start under torchrun with no extra flag.

Registration is done with store operations only, so it works the same on every backend:
``compare_set`` claims a name and a rank atomically, and conflicts raise
:class:`~rpcdist.errors.MembershipError` naming both sides.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

import grpc

from rpcdist import _launch_env
from rpcdist.errors import MembershipError, RendezvousError, StoreError, StoreTimeoutError
from rpcdist.security import Security
from rpcdist.store import FileStore, GrpcStore, Store, StoreServer
from rpcdist.store.etcd_store import store_from_url
from rpcdist.store.service import SERVICE_NAME as STORE_SERVICE
from rpcdist.store.torch_store import TCPStore

log = logging.getLogger(__name__)

__all__ = [
    "Rendezvous",
    "Member",
    "rendezvous",
    "join_group",
    "arrive",
    "barrier",
    "check_in",
    "leave_barrier",
    "wait_checked_in",
    "is_loopback",
]


@dataclass
class Rendezvous:
    """The store a group coordinates through, the store service this process hosts (if any),
    and the credentials of the job (with the token a single-host job generated, if any)."""

    store: Store
    server: StoreServer | None
    host: str | None  # the store's host for env:// and tcp:// (None for file://)
    security: Security = field(default_factory=Security.resolve)

    async def close(self) -> None:
        await self.store.close_async()
        if self.server is not None:
            await self.server.stop(grace=1.0)


@dataclass(frozen=True)
class Member:
    """A registered worker: its name, rank and the card it published (address and such)."""

    name: str
    rank: int
    card: dict[str, str]

    @property
    def address(self) -> str:
        return self.card["address"]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _env(name: str, init_method: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RendezvousError(f"init_method={init_method!r} needs the environment variable {name}")
    return value


def resolve_rank_and_size(rank: int, world_size: int | None) -> tuple[int, int]:
    """Fill ``rank``/``world_size`` from RANK/WORLD_SIZE (or, under Slurm's srun, from
    SLURM_PROCID/SLURM_NTASKS) when not given, and check them."""
    env_rank, env_size = _launch_env.launch_rank_and_size()
    if rank is None or rank < 0:
        rank = env_rank if env_rank is not None else -1
    if world_size is None or world_size < 0:
        world_size = env_size if env_size is not None else -1
    if world_size is None or world_size < 1:
        raise MembershipError(f"world_size must be >= 1 (got {world_size}); pass it or set WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise MembershipError(f"rank {rank} is outside [0, {world_size}) for world_size={world_size}")
    return rank, world_size


async def rendezvous(
    init_method: str, rank: int, world_size: int, timeout: float, security: Security | None = None
) -> Rendezvous:
    """Open the store named by ``init_method``; rank 0 hosts it for env:// and tcp://.

    ``security`` (default: from the environment) is the job's token and TLS files. Without a
    token, a store on loopback gets one: rank 0 (or ``rpcdist-server``) makes it and leaves it
    in this user's private directory, where the others read it (see :mod:`rpcdist.security`);
    the returned ``Rendezvous.security`` carries it to the workers' links.
    """
    security = security if security is not None else Security.resolve()
    url = urlparse(init_method)
    if url.scheme == "file":
        path = unquote(url.path)
        if not path:
            raise RendezvousError(f"file:// init_method needs a path: {init_method!r}")
        store = FileStore(path, world_size=world_size, timeout=timeout)
        return Rendezvous(store, None, None, security)
    if url.scheme == "etcd":
        try:
            store = store_from_url(init_method, timeout)
        except StoreError as exc:
            raise RendezvousError(f"init_method={init_method!r}: {exc}") from None
        # Workers listen where they can reach the (first) etcd member, as for tcp://.
        return Rendezvous(store, None, store.endpoints[0].rsplit(":", 1)[0].strip("[]"), security)
    if url.scheme == "env":
        host, port_text = _launch_env.master_address()  # MASTER_ADDR/PORT, or Slurm's
        host = host or _env("MASTER_ADDR", init_method)
        port_text = port_text or _env("MASTER_PORT", init_method)
    elif url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise RendezvousError(f"tcp:// init_method needs host and port: {init_method!r}")
        host, port_text = url.hostname, str(url.port)
    else:
        raise RendezvousError(
            f"unsupported init_method {init_method!r}: use env://, tcp://host:port, file:///path "
            "or etcd://host:port/prefix"
        )
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousError(f"store port must be an integer, got {port_text!r}") from None
    if url.scheme == "env" and uses_agent_store():
        log.info("started by torchrun: using its agent's TCPStore at %s:%d", host, port)
        agent_store = await TCPStore.create_async(
            host, port, world_size=world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
        return Rendezvous(agent_store, None, host, security)
    local = is_loopback(host)
    job_token = local and security.token is None
    server = None
    if rank == 0 and not (url.scheme == "env" and _launch_env.launcher_serves_store()):
        server = await _serve_unless_served(host, port, security, job_token)
    if server is not None:
        security = server.security  # with the token it made
    elif not local and security.token is None:
        log.warning(
            "no auth token for the store at %s:%d: anyone who can reach it (and the workers) can "
            "join, read and call; set RPCDIST_AUTH_TOKEN on every host (see README: Security)",
            host,
            port,
        )
    store = GrpcStore(host, port, timeout=timeout, security=security, job_token=job_token)
    if job_token and server is None:
        try:  # learn the job's token (the store's first answer proves it) for the links too
            await store.check_async(["world_size"])
        except BaseException:
            await store.close_async()
            raise
        security = store.security
    return Rendezvous(store, server, host, security)


def uses_agent_store() -> bool:
    """Whether torch's elastic agent (torchrun) serves the store on MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_PROBE_SECONDS = 3.0  # how long whatever holds a taken store port has to say it is a store


async def _serve_unless_served(
    host: str, port: int, security: Security, job_token: bool
) -> StoreServer | None:
    """Serve the store on ``port``; if the port is taken, use the store served there, provided
    it is one (a standalone ``rpcdist-server``): anything else fails at once, naming the port."""
    bind_host = host if is_loopback(host) else "0.0.0.0"
    try:
        server = await StoreServer.start(bind_host, port, security=security, job_token=job_token)
    except (OSError, StoreError, RuntimeError) as exc:
        reason = await _store_probe(host, port, security)
        if reason is not None:
            raise RendezvousError(
                f"rank 0 cannot serve the store on port {port}: the port is in use by another "
                f"program, and what answers at {host}:{port} is not an rpcdist store ({reason}). "
                "Choose another MASTER_PORT (or the port of the init_method)."
            ) from exc
        log.info("store address %s:%d is taken (%s); using the store served there", host, port, exc)
        return None
    log.info("rank 0 serves the store on %s:%d", bind_host, port)
    return server


async def _store_probe(host: str, port: int, security: Security) -> str | None:
    """None if an rpcdist store serves ``host:port`` (its gRPC health service says so within
    a few seconds), else what answered instead."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with security.channel(f"{host}:{port}") as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=STORE_SERVICE), timeout=_PROBE_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no gRPC answer within {_PROBE_SECONDS:g} s"
            return f"{exc.code().name}: {exc.details()}"
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        return f"its health service says {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}"
    return None


async def join_group(
    store: Store, name: str, rank: int, world_size: int, card: dict[str, str], timeout: float
) -> list[Member]:
    """Register this worker with its ``card`` (at least ``{"address": "host:port"}``) and wait
    for all ``world_size`` members; returns them by rank."""
    if not name or "/" in name:
        raise MembershipError(f"worker name must be non-empty and contain no '/': {name!r}")
    size = str(world_size).encode()
    held = await store.compare_set_async("world_size", b"", size)
    if held != size:
        raise MembershipError(
            f"world_size mismatch: worker {name!r} (rank {rank}) says {world_size}, "
            f"the group was started with {held.decode()}"
        )
    owner = await store.compare_set_async(f"name/{name}", b"", str(rank))
    if owner != str(rank).encode():
        message = (  # torch's wording: "is not unique"
            f"worker name {name!r} is not unique: already taken by rank {owner.decode()} (rank {rank})"
        )
        # As torch, the whole group fails, not only this worker: the others wait for every
        # rank's card, and this rank's says why the group cannot start.
        if await store.compare_set_async(f"rank/{rank}", b"", name) == name.encode():
            await store.set_async(f"address/{rank}", json.dumps({_FAILED: message}))
            await _all_told(store, world_size, timeout)
        raise MembershipError(message)
    holder = await store.compare_set_async(f"rank/{rank}", b"", name)
    if holder != name.encode():
        raise MembershipError(f"rank {rank} is already taken by worker {holder.decode()!r} (not {name!r})")
    await store.set_async(f"address/{rank}", json.dumps(card))
    deadline = time.monotonic() + timeout
    keys = [f"address/{r}" for r in range(world_size)]
    try:
        await store.wait_async(keys, timeout)
    except StoreTimeoutError:
        missing = [r for r in range(world_size) if not await store.check_async([f"address/{r}"])]
        raise RendezvousError(
            f"worker {name!r} waited {timeout:.0f} s for ranks {missing} of {world_size} to join"
        ) from None
    cards = []
    for r in range(world_size):  # every card first: a failed rank's is read before it goes away
        remaining = max(1.0, deadline - time.monotonic())
        cards.append(json.loads(await store.get_async(f"address/{r}", remaining)))
    failures = [c[_FAILED] for c in cards if _FAILED in c]
    if failures:
        await _all_told(store, world_size, timeout)
        raise MembershipError(
            f"the group cannot start: {'; '.join(failures)} (worker {name!r}, rank {rank}, fails with it)"
        )
    members = []
    for r, member_card in enumerate(cards):
        remaining = max(1.0, deadline - time.monotonic())
        member_name = (await store.get_async(f"rank/{r}", remaining)).decode()
        members.append(Member(member_name, r, member_card))
    return members


_FAILED = "failed"  # the key of a card that says why its rank could not join (no address)
_TOLD_SECONDS = 10.0  # the longest a failing member waits for the others to learn of it


async def _all_told(store: Store, world_size: int, timeout: float) -> None:
    """The group fails: wait (briefly) until every member has read why, before this one goes
    on to fail. Rank 0 serves the store: leaving at once, it would take the store, and the
    reason, away from a member still on its way to read it (which would then fail with an
    unreachable store instead of the reason)."""
    try:
        await leave_barrier(store, "failed_group", world_size, min(timeout, _TOLD_SECONDS))
    except (StoreError, OSError) as exc:  # a member that never comes: fail anyway
        log.debug("not every member of the failed group was told: %s", exc)


async def arrive(store: Store, key: str, world_size: int) -> None:
    """Count this member in at barrier ``key``; the last of ``world_size`` opens it."""
    if await store.add_async(f"{key}/count", 1) == world_size:
        await store.set_async(f"{key}/done", b"1")


async def leave_barrier(store: Store, key: str, world_size: int, timeout: float) -> None:
    """Block until all ``world_size`` members reach the barrier named ``key``."""
    await arrive(store, key, world_size)
    await store.wait_async([f"{key}/done"], timeout)


async def barrier(
    store: Store,
    key: str,
    rank: int,
    world_size: int,
    timeout: float | None,
    find_dead: Callable[[list[int]], Awaitable[list[int]]] | None = None,
    probe_every: float = 5.0,
    first_probe: float = 0.5,
) -> list[int]:
    """Wait until every rank has reached barrier ``key``, or is dead; returns the dead ones.

    The missing ranks are probed with ``find_dead(missing)`` (which of them are gone) after
    ``first_probe`` seconds, then at doubling intervals up to every ``probe_every``; the dead
    are left out (with a warning) and the wait goes on for the live ones, so a death never
    hangs the barrier and never cuts it short for the living. ``timeout=None`` waits as long
    as missing ranks are alive; a limited wait raises RendezvousError at ``timeout``.
    """
    await store.set_async(f"{key}/{rank}", b"1")
    deadline = None if timeout is None else time.monotonic() + timeout
    dead: list[int] = []
    interval = min(first_probe, probe_every)
    while True:
        keys = [f"{key}/{r}" for r in range(world_size) if r not in dead]
        step = interval if deadline is None else min(interval, max(0.0, deadline - time.monotonic()))
        interval = min(interval * 2, probe_every)
        try:
            await store.wait_async(keys, step)
            return dead
        except StoreTimeoutError:
            pass
        missing = [
            r for r in range(world_size) if r not in dead and not await store.check_async([f"{key}/{r}"])
        ]
        if deadline is not None and time.monotonic() >= deadline:
            raise RendezvousError(f"barrier {key!r}: ranks {missing} did not arrive within {timeout:g} s")
        if find_dead is not None and missing:
            gone = await find_dead(missing)
            if gone:
                log.warning("barrier %r: ranks %s are gone; waiting for the others only", key, gone)
                dead += gone


async def check_in(store: Store, key: str, rank: int) -> None:
    """Tell barrier ``key`` (see :func:`wait_checked_in`) that ``rank`` reached it."""
    await store.set_async(f"{key}/{rank}", b"1")


async def wait_checked_in(store: Store, key: str, ranks: Iterable[int], timeout: float) -> None:
    """Wait until every rank of ``ranks`` has checked in at ``key``."""
    await store.wait_async([f"{key}/{r}" for r in ranks], timeout)


def local_address_towards(host: str) -> str:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
