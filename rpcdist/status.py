"""rpcdist-status: the members of an RPC group, their health and their pending work.

Usage::

    rpcdist-status --store HOST:PORT [--timeout 5] [--json] [--auth-token-file F] [--tls-ca CA ...]
    python -m rpcdist.status --store HOST:PORT

The job's token comes from ``--auth-token-file`` or ``RPCDIST_AUTH_TOKEN(_FILE)``; for a store
on this host without one, from the token file the store left for its user (as its workers do).

The members come from the group's rendezvous keys in the store (a fixed group's ranks, or a
dynamic group's roster). Each member's own gRPC server is then asked for its health
(``grpc.health.v1.Health``) and its ``rpcdist.v1.Status/DebugInfo``: calls in flight and
running, ``rpc.debug_info()``'s RRef counts, and how it sees each peer.

Exit status: 0 when every member answers SERVING, 3 when some member does not (it is listed
with the reason), 1 when the store cannot be reached or holds no group, 2 for a bad command
line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcdist import security
from rpcdist.errors import StoreError
from rpcdist.rpc.elastic import DYNAMIC, ROSTER
from rpcdist.security import Security
from rpcdist.store import GrpcStore, PrefixStore
from rpcdist.v1 import status_pb2, status_pb2_grpc

__all__ = ["collect", "main", "members"]

_RPC_PREFIX = "rpc"  # the keys rpcdist.rpc's rendezvous writes under


async def members(
    store_address: str, timeout: float, credentials: Security | None = None
) -> tuple[list[dict[str, Any]], Security]:
    """The RPC group registered in the store at ``host:port``: ``[{rank, name, address}]`` by
    rank (ranks that have not joined yet have ``name`` ""), and the credentials that reached it
    (``credentials``, default from the environment, with the job token a store on this host
    left for its user, if any). StoreError when it is unreachable or holds no group."""
    host, _, port_text = store_address.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"--store must be HOST:PORT, not {store_address!r}")
    client = GrpcStore(
        host.strip("[]"), int(port_text), timeout=timeout, connect_timeout=timeout, security=credentials
    )
    store = PrefixStore(_RPC_PREFIX, client)
    try:
        if not await store.check_async(["world_size"]):
            raise StoreError(f"the store at {store_address} holds no RPC group (no worker has joined one)")
        size = await store.get_async("world_size")
        found = []
        if size == DYNAMIC:
            roster = json.loads(await store.get_async(ROSTER)) if await store.check_async([ROSTER]) else {}
            for rank, entry in sorted(roster.items(), key=lambda item: int(item[0])):
                found.append({"rank": int(rank), "name": entry["name"], "address": entry["card"]["address"]})
            return found, client.security
        for rank in range(int(size)):
            if await store.check_async([f"address/{rank}"]):
                name = (await store.get_async(f"rank/{rank}")).decode()
                card = json.loads(await store.get_async(f"address/{rank}"))
                # a rank that could not join left a card without an address
                found.append({"rank": rank, "name": name, "address": card.get("address", "")})
            else:
                found.append({"rank": rank, "name": "", "address": ""})
        return found, client.security
    finally:
        await client.close_async()


async def _ask(member: dict[str, Any], timeout: float, credentials: Security) -> dict[str, Any]:
    """``member`` with its ``health`` and ``status`` (or ``error``) from its own server."""
    answer = dict(member, health="NOT JOINED", status=None, error="")
    if not member["address"]:
        return answer
    async with credentials.channel(member["address"]) as channel:
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            answer["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            info: status_pb2.DebugInfoResponse = await status_pb2_grpc.StatusStub(channel).DebugInfo(
                status_pb2.DebugInfoRequest(), timeout=timeout, metadata=credentials.metadata()
            )
        except grpc.aio.AioRpcError as exc:
            answer["health"] = "UNREACHABLE" if answer["health"] == "NOT JOINED" else answer["health"]
            answer["error"] = f"{exc.code().name}: {exc.details()}"
            return answer
    answer["status"] = {
        "counts": dict(info.counts),
        "peers": [
            {
                "name": p.name,
                "rank": p.rank,
                "state": p.state,
                "carrier": p.carrier,
                "seconds_since_heard": None if p.seconds_since_heard < 0 else p.seconds_since_heard,
            }
            for p in info.peers
        ],
        "metrics_address": info.metrics_address,
    }
    return answer


async def collect(
    store_address: str, timeout: float = 5.0, credentials: Security | None = None
) -> list[dict[str, Any]]:
    """Every member of the group at ``store_address`` with its health and status (asked all
    at once, each within ``timeout`` seconds), with ``credentials`` (see :func:`members`)."""
    found, reached_with = await members(store_address, timeout, credentials)
    return list(await asyncio.gather(*(_ask(member, timeout, reached_with) for member in found)))


def _format(store_address: str, report: list[dict[str, Any]]) -> str:
    lines = [f"store {store_address}: {len(report)} members"]
    header = ("RANK", "NAME", "ADDRESS", "HEALTH", "IN-FLIGHT", "RUNNING", "OWNED-RREFS", "USER-RREFS")
    rows = [header]
    details = []
    for member in report:
        counts = (member["status"] or {}).get("counts", {})
        rows.append(
            (
                str(member["rank"]),
                member["name"] or "-",
                member["address"] or "-",
                member["health"],
                *(str(counts.get(key, "-")) for key in ("calls_in_flight", "calls_running")),
                *(str(counts.get(key, "-")) for key in ("owned_rrefs", "user_rrefs")),
            )
        )
        if member["error"]:
            details.append(f"  {member['name'] or member['rank']}: {member['error']}")
        elif member["status"]:
            peers = ", ".join(
                f"{p['name']} {p['state']}"
                + (f" ({p['seconds_since_heard']:.1f} s ago)" if p["seconds_since_heard"] is not None else "")
                for p in member["status"]["peers"]
            )
            metrics = member["status"]["metrics_address"]
            details.append(
                f"  {member['name']} peers: {peers or 'none'}"
                + (f"; metrics http://{metrics}/metrics" if metrics else "")
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines + details)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of rpcdist-status."""
    parser = argparse.ArgumentParser(
        prog="rpcdist-status", description="members of an rpcdist RPC group, their health and pending work"
    )
    parser.add_argument("--store", required=True, metavar="HOST:PORT", help="the group's store (rendezvous)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds for the store and each worker to answer (default: 5)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    security.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rpcdist-status`` console script."""
    args = parse_args(argv)
    try:
        report = asyncio.run(collect(args.store, args.timeout, security.from_arguments(args)))
    except (StoreError, ValueError) as exc:
        print(f"rpcdist-status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"store": args.store, "members": report}, indent=2))
    else:
        print(_format(args.store, report))
    return 0 if all(member["health"] == "SERVING" for member in report) else 3


if __name__ == "__main__":
    raise SystemExit(main())
