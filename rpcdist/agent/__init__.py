"""``rpcdist.agent``: calls between workers, on top of :mod:`rpcdist.transport`.

Call ids, dispatch to the event loop or the thread pool, timeouts and cancellation, error
rebuilding. ``rpcdist.rpc`` (the public API and RRefs), ``rpcdist.autograd`` and
``rpcdist.collectives`` are built on :class:`Agent` and talk to it only through its methods
and the :mod:`~rpcdist.agent.extensions` interface.

    core        Agent: lifecycle, membership, the methods layers above use
    caller      outgoing calls and their Futures
    callee      incoming calls: sessions, dispatch, answers
    codec       calls, results and errors as messages
    extensions  per-call state (distributed autograd) and undo of undelivered messages
    markers     how a function says it runs (async_execution, inline)
    threads     the loop inbox and the worker pool
    options     RpcBackendOptions and WorkerInfo
    current     this process's RPC agent
"""

from rpcdist.agent.core import Agent
from rpcdist.agent.current import current_agent, set_current_agent
from rpcdist.agent.options import RpcBackendOptions, WorkerInfo

__all__ = ["Agent", "RpcBackendOptions", "WorkerInfo", "current_agent", "set_current_agent"]
