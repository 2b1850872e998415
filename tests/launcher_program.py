"""The program the launcher tests start (``python launcher_program.py MODE OUT_DIR``), and the
entry point of the processes they fork from the test fork server (:func:`run_spec`).

Modes (each worker writes what it saw into OUT_DIR, named by its RANK):

- ``env``: the launcher's environment contract, the store at MASTER_ADDR:MASTER_PORT
  reachable, a line on stderr; standard library only, so it starts in milliseconds.
- ``restart``: rank 1 of the first round exits 3 (rank 0 waits to be stopped); the second
  round succeeds.
- ``fail``: rank 1 raises a ValueError and exits 7, every round (rank 0 waits to be stopped).
- ``sigint``: waits; on SIGINT records it and dies of it.
- ``sleep``: records its pid and sleeps.
- ``rpc``: RPC and all_reduce with no init arguments (:func:`init_without_arguments`).
- ``elastic``: records the group it is in (:func:`mode_elastic`), waits to be stopped when the
  group re-forms, or for OUT_DIR/finish to name its world size, then does what ``rpc`` does.

Imports only the standard library at module level.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CONTRACT = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "RPCDIST_LAUNCHED",
]


def _write(out: Path, name: str, value: Any) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / name)


def _rank() -> int:
    return int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])


def mode_env(out: Path) -> None:
    env = {key: os.environ.get(key) for key in CONTRACT}
    reachable = False
    try:
        with socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), timeout=5):
            reachable = True
    except OSError:
        pass
    print(f"hello on stderr from rank {env['RANK']}", file=sys.stderr, flush=True)
    _write(out, f"rank{env['RANK']}.json", {"env": env, "store_reachable": reachable, "pid": os.getpid()})


def mode_restart(out: Path) -> None:
    rank, attempt = _rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    seen = {"restart_count": attempt, "pid": os.getpid(), "master_port": os.environ["MASTER_PORT"]}
    _write(out, f"rank{rank}.attempt{attempt}.json", seen)
    if attempt == 0:
        if rank == 1:
            deadline = time.monotonic() + 30  # rank 0 has recorded the round too (a loaded host)
            while not (out / "rank0.attempt0.json").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            print("rank 1 fails on purpose in the first round", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(60)  # stopped by the launcher when rank 1 fails


def _explode() -> None:
    raise ValueError("boom from rank 1")


def mode_fail(out: Path) -> None:
    if _rank() != 1:
        time.sleep(60)
        return
    try:
        _explode()
    except ValueError:
        traceback.print_exc()
        sys.exit(7)


def mode_sigint(out: Path) -> None:
    rank = _rank()

    def on_sigint(signum: int, frame: Any) -> None:
        _write(out, f"rank{rank}.sigint", {"signal": signum})
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGINT, on_sigint)
    _write(out, f"rank{rank}.ready", {"pid": os.getpid()})
    time.sleep(60)
    _write(out, f"rank{rank}.timeout", {})


def mode_sleep(out: Path) -> None:
    _write(out, f"rank{_rank()}.pid", {"pid": os.getpid()})
    time.sleep(120)


def init_without_arguments(out: Path) -> None:
    """``rpc.init_rpc(name)`` and ``init_process_group()`` with nothing but the environment."""
    import torch

    import rpcdist
    import rpcdist.rpc as rpc

    rank = _rank()
    rpc.init_rpc(f"w{rank}")
    me, world = rpc.get_worker_info().id, len(rpc.get_all_worker_infos())
    peer = (rank + 1) % world
    got = rpc.rpc_sync(f"w{peer}", torch.add, args=(torch.ones(2), peer)).tolist()
    rpc.shutdown()
    rpcdist.init_process_group()
    t = torch.tensor([float(rank + 1)])
    rpcdist.all_reduce(t)
    result = {
        "rank": rank,
        "rpc_rank": me,
        "rpc_world": world,
        "pg_rank": rpcdist.get_rank(),
        "pg_world": rpcdist.get_world_size(),
        "rpc": got,
        "all_reduce": t.item(),
        "is_torchelastic_launched": rpcdist.is_torchelastic_launched(),
        "is_launched": rpcdist.is_launched(),
        "local_rank": rpcdist.get_node_local_rank(),
    }
    rpcdist.destroy_process_group()
    _write(out, f"rank{rank}.json", result)


def mode_elastic(out: Path) -> None:
    """Write ``seen.<pid>.json`` (each round starts new workers; the round's store port is in
    it, but the system may give a later round's store the same port); then wait until
    ``finish`` holds this group's world size and run :func:`init_without_arguments` in it. A
    re-forming group stops it before that (SIGTERM)."""
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    seen = {
        "port": os.environ["MASTER_PORT"],
        "rank": rank,
        "world": world,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "group_world_size": int(os.environ["GROUP_WORLD_SIZE"]),
        "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "pid": os.getpid(),
    }
    _write(out, f"seen.{os.getpid()}.json", seen)
    finish, deadline = out / "finish", time.monotonic() + 150
    while time.monotonic() < deadline:
        if finish.exists() and finish.read_text() == str(world):
            init_without_arguments(out)
            return
        time.sleep(0.05)
    sys.exit(5)


MODES = {
    "env": mode_env,
    "restart": mode_restart,
    "fail": mode_fail,
    "sigint": mode_sigint,
    "sleep": mode_sleep,
    "rpc": init_without_arguments,
    "elastic": mode_elastic,
}


def run_spec(spec: dict[str, Any]) -> None:
    """Body of a process forked from the test fork server (torch and rpcdist already
    imported): optionally move onto a network-namespace "host", take the given environment
    and log file, then run the launcher's ``main(argv)`` or :func:`init_without_arguments`."""
    if spec.get("netns"):
        import _netns

        _netns.enter(spec["netns"])
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(spec["env"])
    code = 0
    try:
        if spec["what"] == "launcher":
            from rpcdist.run import main

            code = main(spec["argv"])
        else:
            init_without_arguments(Path(spec["out"]))
    except BaseException:  # noqa: BLE001 - reported in the log, exit status 99
        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    MODES[sys.argv[1]](Path(sys.argv[2]))
