"""One group of benchmark processes: start them, follow their phases, catch failures and hangs, reap.

``launched`` runs a round's body with a ``Launch``: the processes' stack-dump files in a
temporary directory, the lifeline pipe (only the orchestrator holds its write end, so every
child exits when the orchestrator dies, even by SIGKILL), the orchestrator's own errors, and
bounded reaping (terminate, then kill) whatever happens.

``run_ranks`` starts ``world`` ranks that each report to the orchestrator over their own pipe:

    rank -> orchestrator   ("phase", name, budget_s)    a phase starts (hang deadline)
                           ("result", name, {...})      its numbers
                           ("error", name, traceback)   it raised; the rank waits to be stopped
                           ("measured",)                all phases done, shutting down
                           ("done",)                    shut down cleanly
                           anything else                ``Follower.on_message`` (e.g. "ready")
    orchestrator -> rank   ("stop",)                    give up (another rank failed)

and follows them with a ``Follower`` until every rank is done, one fails (then the others get
``error_grace`` seconds to report; the ones still silent have their stacks dumped), one dies, or
one overruns its phase's budget (a HANG: every rank's stacks). Scenarios subclass ``Follower``
for what a result means and which phase a hang is charged to.

Only the standard library is imported at module level: every benchmark process may import this.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import _harness as H
from _harness import log


class Launch:
    """A round's processes, their stack files (label -> path) and the lifeline they share."""

    def __init__(self, ctx: Any, prefix: str, labels: list[str]) -> None:
        self.ctx = ctx
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.stack_files = {
            label: os.path.join(self._tmp.name, f"stacks{i}.txt") for i, label in enumerate(labels)
        }
        self.life_r, self.life_w = ctx.Pipe(duplex=False)
        self.procs: list[Any] = []
        self.conns: list[Any] = []  # orchestrator ends, told ("stop",) at the end

    def start(self, name: str, target: Any, args: tuple[Any, ...]) -> Any:
        p = H.start(self.ctx, name, target, args)
        self.procs.append(p)
        return p

    def pipe(self) -> tuple[Any, Any]:
        """A pipe to one rank: (the orchestrator's end, the rank's end)."""
        parent, child = self.ctx.Pipe()
        self.conns.append(parent)
        return parent, child

    def close(self, grace: float) -> dict[str, int | None]:
        """Stop waiting ranks, reap every process within ``grace`` s; returns the exit codes."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        H.reap(self.procs, grace)
        codes = {p.name: p.exitcode for p in self.procs}
        for c in self.conns:
            c.close()
        self.life_r.close()
        self.life_w.close()
        self._tmp.cleanup()
        return codes


def launched(
    ctx: Any, prefix: str, labels: list[str], out: dict[str, Any], body: Callable[[Launch], None]
) -> None:
    """Run ``body`` with a fresh ``Launch``; record an orchestrator error in ``out``; always reap.

    After a clean end (``out["clean"]``) the processes are just finishing their own shutdown:
    they get 30 s, otherwise 3 s."""
    launch = Launch(ctx, prefix, labels)
    try:
        body(launch)
    except BaseException as exc:
        out["errors"].setdefault("orchestrator", traceback.format_exc())
        out["summaries"].setdefault("orchestrator", f"{type(exc).__name__}: {exc}")
        out["stop"] = out.get("stop") or "orchestrator"
        if not isinstance(exc, Exception):
            raise
    finally:
        out["exitcodes"] = launch.close(30.0 if out.get("clean") else 3.0)


class Follower:
    """Follows every rank of one group; ``out`` collects results, errors, summaries and the load.

    Override ``on_result`` (what a rank's result means), ``next_phase`` (where a rank is after a
    result), ``hang_phase`` (which phase a hang is charged to), and optionally ``on_message``,
    ``settled`` and ``measures_load``."""

    def __init__(self, tag: str, cfg: dict[str, Any], labels: list[str]) -> None:
        self.tag, self.cfg, self.labels = tag, cfg, labels
        self.world = len(labels)
        self.out: dict[str, Any] = {
            "results": {},
            "errors": {},  # phase -> every failing rank's traceback (stacks for a hang)
            "summaries": {},  # phase -> one line per failing rank
            "stop": None,  # the phase that failed or hung (None: the group ran to the end)
            "hung": None,
            "clean": False,
            "load": None,
        }
        self.reports: dict[str, dict[int, Any]] = {}  # phase -> rank -> result
        self.errors: dict[str, dict[int, str]] = {}  # phase -> rank -> traceback
        self.first_start: dict[str, float] = {}  # phase -> when its first rank started it
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        now = time.monotonic()
        self.where = ["init"] * self.world  # each rank's current phase
        self.started = [now] * self.world
        self.done = [False] * self.world
        self.gone = [False] * self.world

    # ---- hooks ---------------------------------------------------------------------------------
    def on_result(self, rank: int, phase: str, result: Any, now: float) -> None:
        """A rank finished ``phase`` (already in ``self.reports``)."""

    def next_phase(self, phase: str) -> str:
        return f"after {phase}"

    def hang_phase(self, late: list[int]) -> str:
        return self.where[late[0]]

    def on_message(self, rank: int, msg: tuple[Any, ...]) -> None:
        """A message other than the standard ones."""

    def settled(self, rank: int, phase: str) -> bool:
        """Whether ``rank`` has nothing more to say after the first failure (in ``phase``)."""
        r = rank
        return self.gone[r] or self.done[r] or any(r in e for e in self.errors.values())

    def measures_load(self, rank: int) -> bool:
        """Whether ``rank``'s "measured" ends the load window (default: the last rank's does)."""
        return True

    # ---- the loop ------------------------------------------------------------------------------
    def finish(self, stop: str | None) -> None:
        self.out["stop"] = stop
        for phase, per_rank in self.errors.items():
            ranks = sorted(per_rank.items())
            self.out["errors"][phase] = "\n".join(f"{self.labels[r]}: {tb.rstrip()}" for r, tb in ranks)
            self.out["summaries"][phase] = "; ".join(
                f"{self.labels[r]}: {H.last_line(tb)}" for r, tb in ranks
            )

    def follow(self, launch: Launch) -> None:
        """Until all ranks are done, one fails (plus a grace period for the others to report),
        one dies, or one overruns its phase's budget."""
        cfg, out, world, labels = self.cfg, self.out, self.world, self.labels
        procs, self.procs, self.conns = launch.procs, launch.procs, launch.conns
        conns = {c: r for r, c in enumerate(launch.conns)}
        where, started, done, gone, errors = self.where, self.started, self.done, self.gone, self.errors
        deadline = [time.monotonic() + cfg["init_budget"]] * world
        failed_at: tuple[str, float] | None = None
        load_start: dict[str, float] | None = None
        pids = [p.pid for p in procs]
        while True:
            for c in mpc.wait([c for c, r in conns.items() if not gone[r]], timeout=0.2):
                rank = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    gone[rank] = True
                    if not done[rank]:
                        errors.setdefault(where[rank], {}).setdefault(
                            rank,
                            f"the process went away during phase {where[rank]!r} "
                            f"(exit code {procs[rank].exitcode})",
                        )
                        failed_at = failed_at or (where[rank], time.monotonic())
                    continue
                kind, now = msg[0], time.monotonic()
                if kind == "phase":
                    where[rank], deadline[rank], started[rank] = msg[1], now + msg[2], now
                    self.first_start.setdefault(msg[1], now)
                    if load_start is None and msg[1] not in ("init", "shutdown"):
                        load_start = H.load_snapshot(pids)
                elif kind == "result":
                    self.reports.setdefault(msg[1], {})[rank] = msg[2]
                    self.on_result(rank, msg[1], msg[2], now)
                    # the gap up to the rank's next phase is bounded too
                    where[rank], deadline[rank], started[rank] = (
                        self.next_phase(msg[1]),
                        now + cfg["phase_budget"],
                        now,
                    )
                elif kind == "error":
                    errors.setdefault(msg[1], {})[rank] = msg[2]
                    where[rank] = msg[1]
                    log(f"  {self.tag} {msg[1]:20s} FAILED on {labels[rank]}: {H.last_line(msg[2])}")
                    failed_at = failed_at or (msg[1], now)
                elif kind == "measured":
                    if load_start is not None and self.measures_load(rank):
                        out["load"] = H.load_delta(load_start, H.load_snapshot(pids))
                elif kind == "done":
                    done[rank] = True
                else:
                    self.on_message(rank, msg)

            now = time.monotonic()
            if all(done):
                out["clean"] = True
                self.finish(None)
                return
            if failed_at is not None:
                phase, t_fail = failed_at
                silent = [r for r in range(world) if not self.settled(r, phase)]
                if silent and now <= t_fail + cfg["error_grace"]:
                    continue
                self.finish(phase)  # the caller decides what runs next
                if silent:  # ranks still inside the failed phase: show where they wait
                    waiting = ", ".join(f"{labels[r]} in {where[r]!r}" for r in silent)
                    stacks = H.dump_stacks(
                        [procs[r] for r in silent], {labels[r]: launch.stack_files[labels[r]] for r in silent}
                    )
                    out["errors"][phase] += (
                        f"\nstill running {cfg['error_grace']:g} s after the first error: {waiting}\n{stacks}"
                    )
                return
            late = [r for r in range(world) if not done[r] and not gone[r] and now > deadline[r]]
            if late:
                stuck = self.hang_phase(late)
                stacks = H.dump_stacks(procs, launch.stack_files)
                waiting = ", ".join(
                    f"{labels[r]} in {where[r]!r} for {now - started[r]:.0f} s" for r in range(world)
                )
                self.finish(stuck)
                text = f"HANG: phase {stuck!r} did not finish within its budget ({waiting})\n{stacks}"
                out["errors"][stuck] = text + (
                    "\n" + out["errors"][stuck] if out["errors"].get(stuck) else ""
                )
                out["summaries"][stuck] = text.splitlines()[0]
                out["hung"] = stuck
                log(f"  {self.tag} HANG in phase {stuck!r} ({waiting}); stacks:\n{stacks}")
                return
            dead = [r for r in range(world) if not done[r] and procs[r].exitcode not in (None, 0)]
            if dead:  # record it, and give the others error_grace to report what they saw
                for r in dead:
                    errors.setdefault(where[r], {}).setdefault(
                        r, f"the process died during phase {where[r]!r} (exit code {procs[r].exitcode})"
                    )
                failed_at = (where[dead[0]], now)


def run_ranks(
    ctx: Any,
    prefix: str,
    names: list[str],
    target: Any,
    args_of: Callable[[int, str, Any, str, Any], tuple[Any, ...]],
    follower: Follower,
) -> dict[str, Any]:
    """Start one process per rank (process ``names[rank]``) running
    ``target(*args_of(rank, init_method, conn, stack_file, lifeline))``, follow them with
    ``follower`` and reap them; returns ``follower.out`` (with the exit codes)."""
    out = follower.out

    def body(launch: Launch) -> None:
        init = f"tcp://127.0.0.1:{H.free_port()}"
        for rank, name in enumerate(names):
            _, child = launch.pipe()
            stack_file = launch.stack_files[follower.labels[rank]]
            launch.start(name, target, args_of(rank, init, child, stack_file, launch.life_r))
            child.close()
        out["pids"] = [p.pid for p in launch.procs]
        follower.follow(launch)

    launched(ctx, prefix, follower.labels, out, body)
    return out
