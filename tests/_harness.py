"""Multi-process harness of the RPC tests.

The test process starts real worker processes, each running one named *scenario* from
``rpc_scenarios`` as ``scenario(rank, world_size, init_method, **params)``. Every worker calls
``init_rpc``/``shutdown`` itself, on 127.0.0.1 with an ephemeral port. Inside a scenario, checks
are grouped with ``with check("name"):``; a failing check is recorded (with its traceback) and
the scenario goes on, so one process launch serves many tests.

Each worker writes one JSON result file (its scenario's return value, its checks, the Python
threads still alive after the scenario, or the error that ended it) and sends its stdout/stderr
to a log file. The test process waits for every worker with a deadline: stragglers get SIGUSR1
(faulthandler dumps every thread's stack into the log) and are then killed, so a hang fails the
test instead of hanging the run.

Processes are forked from a multiprocessing *forkserver* that has already imported torch,
numpy, grpc and rpcdist (importing torch costs several seconds on the test machine, once per
run instead of once per worker). Every worker is still a fresh process that joins the group on
its own. ``RPCDIST_TEST_START_METHOD=spawn`` starts every worker from scratch instead.

This module is imported by the test process and by the workers; it imports only the standard
library at module level so that the worker can set its environment before torch loads.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
TESTS_DIR = Path(__file__).resolve().parent
START_METHOD = os.environ.get("RPCDIST_TEST_START_METHOD", "forkserver")
# Keep every worker to one compute thread: the machine is small and shared.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LOG_TAIL_CHARS = 6000


# ============================================================================ worker side
@dataclass
class _CheckState:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


_CHECKS = _CheckState()


class check:  # noqa: N801 - used as a statement: ``with check("name"):``
    """Record the outcome of the block under ``name``; exceptions are recorded, not raised.

    Set ``.value`` inside the block to pass a JSON-able value back to the test process.
    """

    def __init__(self, name: str) -> None:
        if name in _CHECKS.results:
            raise ValueError(f"check {name!r} recorded twice")
        self.name = name
        self.value: Any = None
        self._start = 0.0

    def __enter__(self) -> check:
        self._start = time.monotonic()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        seconds = round(time.monotonic() - self._start, 3)
        if exc is None:
            _CHECKS.results[self.name] = {"ok": True, "value": self.value, "seconds": seconds}
            return False
        text = "".join(traceback.format_exception(exc))
        _CHECKS.results[self.name] = {"ok": False, "error": text, "seconds": seconds}
        print(f"check {self.name} FAILED:\n{text}", file=sys.stderr, flush=True)
        return isinstance(exc, Exception)


def _child_main(spec: dict[str, Any]) -> None:
    """Entry point of a worker process."""
    if spec["host"]:
        import _netns

        _netns.enter(spec["host"])
    log = open(spec["log_path"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(THREAD_ENV)
    os.environ.update(spec["env"])

    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    # A tensor rebuilt over read-only memory would warn here; make that a visible failure.
    warnings.filterwarnings("error", message=".*buffer is not writable.*")

    import rpc_scenarios

    result: dict[str, Any] = {
        "rank": spec["rank"],
        "scenario": spec["scenario"],
        "pid": os.getpid(),
        "startup_seconds": round(time.time() - spec["launched_at"], 3),  # launch to scenario start
    }
    exit_code = 0
    start = time.monotonic()
    try:
        fn = getattr(rpc_scenarios, spec["scenario"])
        args = (spec["rank"], spec["world_size"], spec["init_method"])
        if inspect.iscoroutinefunction(fn):
            import asyncio

            value = asyncio.run(fn(*args, **spec["params"]))
        else:
            value = fn(*args, **spec["params"])
        result.update(status="ok", value=value)
    except BaseException as exc:  # noqa: BLE001 - reported to the test process
        result.update(
            status="error",
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            error_message=str(exc),
            error_traceback="".join(traceback.format_exception(exc)),
        )
        print(result["error_traceback"], file=sys.stderr, flush=True)
        exit_code = 3
    result["seconds"] = round(time.monotonic() - start, 3)
    result["checks"] = _CHECKS.results
    # A scenario must leave RPC shut down; if it did not, say so and clean up for it.
    api = sys.modules.get("rpcdist.rpc.api")
    result["left_initialized"] = bool(api is not None and api._agent is not None)
    if result["left_initialized"]:
        with contextlib.suppress(Exception):
            api.shutdown(graceful=False)
    result["threads"] = [t.name for t in threading.enumerate()]
    # For diagnosis: threads that only go once unreachable objects are collected.
    import gc

    gc.collect()
    time.sleep(0.2)
    result["threads_after_gc"] = [t.name for t in threading.enumerate()]
    tmp = Path(spec["result_path"] + ".tmp")
    tmp.write_text(json.dumps(result, default=repr, indent=1))
    tmp.rename(spec["result_path"])
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_code:
        sys.exit(exit_code)


# ============================================================================ test-process side
def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out on its own (to outgoing connections, and to port 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_port_picks = random.Random()  # (its own state: a test that seeds the random module changes nothing)


def free_port() -> int:
    """A port that was free a moment ago, for a test to bind later (a rendezvous store's).

    It is picked at random below the kernel's ephemeral range: a port from that range can be
    given to any outgoing connection on the machine between this check and the bind (one
    was, in CI: both nodes of a launcher test found the store's port taken by a connection,
    so neither served it), while ports outside it are only ever taken by explicit binds."""
    low, _ = _ephemeral_range()
    first = 10000 if low > 11000 else 1024
    for _ in range(200):
        port = _port_picks.randrange(first, low)
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # (a crowded machine: what the kernel gives)
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is not None:
        return _context
    if START_METHOD != "forkserver":
        _context = multiprocessing.get_context(START_METHOD)
        return _context
    ctx = multiprocessing.get_context("forkserver")
    # Imported once by the fork server, so every worker starts with them loaded. (Python 3.11's
    # fork server ignores the sys.path it is sent: PYTHONPATH lets it find the test modules.)
    ctx.set_forkserver_preload(["torch", "numpy", "grpc", "rpcdist.rpc", "pytest", "rpc_scenarios"])
    from multiprocessing import forkserver

    server_env = dict(THREAD_ENV)
    server_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    saved = {key: os.environ.get(key) for key in server_env}
    os.environ.update(server_env)  # the fork server (and so every worker) inherits these
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _context = ctx
    return ctx


@dataclass
class ProcSpec:
    """One worker to start."""

    scenario: str
    rank: int
    world_size: int
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    host: str = ""  # a network namespace to run in (see ``_netns``); "" = this host


@dataclass
class ProcOutcome:
    spec: ProcSpec
    label: str
    exitcode: int | None
    killed: bool
    result: dict[str, Any] | None
    log: str
    exit_lag: float | None  # seconds from the result file appearing to the process exiting

    def log_tail(self) -> str:
        return self.log[-LOG_TAIL_CHARS:]


class InitMethod:
    """The init_method URL of one group and the environment its workers need."""

    def __init__(self, kind: str, workdir: Path, host: str = HOST) -> None:
        self.kind = kind
        self.port = free_port()
        self.env: dict[str, str] = {}
        if kind == "env":
            self.url = "env://"
            self.env = {"MASTER_ADDR": host, "MASTER_PORT": str(self.port)}
        elif kind == "tcp":
            self.url = f"tcp://{host}:{self.port}"
        elif kind == "file":
            self.url = f"file://{workdir / 'rendezvous.store'}"
        else:
            raise ValueError(kind)


class GroupRun:
    """The outcome of one launch of worker processes."""

    def __init__(self, outcomes: list[ProcOutcome], init: InitMethod, started_at: float) -> None:
        self.outcomes = outcomes
        self.init = init
        self.started_at = started_at  # wall clock before the first worker started

    # -- lookups ------------------------------------------------------------------------------
    def outcome(self, rank: int = 0, label: str | None = None) -> ProcOutcome:
        label = label if label is not None else f"rank{rank}"
        for out in self.outcomes:
            if out.label == label:
                return out
        raise KeyError(label)

    def describe(self, out: ProcOutcome) -> str:
        result = out.result or {}
        lines = [
            f"--- worker {out.label} (scenario {out.spec.scenario}, rank {out.spec.rank}): "
            f"exit code {out.exitcode}{' (killed after its deadline)' if out.killed else ''}"
        ]
        if out.result is None:
            lines.append("    no result file was written")
        elif result.get("status") == "error":
            lines.append(f"    scenario raised {result['error_type']}:\n{result['error_traceback']}")
        lines.append(f"    log tail:\n{out.log_tail()}")
        return "\n".join(lines)

    def report(self) -> str:
        return "\n".join(self.describe(out) for out in self.outcomes)

    def _finished(self, out: ProcOutcome) -> dict[str, Any]:
        if out.result is None or out.result.get("status") != "ok":
            raise AssertionError(f"worker {out.label} did not finish its scenario\n{self.report()}")
        return out.result

    # -- assertions ---------------------------------------------------------------------------
    def value(self, rank: int = 0, label: str | None = None) -> Any:
        """The scenario's return value (fails the test if the worker did not finish)."""
        return self._finished(self.outcome(rank, label))["value"]

    def check(self, name: str, rank: int = 0, label: str | None = None) -> Any:
        """Fail with the worker's traceback unless check ``name`` passed; returns its value."""
        out = self.outcome(rank, label)
        checks = (out.result or {}).get("checks", {})
        if name not in checks:
            raise AssertionError(
                f"check {name!r} was not recorded by worker {out.label} "
                f"(recorded: {sorted(checks)})\n{self.report()}"
            )
        entry = checks[name]
        if not entry["ok"]:
            raise AssertionError(f"check {name!r} failed on worker {out.label}:\n{entry['error']}")
        return entry["value"]

    def assert_no_shm_leftovers(self) -> None:
        """No shared-memory file of these workers is left in /dev/shm after they exited."""
        pids = {str(out.result["pid"]) for out in self.outcomes if out.result}
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            return
        ours = []
        for name in names:
            parts = name.split("-")  # rpcdist-<pid>-... and rpcdist-probe-<pid>-...
            if parts[0] == "rpcdist" and len(parts) > 2 and (parts[1] in pids or parts[2] in pids):
                # A pid is reused once the system wraps around: a file of a worker killed by
                # an earlier test (SIGKILL leaves its files) may carry one of these pids.
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(os.path.join("/dev/shm", name)).st_mtime >= self.started_at - 1.0:
                        ours.append(name)
        assert not ours, f"shared-memory files left behind by the workers: {sorted(ours)}"

    def assert_clean_exit(self, strict_threads: bool = False, exit_lag: float = 20.0) -> None:
        """Every worker finished its scenario, left RPC shut down and exited 0 soon after.

        Threads alive after the scenario: none of rpcdist's (named ``rpcdist...``) may be left;
        with ``strict_threads`` nothing but the main thread may be.
        """
        problems = []
        for out in self.outcomes:
            if out.killed or out.exitcode != 0:
                problems.append(f"worker {out.label}: exit code {out.exitcode}, killed={out.killed}")
                continue
            result = out.result or {}
            if result.get("status") != "ok":
                problems.append(f"worker {out.label}: no successful result")
                continue
            if result.get("left_initialized"):
                problems.append(f"worker {out.label}: scenario returned with RPC still initialized")
            leftover = [
                t
                for t in result["threads"]
                if t != "MainThread" and (strict_threads or t.startswith("rpcdist"))
            ]
            if leftover:
                after_gc = [t for t in result["threads_after_gc"] if t != "MainThread"]
                problems.append(
                    f"worker {out.label}: threads alive after shutdown: {leftover} "
                    f"(still alive after gc.collect(): {after_gc})"
                )
            if out.exit_lag is not None and out.exit_lag > exit_lag:
                problems.append(
                    f"worker {out.label}: exited {out.exit_lag:.1f} s after its scenario returned"
                )
        if problems:
            raise AssertionError("\n".join(problems) + "\n" + self.report())


class Launch:
    """Worker processes of one group, started together or in stages, waited for with deadlines."""

    def __init__(self, workdir: Path, init: str | InitMethod = "env", fail_grace: float = 15.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.init = init if isinstance(init, InitMethod) else InitMethod(init, workdir)
        self.fail_grace = fail_grace
        self._running: list[tuple[ProcSpec, str, Any, dict[str, Any]]] = []
        self._result_seen: dict[str, float] = {}
        self._exited: dict[str, float] = {}
        self._killed: set[str] = set()
        self._started_at = time.time()

    def start(self, spec: ProcSpec) -> str:
        """Start one worker; returns its label."""
        label = spec.label or f"rank{spec.rank}"
        if any(label == other for _, other, _, _ in self._running):
            raise ValueError(f"two workers labelled {label!r}: give workers of the same rank labels")
        child = {
            "scenario": spec.scenario,
            "rank": spec.rank,
            "world_size": spec.world_size,
            "init_method": self.init.url,
            "env": self.init.env,
            "params": {"workdir": str(self.workdir), **spec.params},
            "log_path": str(self.workdir / f"{label}.log"),
            "result_path": str(self.workdir / f"{label}.json"),
            "launched_at": time.time(),
            "host": spec.host,
        }
        process = _mp_context().Process(target=_child_main, args=(child,), name=f"rpc-test-{label}")
        process.start()
        self._running.append((spec, label, process, child))
        return label

    def wait(self, labels: list[str] | None = None, timeout: float = 120.0) -> bool:
        """Wait until the labelled workers (default: all) exited; past ``timeout``, kill every
        worker still running (after a stack dump into its log) and return False.

        When a worker exits non-zero, the others get only ``fail_grace`` more seconds, since
        they are probably waiting for it.
        """
        wanted = {label for _, label, _, _ in self._running} if labels is None else set(labels)
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            for _, label, process, child in self._running:
                if label not in self._result_seen and os.path.exists(child["result_path"]):
                    self._result_seen[label] = now
                if label not in self._exited and process.exitcode is not None:
                    self._exited[label] = now
                    if process.exitcode != 0:
                        deadline = min(deadline, now + self.fail_grace)
            if wanted <= self._exited.keys():
                return True
            if now > deadline:
                self.kill_all()
                return False
            alive = [p.sentinel for _, label, p, _ in self._running if label not in self._exited]
            multiprocessing.connection.wait(alive, 0.05)

    def kill_all(self) -> None:
        alive = [(label, p) for _, label, p, _ in self._running if p.exitcode is None]
        for label, process in alive:
            self._killed.add(label)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGUSR1)  # faulthandler: every thread's stack, into the log
        if alive:
            time.sleep(1.0)
        for label, process in alive:
            if process.exitcode is None:
                process.kill()
            process.join(10)
            self._exited.setdefault(label, time.monotonic())

    def finish(self, timeout: float = 120.0) -> GroupRun:
        """Wait for every worker (see :meth:`wait`) and collect the outcomes."""
        self.wait(None, timeout)
        outcomes = []
        for spec, label, process, child in self._running:
            process.join(5)
            result_path = Path(child["result_path"])
            result = json.loads(result_path.read_text()) if result_path.exists() else None
            log_path = Path(child["log_path"])
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            seen, exited = self._result_seen.get(label), self._exited.get(label)
            lag = exited - seen if seen is not None and exited is not None else None
            killed = label in self._killed
            outcomes.append(ProcOutcome(spec, label, process.exitcode, killed, result, log, lag))
            process.close()
        return GroupRun(outcomes, self.init, self._started_at)


def run_processes(
    workdir: Path, specs: list[ProcSpec], init: str | InitMethod = "env", *, timeout: float = 120.0
) -> GroupRun:
    """Start one worker per spec and wait for all of them (at most ``timeout`` s)."""
    launch = Launch(workdir, init)
    for spec in specs:
        launch.start(spec)
    return launch.finish(timeout)


class ImportFirst:
    """A scenario parameter whose unpickling (in the worker, before the scenario runs) imports
    ``module``, which registers its scenarios on ``rpc_scenarios`` where the worker looks."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        import importlib

        return importlib.import_module, (self.module,)


def run_group(
    workdir: Path,
    scenario: str,
    world_size: int,
    init: str = "env",
    *,
    params: dict[str, Any] | None = None,
    rank_params: dict[int, dict[str, Any]] | None = None,
    timeout: float = 120.0,
) -> GroupRun:
    """Run ``scenario`` on ranks ``0..world_size-1`` (``rank_params`` adds per-rank params)."""
    specs = [
        ProcSpec(scenario, rank, world_size, {**(params or {}), **(rank_params or {}).get(rank, {})})
        for rank in range(world_size)
    ]
    return run_processes(workdir, specs, init, timeout=timeout)
