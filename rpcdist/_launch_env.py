"""What a launcher tells a process through its environment: torchrun's and rpcdist-run's
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and Slurm's (``srun``).

Lets ``rpcdist.init_process_group()`` and ``rpcdist.rpc.init_rpc(name)`` run with no other
argument under ``rpcdist-run``, ``torchrun`` and ``srun``:

===================  =======================================  =================================
what                 torchrun / rpcdist-run                   Slurm (when those are not set)
===================  =======================================  =================================
rank                 ``RANK``                                 ``SLURM_PROCID``
world size           ``WORLD_SIZE``                           ``SLURM_NTASKS``
rank on the host     ``LOCAL_RANK``                           ``SLURM_LOCALID``
store host           ``MASTER_ADDR``                          first host of ``SLURM_JOB_NODELIST``
store port           ``MASTER_PORT``                          29500
===================  =======================================  =================================

Slurm also sets ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` in a batch script itself, outside any
``srun``: start every task with ``srun`` (or set RANK/WORLD_SIZE) rather than running the
program straight from the batch script.

Standard library only: the launcher imports it before anything heavy.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping

__all__ = [
    "AGENT_STORE_MARKER",
    "LAUNCHED_MARKER",
    "SLURM_DEFAULT_MASTER_PORT",
    "expand_nodelist",
    "first_node",
    "is_launched",
    "is_slurm_task",
    "is_torchelastic_launched",
    "launch_rank_and_size",
    "launcher_serves_store",
    "local_rank",
    "master_address",
]

LAUNCHED_MARKER = "RPCDIST_LAUNCHED"  # set to "1" by rpcdist-run in every worker it starts
# "1": the launcher serves an rpcdist store at MASTER_ADDR:MASTER_PORT (rank 0 must not serve one)
AGENT_STORE_MARKER = "RPCDIST_AGENT_STORE"
SLURM_DEFAULT_MASTER_PORT = 29500

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm node list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _bracket_values(body: str, nodelist: str) -> Iterator[str]:
    """``01-03,7`` -> 01, 02, 03, 7 (zero padding kept, as Slurm does)."""
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ValueError(f"bad range {item!r} in Slurm node list {nodelist!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            yield low
            continue
        width = len(low) if low.startswith("0") else 0
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in Slurm node list {nodelist!r}")
        for value in range(int(low), int(high) + 1):
            yield str(value).zfill(width)


def _expand_one(pattern: str, nodelist: str) -> Iterator[str]:
    """One host pattern, possibly with several bracket groups (``rack[1-2]-n[01-02]``)."""
    pieces = re.split(r"(\[[^\]]*\])", pattern)
    choices: list[list[str] | tuple[str]] = []
    for piece in pieces:
        if piece.startswith("[") and piece.endswith("]"):
            choices.append(list(_bracket_values(piece[1:-1], nodelist)))
        elif piece:
            choices.append((piece,))
    for combination in itertools.product(*choices):
        yield "".join(combination)


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in order: ``"node[01-03],other"`` ->
    ``["node01", "node02", "node03", "other"]``.

    Handles several comma-separated patterns, ranges and single values inside brackets
    (``n[1,3-4]``), zero padding, and several bracket groups in one name. Raises ValueError
    for a malformed list.
    """
    hosts: list[str] = []
    for pattern in _split_top_level(nodelist):
        hosts.extend(_expand_one(pattern, nodelist))
    return hosts


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list (without expanding the rest of it)."""
    for pattern in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", pattern)
        first = (next(_bracket_values(p[1:-1], nodelist)) if p.startswith("[") else p for p in pieces)
        return "".join(first)
    raise ValueError(f"empty Slurm node list {nodelist!r}")


def is_slurm_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process looks like a Slurm task (``SLURM_PROCID`` and ``SLURM_NTASKS`` set)."""
    env = _environ(env)
    return bool(env.get("SLURM_PROCID")) and bool(env.get("SLURM_NTASKS"))


def launch_rank_and_size(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """This process's rank and the world size as its launcher set them: ``RANK``/``WORLD_SIZE``
    (torchrun, rpcdist-run, by hand), else ``SLURM_PROCID``/``SLURM_NTASKS``; None where
    neither says."""
    env = _environ(env)
    slurm = is_slurm_task(env)
    rank_text = env.get("RANK") or (env.get("SLURM_PROCID") if slurm else None)
    size_text = env.get("WORLD_SIZE") or (env.get("SLURM_NTASKS") if slurm else None)
    return (int(rank_text) if rank_text else None, int(size_text) if size_text else None)


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its host: ``LOCAL_RANK``, else ``SLURM_LOCALID`` under Slurm."""
    env = _environ(env)
    text = env.get("LOCAL_RANK") or (env.get("SLURM_LOCALID") if is_slurm_task(env) else None)
    return int(text) if text else None


def master_address(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """``(host, port)`` of the store for ``env://``: ``MASTER_ADDR``/``MASTER_PORT``; under
    Slurm the first host of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) and port 29500
    stand in for whichever is unset. None where nothing says."""
    env = _environ(env)
    host, port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    if is_slurm_task(env):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if host is None and nodelist:
            host = first_node(nodelist)
        if port is None:
            port = str(SLURM_DEFAULT_MASTER_PORT)
    return host, port


def launcher_serves_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether rpcdist-run serves the rpcdist store at MASTER_ADDR:MASTER_PORT itself (then
    ``env://`` connects to it and rank 0 serves none)."""
    return _environ(env).get(AGENT_STORE_MARKER) == "1"


def is_torchelastic_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchelastic: torchrun or rpcdist-run
    (``TORCHELASTIC_RUN_ID`` set), as ``torch.distributed.is_torchelastic_launched``."""
    return _environ(env).get("TORCHELASTIC_RUN_ID") is not None


def is_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process and told it its rank: ``rpcdist-run``,
    ``torchrun`` (``TORCHELASTIC_RUN_ID``) or Slurm's ``srun`` (``SLURM_PROCID`` and
    ``SLURM_NTASKS``). Such a process can call ``init_process_group()`` / ``init_rpc(name)``
    with no other argument."""
    env = _environ(env)
    return env.get(LAUNCHED_MARKER) == "1" or is_torchelastic_launched(env) or is_slurm_task(env)
