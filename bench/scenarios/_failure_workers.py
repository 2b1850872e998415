"""The processes the ``failure`` scenario (``failure.py``) starts.

Group ranks (forked from the forkserver; ``rank_main``), one pipe each to the orchestrator,
with the protocol of ``_group.py`` (phase / result / error / measured / done, then ``stop``):

  detect (3 workers w0, w1, w2): w0 calls w2 (so every link it needs exists), then
      ``rpc_async``-calls ``hold`` on w2, which touches a marker file and sleeps; once the
      marker is there and the links were quiet for ``settle`` s plus up to ``jitter`` s (at
      random), w0 takes a monotonic timestamp and kills (SIGKILL) or stops (SIGSTOP) w2, and
      reports how long its future took to fail (a done callback stamps the time), or that it
      had not failed after ``cap`` seconds. A stopped w2 is killed afterwards.
  idle (8 workers): every worker calls every other once (so all links exist), says
      ("ready",) and waits for ("go",) while the orchestrator measures the group's CPU.

After its part every rank waits for the orchestrator's ("stop",) and exits at once (no
graceful shutdown: torch's would wait forever for the dead worker).

The start-up program: ``python _failure_workers.py startup <torch|rpcdist> <outdir>``, run by
``rpcdist-run`` or ``torchrun`` (``PYTHONPATH`` holding ``bench/``): every rank imports its
RPC package and joins the group with no init arguments (the launcher's environment), rank 0
makes one ``rpc_sync`` to the last rank, and all shut down. Rank 0 writes monotonic timestamps
(``time.monotonic()`` is one clock for every process of the machine) to ``outdir/rank0.json``
as soon as its first call returns, and every rank writes ``outdir/rank<N>.done.json`` after
shutdown.

Only the standard library is imported at module level (the orchestrator imports this too).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import _harness as H

RPC_TIMEOUT_SLACK = 60.0  # the detect call's own timeout is cap + this: it never fires first


def hold(marker: str, seconds: float) -> int:
    """Runs on the victim: says it is running (creates ``marker``), then sleeps."""
    with open(marker, "w"):
        pass
    time.sleep(seconds)
    return os.getpid()


def _backend(system: str, init_method: str, opts: dict[str, Any]) -> tuple[Any, Any]:
    """The RPC module of ``system`` and its backend options (``opts``: rpcdist's extras)."""
    if system == "torch":
        import torch.distributed.rpc as rpc

        return rpc, rpc.TensorPipeRpcBackendOptions(init_method=init_method)  # TensorPipe defaults
    if system == "rpcdist":
        import rpcdist.rpc as rpc

        return rpc, rpc.RpcBackendOptions(init_method=init_method, **opts)
    raise ValueError(system)


def rank_main(
    system: str,
    kind: str,
    rank: int,
    world: int,
    init_method: str,
    opts: dict[str, Any],
    cfg: dict[str, Any],
    conn: Any,
    stack_file: str,
    lifeline: Any,
) -> None:
    """One worker ``w<rank>`` of a ``kind`` ("detect" or "idle") group of ``system``."""
    _keep = H.child_setup(stack_file, lifeline, "failbench")  # noqa: F841
    phase = "init"
    try:
        rpc, options = _backend(system, init_method, opts)
        conn.send(("phase", "init", cfg["init_budget"]))
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=options)
        conn.send(("result", "init", {}))
        if kind == "detect":
            phase = "detect"
            _detect(rpc, rank, world, cfg, conn)
        elif kind == "idle":
            phase = "links"
            _idle(rpc, rank, world, cfg, conn)
        else:
            raise ValueError(kind)
    except BaseException:
        conn.send(("error", phase, traceback.format_exc()))
    _wait_for_stop(conn)


def _wait_for_stop(conn: Any) -> None:
    """Until the orchestrator ends the group (or goes away); then exit without shutting down."""
    try:
        while conn.recv() != ("stop",):
            pass
    except (EOFError, OSError):
        pass
    sys.stderr.flush()
    os._exit(0)


def _detect(rpc: Any, rank: int, world: int, cfg: dict[str, Any], conn: Any) -> None:
    """w0 measures; the others have nothing to report (w2 is about to be killed or stopped)."""
    if rank != 0:
        conn.send(("done",))
        return
    cap, how = cfg["cap"], cfg["how"]
    conn.send(("phase", "detect", cap + cfg["phase_budget"]))
    victim = f"w{world - 1}"
    pid = rpc.rpc_sync(victim, os.getpid)
    for r in range(1, world - 1):
        rpc.rpc_sync(f"w{r}", os.getpid)
    marker = os.path.join(cfg["tmpdir"], f"held-{os.getpid()}")
    failed = threading.Event()
    stamps: list[float] = []

    def on_done(_: Any) -> None:
        stamps.append(time.monotonic())
        failed.set()

    fut = rpc.rpc_async(victim, hold, args=(marker, cap + RPC_TIMEOUT_SLACK), timeout=cap + RPC_TIMEOUT_SLACK)
    fut.add_done_callback(on_done)
    deadline = time.monotonic() + cfg["phase_budget"]
    while not os.path.exists(marker):
        if failed.is_set() or time.monotonic() > deadline:
            fut.wait()  # raises what went wrong
            raise RuntimeError(f"hold() returned on {victim} before it was {how}ed")
        time.sleep(0.002)
    quiet = cfg["settle"] + random.uniform(0.0, cfg["jitter"])
    time.sleep(quiet)  # the call is inside its sleep; the links are quiet
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    detected = failed.wait(cap)
    waited = time.monotonic() - t_kill
    if how != "kill":
        os.kill(pid, signal.SIGKILL)
    res: dict[str, Any] = {
        "how": how,
        "cap_s": cap,
        "detected": detected,
        "waited_s": waited,
        "quiet_s": quiet,
    }
    if detected:
        res["latency_s"] = stamps[0] - t_kill
        try:
            fut.wait()
            res["error"] = "none: the call returned"
        except Exception as exc:  # noqa: BLE001 - what the future failed with, reported
            res["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    conn.send(("result", "detect", res))
    conn.send(("measured",))
    conn.send(("done",))


def _idle(rpc: Any, rank: int, world: int, cfg: dict[str, Any], conn: Any) -> None:
    """Call every other worker once, then stay idle until the orchestrator has measured."""
    conn.send(("phase", "links", cfg["phase_budget"]))
    for r in range(world):
        if r != rank:
            rpc.rpc_sync(f"w{r}", os.getpid)
    conn.send(("result", "links", {}))
    conn.send(("phase", "idle", cfg["idle_seconds"] + cfg["settle_idle"] + cfg["phase_budget"]))
    conn.send(("ready",))
    msg = conn.recv()
    if msg != ("go",):  # ("stop",): the orchestrator gave up on the group
        sys.stderr.flush()
        os._exit(0)
    conn.send(("result", "idle", {}))
    conn.send(("measured",))
    conn.send(("done",))


# ------------------------------------------------------------------------------------------------
# the start-up program (run by rpcdist-run / torchrun)
# ------------------------------------------------------------------------------------------------
def startup_program(system: str, outdir: str) -> None:
    """Join the group the launcher made, rank 0 calls the last rank once, all shut down."""
    t_start = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if system == "torch":
        import torch.distributed.rpc as rpc

        t_imported = time.monotonic()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)  # env://, TensorPipe defaults
    elif system == "rpcdist":
        import rpcdist.rpc as rpc

        t_imported = time.monotonic()
        rpc.init_rpc(f"worker{rank}")  # rank, world size and store from the environment
    else:
        raise ValueError(system)
    stamps = {"start": t_start, "imported": t_imported, "initialized": time.monotonic()}
    if rank == 0:
        callee = rpc.rpc_sync(f"worker{world - 1}", os.getpid)
        stamps["first_call"] = time.monotonic()
        stamps["callee_pid"] = callee
        _write(os.path.join(outdir, "rank0.json"), stamps)
    rpc.shutdown()
    stamps["shut_down"] = time.monotonic()
    _write(os.path.join(outdir, f"rank{rank}.done.json"), stamps)


def _write(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON, atomically (the orchestrator may read at any time)."""
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "startup":
        sys.exit(f"usage: {sys.argv[0]} startup <torch|rpcdist> <outdir>")
    startup_program(sys.argv[2], sys.argv[3])
