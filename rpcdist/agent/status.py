"""The ``rpcdist.v1.Status`` gRPC service of every worker: what it is doing now (pending
calls, RRef counts, each peer's link), for ``rpcdist-status`` and anyone with a gRPC client."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import grpc

from rpcdist import metrics
from rpcdist.v1 import status_pb2, status_pb2_grpc

if TYPE_CHECKING:
    from rpcdist.agent.core import Agent

__all__ = ["SERVICE_NAME", "StatusServicer", "to_message"]

SERVICE_NAME = status_pb2.DESCRIPTOR.services_by_name["Status"].full_name


def to_message(status: dict[str, Any]) -> status_pb2.DebugInfoResponse:
    """``Agent.status()`` as the service's answer."""
    return status_pb2.DebugInfoResponse(
        name=status["name"],
        rank=status["rank"],
        counts={key: int(value) for key, value in status["counts"].items()},
        peers=[
            status_pb2.PeerState(
                name=peer["name"],
                rank=peer["rank"],
                state=peer["state"],
                carrier=peer["carrier"],
                seconds_since_heard=-1.0
                if peer["seconds_since_heard"] is None
                else peer["seconds_since_heard"],
            )
            for peer in status["peers"]
        ],
        metrics_address=metrics.address(),
    )


class StatusServicer(status_pb2_grpc.StatusServicer):
    """Answers from the agent's ``status()`` (on the agent's loop, so the state is consistent)."""

    def __init__(self, agent: Agent) -> None:
        self._agent: Agent = weakref.proxy(agent)  # the agent's server holds this: no cycle

    async def DebugInfo(  # noqa: N802 - the gRPC method's name
        self, request: status_pb2.DebugInfoRequest, context: grpc.aio.ServicerContext
    ) -> status_pb2.DebugInfoResponse:
        return to_message(self._agent.status())

    def add_to(self, server: grpc.aio.Server) -> None:
        status_pb2_grpc.add_StatusServicer_to_server(self, server)
