"""EtcdStore: the Store interface on an etcd cluster, through etcd's v3 gRPC API (grpc.aio).

A rendezvous that survives the loss of any one host: give it every member of a 3-node (or
larger) etcd cluster and it fails over between them::

    store = EtcdStore(["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"], prefix="jobs/job7")
    store.set("x", b"1")
    value = store.get("x")

or, as an init method, ``init_method="etcd://h1:2379,h2:2379,h3:2379/jobs/job7"``.

How the c10d operations map onto etcd:

- every key of the job lives under ``<prefix>/k/``; ``num_keys`` counts those only;
- ``get``/``wait`` check the keys and then watch them from the revision they were checked at
  (server-side waits: nothing polls), re-checking after a failover;
- ``add`` and ``compare_set`` are etcd transactions (compare on the key's revision or value),
  atomic however many clients race. An ``add`` also writes a marker of its own in the same
  transaction, so one retried after a lost answer is applied once and returns its first result;
- every key is attached to one lease per job (its id is kept at ``<prefix>/lease``), which
  every client of the job keeps alive. When the last client is gone (closed, or its process
  died) the lease runs out after ``lease_ttl`` seconds and etcd deletes all of the job's keys:
  a dead job leaves nothing behind. A prefix is therefore reusable ``lease_ttl`` after its last
  job ended; use a fresh prefix (a job id) per job to start at once.

Failures: an endpoint that refuses, breaks the connection or does not answer one request within
``ATTEMPT_TIMEOUT`` is left for the next one, and the operation retried there (with backoff once
every endpoint failed), within the operation's limit (``timeout`` for ``get``/``wait``, the
store's timeout for the others) and ``connect_timeout`` for an outage of the whole cluster; then
StoreConnectionError names the endpoints and the last error. Keys not set in time raise
StoreTimeoutError naming them; ``add`` on a non-integer raises StoreValueError.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

import grpc

from rpcdist._runtime import wait_for
from rpcdist.errors import StoreConnectionError, StoreError, StoreValueError
from rpcdist.store.api import DEFAULT_TIMEOUT, Store, to_seconds
from rpcdist.store.memory import INT64_MAX, INT64_MIN, parse_counter, timeout_error
from rpcdist.v1 import etcd_pb2 as pb
from rpcdist.v1 import etcd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["EtcdStore", "parse_etcd_url", "DEFAULT_LEASE_TTL", "DEFAULT_ETCD_PORT"]

DEFAULT_ETCD_PORT = 2379
DEFAULT_LEASE_TTL = 10
# One request to one member: past this, the member is taken as gone and the next one is tried.
ATTEMPT_TIMEOUT = 5.0
# Backoff between rounds over every endpoint (doubling up to the max).
RETRY_BACKOFF = 0.05
RETRY_BACKOFF_MAX = 1.0
# etcd refuses transactions of more than 128 operations (its --max-txn-ops default).
MAX_TXN_OPS = 128
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Watches on a member that lost its leader are cancelled instead of hanging (as etcd's clientv3).
_REQUIRE_LEADER = (("hasleader", "true"),)
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

T = TypeVar("T")


def parse_etcd_url(url: str) -> tuple[list[str], str, dict[str, str]]:
    """``etcd://h1:2379,h2:2379/prefix?lease_ttl=10`` -> (endpoints, prefix, query options)."""
    scheme, sep, rest = url.partition("://")
    if scheme != "etcd" or not sep:
        raise StoreError(f"not an etcd:// URL: {url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    endpoints = parse_endpoints(netloc)
    prefix = unquote(path).strip("/")
    if not prefix:
        raise StoreError(f"an etcd:// URL needs a key prefix for the job after the hosts: {url!r}")
    options = {name: values[-1] for name, values in parse_qs(query).items()}
    return endpoints, prefix, options


def parse_endpoints(endpoints: str | Iterable[str]) -> list[str]:
    """``"h1:2379,h2"`` or ``["http://h1:2379", ...]`` -> ``["h1:2379", "h2:2379"]``."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in items:
        text = item.strip()
        for scheme in ("http://", "https://"):
            text = text.removeprefix(scheme)
        text = text.rstrip("/")
        if not text:
            continue
        if text.startswith("["):  # [v6]:port or [v6]
            host, _, port = text.partition("]")
            host, port = host + "]", port.removeprefix(":") or str(DEFAULT_ETCD_PORT)
        elif text.count(":") == 1:
            host, _, port = text.partition(":")
        elif ":" in text:  # a bare IPv6 address
            host, port = f"[{text}]", str(DEFAULT_ETCD_PORT)
        else:
            host, port = text, str(DEFAULT_ETCD_PORT)
        if not port.isdigit() or not host:
            raise StoreError(f"etcd endpoint {item!r} is not host:port")
        parsed.append(f"{host}:{port}")
    if not parsed:
        raise StoreError(f"no etcd endpoint given: {endpoints!r}")
    return parsed


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with ``prefix`` (etcd's convention)."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"


def _absent(key: bytes) -> pb.Compare:
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.VERSION, key=key, version=0)


class _StreamBroken(Exception):
    """A watch or keep-alive stream ended (member lost, watch cancelled): start it anew."""


@dataclass
class _Member:
    """One endpoint's channel and stubs."""

    endpoint: str
    channel: grpc.aio.Channel
    kv: pb_grpc.KVStub
    watch: pb_grpc.WatchStub
    lease: pb_grpc.LeaseStub


class EtcdStore(Store):
    """The Store interface on etcd, for the job whose keys live under ``prefix``.

    ``endpoints``: ``"host:port"`` strings (a comma-separated string works too) of one etcd
    server or of the members of a cluster. ``timeout`` is the default for ``get``/``wait`` and
    bounds every other operation, retries included; ``connect_timeout`` bounds an outage of the
    whole cluster (default: ``timeout``). ``lease_ttl`` is how long, in seconds, the job's keys
    outlive its last client. Timeouts ``<= 0`` mean no limit.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str = "rpcdist",
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        connect_timeout: float | timedelta | None = None,
        lease_ttl: int = DEFAULT_LEASE_TTL,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.prefix = prefix.strip("/")
        if not self.prefix:
            raise StoreError("EtcdStore needs a non-empty key prefix for the job")
        if int(lease_ttl) < 1:
            raise StoreError(f"lease_ttl must be at least 1 second, not {lease_ttl!r}")
        super().__init__(timeout)
        self.connect_timeout = to_seconds(connect_timeout, self._timeout)
        self.lease_ttl = int(lease_ttl)
        root = self.prefix.encode() + b"/"
        self._keys_root = root + b"k/"
        self._lease_key = root + b"lease"
        self._marker_root = root + b"adds/" + uuid.uuid4().hex.encode() + b"/"
        self._members: dict[str, _Member] = {}
        self._current = 0  # index of the endpoint in use
        self._lease_id: int | None = None
        self._lease_lock: asyncio.Lock | None = None
        self._keep_alive_task: asyncio.Task[None] | None = None
        self._next_seq = 1
        self._done_markers: list[bytes] = []  # markers of answered adds, deleted by a later add

    @property
    def address(self) -> str:
        """The endpoints, comma-separated."""
        return ",".join(self.endpoints)

    # -- members and retries -------------------------------------------------------------------
    def _member(self) -> _Member:
        if self._closed:
            raise StoreError(f"this client of etcd at {self.address} is closed")
        endpoint = self.endpoints[self._current]
        member = self._members.get(endpoint)
        if member is None:
            channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
            member = _Member(
                endpoint,
                channel,
                pb_grpc.KVStub(channel),
                pb_grpc.WatchStub(channel),
                pb_grpc.LeaseStub(channel),
            )
            self._members[endpoint] = member
        return member

    def _fail_over(self, member: _Member, reason: str) -> None:
        """Leave ``member`` for the next endpoint (unless another task already did)."""
        if self.endpoints[self._current] == member.endpoint and len(self.endpoints) > 1:
            self._current = (self._current + 1) % len(self.endpoints)
            log.info(
                "etcd member %s failed (%s); using %s", member.endpoint, reason, self.endpoints[self._current]
            )

    async def _retrying(
        self,
        what: str,
        keys: Sequence[str],
        attempt: Callable[[_Member, float | None], Awaitable[T]],
        limit: float | None = None,
    ) -> T:
        """Run ``attempt(member, deadline)`` on the member in use, failing over to the next one
        while members are unreachable, within ``limit`` (default: the store's timeout) and
        ``connect_timeout``."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        budget = self._timeout if limit is None else limit
        op_end = start + budget if 0 < budget < math.inf else math.inf
        outage_limit = self.connect_timeout if 0 < self.connect_timeout < math.inf else math.inf
        outage_end = math.inf
        backoff = RETRY_BACKOFF
        failures = 0
        while True:
            member = self._member()
            remaining = op_end - loop.time()
            try:
                return await attempt(member, min(ATTEMPT_TIMEOUT, max(remaining, 1e-3)))
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise self._translate(exc, what, keys) from exc
                last = f"{exc.code().name}: {exc.details()}"
            now = loop.time()
            if outage_end == math.inf:
                outage_end = now + outage_limit
            if now >= min(op_end, outage_end):
                raise StoreConnectionError(
                    f"{what} on key(s) {list(keys)!r}: no member of etcd at {self.address} answered "
                    f"within {now - start:.3g} s (last: {member.endpoint}: {last})"
                )
            self._fail_over(member, last)
            failures += 1
            if failures % len(self.endpoints) == 0:  # every member failed once: back off
                await asyncio.sleep(min(backoff, max(0.0, min(op_end, outage_end) - now)))
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)

    async def _with_lease(
        self, what: str, keys: Sequence[str], attempt: Callable[[_Member, float | None, int], Awaitable[T]]
    ) -> T:
        """``_retrying`` for writes: ``attempt`` gets the job's lease; a lease that expired
        meanwhile (all clients were cut off for lease_ttl) is replaced and the write retried."""
        while True:
            try:
                lease = await self._job_lease()
            except StoreError as exc:
                raise type(exc)(f"{what} on key(s) {list(keys)!r}: no lease for the keys: {exc}") from exc

            async def with_lease(member: _Member, deadline: float | None, lease: int = lease) -> T:
                return await attempt(member, deadline, lease)

            try:
                return await self._retrying(what, keys, with_lease)
            except StoreError as exc:
                if not isinstance(exc.__cause__, grpc.aio.AioRpcError) or not _lease_lost(exc.__cause__):
                    raise
                log.warning(
                    "the lease of etcd prefix %r ran out (its keys are gone); taking a new one", self.prefix
                )
                if self._lease_id == lease:
                    self._lease_id = None

    def _translate(self, exc: grpc.aio.AioRpcError, what: str, keys: Sequence[str]) -> StoreError:
        details = exc.details() or ""
        where = f"etcd at {self.address}"
        if exc.code() is grpc.StatusCode.INVALID_ARGUMENT or exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return StoreValueError(f"{what} on key(s) {list(keys)!r} rejected by {where}: {details}")
        return StoreError(f"{what} on key(s) {list(keys)!r} in {where} failed: {exc.code().name}: {details}")

    # -- the job's lease ---------------------------------------------------------------------------
    async def _job_lease(self) -> int:
        """The id of the job's lease: the one other clients of the prefix keep alive, or a new
        one this client publishes; kept alive from now on."""
        if self._lease_id is not None:
            return self._lease_id
        if self._lease_lock is None:
            self._lease_lock = asyncio.Lock()
        async with self._lease_lock:
            if self._lease_id is None:
                self._lease_id = await self._find_or_grant_lease()
                if self._keep_alive_task is None or self._keep_alive_task.done():
                    self._keep_alive_task = asyncio.create_task(self._keep_alive())
            return self._lease_id

    async def _find_or_grant_lease(self) -> int:
        key = [self._lease_key.decode()]
        while True:
            found = await self._range(self._lease_key)
            if found.kvs:
                lease = int(found.kvs[0].value)
                alive = await self._lease_call("LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=lease))
                if alive.TTL > 0:
                    return lease
                await asyncio.sleep(RETRY_BACKOFF)  # its record goes with it in a moment
                continue
            grant = await self._lease_call("LeaseGrant", pb.LeaseGrantRequest(TTL=self.lease_ttl))
            publish = pb.TxnRequest(
                compare=[_absent(self._lease_key)],
                success=[_put(self._lease_key, str(grant.ID).encode(), grant.ID)],
            )
            won = await self._txn("Txn", key, publish)
            if won.succeeded:
                log.debug("etcd prefix %r: new job lease %x (ttl %d s)", self.prefix, grant.ID, grant.TTL)
                return grant.ID
            # Another client published first: use theirs, drop ours.
            await self._lease_call("LeaseRevoke", pb.LeaseRevokeRequest(ID=grant.ID))

    async def _keep_alive(self) -> None:
        """Renew the job's lease every lease_ttl/3 seconds through any member that answers."""
        interval = max(self.lease_ttl / 3.0, 0.2)
        backoff = RETRY_BACKOFF
        while not self._closed and self._lease_id is not None:
            lease = self._lease_id
            member = self._member()
            stream = member.lease.LeaseKeepAlive()
            try:
                while self._lease_id == lease and not self._closed:
                    await stream.write(pb.LeaseKeepAliveRequest(ID=lease))
                    reply = await wait_for(stream.read(), ATTEMPT_TIMEOUT)
                    if reply is grpc.aio.EOF:
                        raise _StreamBroken("keep-alive stream ended")
                    if reply.TTL <= 0:
                        log.warning(
                            "the lease of etcd prefix %r ran out (every client was cut off for %d s): "
                            "the job's keys are gone",
                            self.prefix,
                            self.lease_ttl,
                        )
                        if self._lease_id == lease:
                            self._lease_id = None
                        return
                    backoff = RETRY_BACKOFF
                    await asyncio.sleep(interval)
            except (
                grpc.aio.AioRpcError,
                asyncio.TimeoutError,
                asyncio.InvalidStateError,
                _StreamBroken,
            ) as exc:
                self._fail_over(member, f"keep-alive: {exc!r}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)
            finally:
                stream.cancel()

    # -- helpers -----------------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        return self._keys_root + key.encode()

    async def _txn(
        self, what: str, keys: Sequence[str], txn: pb.TxnRequest, limit: float | None = None
    ) -> pb.TxnResponse:
        return await self._retrying(what, keys, lambda m, t: m.kv.Txn(txn, timeout=t), limit)

    async def _range(self, name: bytes, limit: float | None = None) -> pb.RangeResponse:
        request = pb.RangeRequest(key=name)
        return await self._retrying(
            "Get", [name.decode()], lambda m, t: m.kv.Range(request, timeout=t), limit
        )

    async def _lease_call(self, method: str, request: Any) -> Any:
        """A unary call of the Lease service (on the job's lease record)."""
        return await self._retrying(
            method, [self._lease_key.decode()], lambda m, t: getattr(m.lease, method)(request, timeout=t)
        )

    async def _missing(self, names: list[bytes], limit: float | None) -> tuple[list[bytes], int]:
        """Which of ``names`` are absent, and the revision they were checked at (the oldest of
        the transactions, when there are too many for one)."""
        missing: list[bytes] = []
        revision = 0
        for i in range(0, max(len(names), 1), MAX_TXN_OPS):
            chunk = names[i : i + MAX_TXN_OPS]
            txn = pb.TxnRequest(
                success=[pb.RequestOp(request_range=pb.RangeRequest(key=k, count_only=True)) for k in chunk]
            )
            shown = [k.decode() for k in chunk]
            resp = await self._txn("Check", shown, txn, limit)
            missing += [k for k, r in zip(chunk, resp.responses, strict=True) if r.response_range.count == 0]
            revision = resp.header.revision if not revision else min(revision, resp.header.revision)
        return missing, revision

    async def _watch_until_set(self, names: list[bytes], from_revision: int) -> None:
        """Return once every key of ``names`` was put at or after ``from_revision``; raises
        _StreamBroken when the stream ends first (member lost, watch cancelled)."""
        waiting = set(names)
        member = self._member()
        stream = member.watch.Watch(metadata=_REQUIRE_LEADER)
        try:
            for name in names:
                create = pb.WatchCreateRequest(key=name, start_revision=from_revision)
                await stream.write(pb.WatchRequest(create_request=create))
            while waiting:
                reply = await stream.read()
                if reply is grpc.aio.EOF:
                    raise _StreamBroken("the watch stream ended")
                if reply.canceled:
                    raise _StreamBroken(f"watch cancelled: {reply.cancel_reason or 'compacted'}")
                for event in reply.events:
                    if event.type == pb.Event.PUT:
                        waiting.discard(event.kv.key)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (*_RETRYABLE, grpc.StatusCode.CANCELLED):
                raise self._translate(exc, "Watch", [n.decode() for n in names]) from exc
            self._fail_over(member, f"watch: {exc.code().name}: {exc.details()}")
            raise _StreamBroken(str(exc.details())) from exc
        finally:
            stream.cancel()

    async def _wait_names(self, keys: list[str], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout if 0 < timeout < math.inf else math.inf
        names = {self._key(k): k for k in keys}
        pending = list(names)
        backoff = RETRY_BACKOFF
        while True:
            left = end - loop.time()
            if left <= 0:
                raise timeout_error([names[n] for n in pending], timeout)
            pending, revision = await self._missing(pending, left if end < math.inf else 0)
            if not pending:
                return
            try:
                if end == math.inf:
                    await self._watch_until_set(pending, revision + 1)
                else:
                    await wait_for(self._watch_until_set(pending, revision + 1), end - loop.time())
                return
            except asyncio.TimeoutError:
                raise timeout_error([names[n] for n in pending], timeout) from None
            except _StreamBroken as exc:
                log.debug("watch on etcd at %s broke (%s); checking again", self.address, exc)
                await asyncio.sleep(min(backoff, max(0.0, end - loop.time())))
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX)

    # -- Store ---------------------------------------------------------------------------------
    async def _set(self, key: str, value: bytes) -> None:
        name = self._key(key)
        await self._with_lease(
            "Set",
            [key],
            lambda m, t, lease: m.kv.Put(pb.PutRequest(key=name, value=value, lease=lease), timeout=t),
        )

    async def _get(self, key: str, timeout: float) -> bytes:
        name = self._key(key)
        while True:
            found = await self._range(name, timeout if timeout > 0 else 0)
            if found.kvs:
                return bytes(found.kvs[0].value)
            # Set a moment later, or deleted again before the range: then wait anew.
            await self._wait_names([key], timeout)

    async def _add(self, key: str, amount: int) -> int:
        if not INT64_MIN <= amount <= INT64_MAX:
            raise StoreValueError(f"cannot add {amount} to store key {key!r}: amount outside int64")
        name = self._key(key)
        marker = self._marker_root + str(self._next_seq).encode()
        self._next_seq += 1
        read_marker = [pb.RequestOp(request_range=pb.RangeRequest(key=marker))]
        while True:
            found = await self._range(name)
            if found.kvs:
                current = parse_counter(key, bytes(found.kvs[0].value))
                unchanged = pb.Compare(
                    result=pb.Compare.EQUAL,
                    target=pb.Compare.MOD,
                    key=name,
                    mod_revision=found.kvs[0].mod_revision,
                )
            else:
                current, unchanged = 0, _absent(name)
            new = current + amount
            if not INT64_MIN <= new <= INT64_MAX:
                raise StoreValueError(f"cannot add {amount} to store key {key!r}: the result overflows int64")
            cleanup = self._done_markers[: MAX_TXN_OPS // 2]
            # The marker makes a retry of this very transaction (answer lost) a no-op whose
            # failure branch reads back the result the first attempt wrote.
            compare = [unchanged, _absent(marker)]
            value = str(new).encode()
            deletes = [pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=k)) for k in cleanup]

            async def attempt(
                member: _Member,
                deadline: float | None,
                lease: int,
                compare: Any = compare,
                value: bytes = value,
                deletes: Any = deletes,
            ) -> pb.TxnResponse:
                success = [_put(name, value, lease), _put(marker, value, lease), *deletes]
                txn = pb.TxnRequest(compare=compare, success=success, failure=read_marker)
                return await member.kv.Txn(txn, timeout=deadline)

            resp = await self._with_lease("Add", [key], attempt)
            if resp.succeeded:
                self._done_markers = [m for m in self._done_markers if m not in cleanup]
                self._done_markers.append(marker)
                return new
            earlier = resp.responses[0].response_range.kvs
            if earlier:
                self._done_markers.append(marker)
                return int(earlier[0].value)
            # Another client changed the key in between: read it again.

    async def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        name = self._key(key)
        value_is = pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.VALUE, key=name, value=expected)
        # An empty ``expected`` matches a missing key or an empty value, as in torch's stores:
        # one transaction cannot say "either", so try the case the last answer showed.
        condition = value_is if expected else _absent(name)
        while True:

            def transaction(lease: int, condition: pb.Compare = condition) -> pb.TxnRequest:
                return pb.TxnRequest(
                    compare=[condition],
                    success=[_put(name, desired, lease)],
                    failure=[pb.RequestOp(request_range=pb.RangeRequest(key=name))],
                )

            resp = await self._with_lease(
                "CompareSet", [key], lambda m, t, lease, make=transaction: m.kv.Txn(make(lease), timeout=t)
            )
            if resp.succeeded:
                return desired
            held = resp.responses[0].response_range.kvs
            if not held:
                if expected:
                    return expected  # torch: a missing key with a non-empty expected
                condition = _absent(name)  # deleted since the last try
            elif expected or held[0].value:
                return bytes(held[0].value)
            else:
                condition = value_is  # it holds the empty value

    async def _wait(self, keys: list[str], timeout: float) -> None:
        await self._wait_names(keys, timeout)

    async def _check(self, keys: list[str]) -> bool:
        missing, _ = await self._missing([self._key(k) for k in keys], None)
        return not missing

    async def _delete_key(self, key: str) -> bool:
        name = self._key(key)
        resp = await self._retrying(
            "DeleteRange", [key], lambda m, t: m.kv.DeleteRange(pb.DeleteRangeRequest(key=name), timeout=t)
        )
        return resp.deleted > 0

    async def _num_keys(self) -> int:
        request = pb.RangeRequest(key=self._keys_root, range_end=_range_end(self._keys_root), count_only=True)
        resp = await self._retrying("NumKeys", [], lambda m, t: m.kv.Range(request, timeout=t))
        return int(resp.count)

    async def _close(self) -> None:
        # The lease is the job's, not this client's: it is left to run out once every client
        # of the job stopped renewing it.
        # Each step is bounded: a client that cannot finish closing still lets its program exit.
        task, self._keep_alive_task = self._keep_alive_task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=ATTEMPT_TIMEOUT)
            if not done:
                log.warning(
                    "etcd prefix %r: the lease keep-alive did not stop within %.0f s",
                    self.prefix,
                    ATTEMPT_TIMEOUT,
                )
        members, self._members = list(self._members.values()), {}
        for member in members:
            try:
                await wait_for(member.channel.close(), ATTEMPT_TIMEOUT)
            except TimeoutError:
                log.warning(
                    "etcd prefix %r: the channel to %s did not close within %.0f s",
                    self.prefix,
                    member.endpoint,
                    ATTEMPT_TIMEOUT,
                )

    def __repr__(self) -> str:
        return f"<EtcdStore {self.address} prefix={self.prefix!r}>"


def _put(key: bytes, value: bytes, lease: int) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def _lease_lost(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() is grpc.StatusCode.NOT_FOUND and "lease not found" in (exc.details() or "")


def store_from_url(url: str, timeout: float, **overrides: Any) -> EtcdStore:
    """The EtcdStore of an ``etcd://`` URL (``?lease_ttl=S`` and ``?connect_timeout=S`` accepted)."""
    endpoints, prefix, options = parse_etcd_url(url)
    unknown = set(options) - {"lease_ttl", "connect_timeout"}
    if unknown:
        raise StoreError(f"unknown option(s) {sorted(unknown)} in {url!r}: use lease_ttl, connect_timeout")
    kwargs: dict[str, Any] = {}
    try:
        if "lease_ttl" in options:
            kwargs["lease_ttl"] = int(options["lease_ttl"])
        if "connect_timeout" in options:
            kwargs["connect_timeout"] = float(options["connect_timeout"])
    except ValueError as exc:
        raise StoreError(f"bad option in {url!r}: {exc}") from None
    kwargs.update(overrides)
    return EtcdStore(endpoints, prefix, timeout=timeout, **kwargs)
