"""Functions the benchmark's RPC callers run on the callee.

They live in their own module (not in ``rpc_bench.py``, which is ``__main__`` in the
orchestrator) so both torch.distributed.rpc and rpcdist can pickle them by reference: every
benchmark process puts this directory on ``sys.path`` before it imports anything else.
Keep them trivial: the benchmark measures the transport, not the function.
"""

from __future__ import annotations

import os


def noop() -> None:
    """(a)/(b): a call with no work and no result."""
    return None


def sink(tensor: object) -> None:
    """(c): accept a payload and answer with nothing, so the bytes travel one way only."""
    return None


def small(value: int) -> int:
    """(d): the value an ``rpc.remote`` call leaves on the owner (fetched with ``to_here()``)."""
    return value + 1


def getpid() -> int:
    """The callee's process id (a sanity check that calls really cross a process boundary)."""
    return os.getpid()
