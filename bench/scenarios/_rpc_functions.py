"""Functions the ``rpc`` scenario's callers run on the callee.

They live in their own module (not in the driver, which is ``__main__`` in the orchestrator)
so both torch.distributed.rpc and rpcdist can pickle them by reference: every benchmark
process has ``bench/`` on ``sys.path`` before it imports anything else.
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
    """(d)/(g): the value an ``rpc.remote`` call leaves on the owner (a small Python int)."""
    return value + 1


def getpid() -> int:
    """The callee's process id (a sanity check that calls really cross a process boundary)."""
    return os.getpid()


class Target:
    """(f): the object an RRef points at; ``rref.rpc_sync().noop()`` runs this on its owner."""

    def noop(self) -> None:
        return None


def vm_rss(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def owned_rrefs(system: str) -> int:
    """How many values this worker owns as an RRef owner, from the system's own debug info."""
    if system == "torch":
        from torch.distributed.rpc import _rref_context_get_debug_info

        return int(_rref_context_get_debug_info()["num_owner_rrefs"])
    from rpcdist.rpc import debug_info

    return int(debug_info()["owned_rrefs"])


def memory_stats(system: str) -> dict[str, int]:
    """(g): the owner's RSS (after a full gc) and how many RRef values it owns."""
    import gc

    gc.collect()
    return {"rss": vm_rss(), "owned": owned_rrefs(system)}
