"""The RPC agent of this process (set by ``rpcdist.rpc.init_rpc``, cleared by ``shutdown``).

Layers above the agent (RRefs, distributed autograd) find it here rather than through the
public RPC module, so none of them imports ``rpcdist.rpc.api``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rpcdist.errors import RpcError

if TYPE_CHECKING:
    from rpcdist.agent.core import Agent

_agent: Agent | None = None

# torch's wordings, which torch users match: of an RPC call, and of an RRef made or used.
NOT_INITIALIZED = "RPC has not been initialized. Call rpcdist.rpc.init_rpc(...) first."
NO_AGENT_FOR_RREF = (
    "Current RPC agent is not set! Did you initialize the RPC framework "
    "(e.g. by calling rpcdist.rpc.init_rpc(...))?"
)


def current_agent() -> Agent:
    """This process's RPC agent; RpcError if RPC is not initialized."""
    agent = _agent
    if agent is None:
        raise RpcError(NOT_INITIALIZED)
    return agent


def set_current_agent(agent: Agent | None) -> None:
    global _agent
    _agent = agent
