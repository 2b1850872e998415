"""What every benchmark process shares: the low-level harness around the measurements.

Orchestrator side: progress logging (``set_name``, ``log``), free ports, process start and reaping
(``start``, ``reap``, ``reap_all``), the forkserver, stack dumps of hung children, machine load
(``load_snapshot``, ``load_delta``, ``foreign_load``, ``load_cores``) and speed (``machine_probe``),
percentiles, the common CLI flags and ``run_main``, run metadata, table and per-round text
helpers, and the JSON file. ``_driver.py`` builds the one benchmark driver on these.
Child side: ``child_setup`` (die with the orchestrator, stderr only, stack dumps on SIGUSR1),
``stats_ns``, ``injected`` (failure injection for the harness's own tests), ``wait_for_stop``
and ``nothing``.

Only the standard library is imported at module level: every benchmark process imports this.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
KiB = 1 << 10
T0 = time.monotonic()
_NAME = "bench"
_LIVE: list[Any] = []  # every process started and not yet reaped
_forkserver: Any = None


# ------------------------------------------------------------------------------------------------
# logging
# ------------------------------------------------------------------------------------------------
def set_name(name: str) -> None:
    """The tag ``log`` puts in front of every progress line."""
    global _NAME
    _NAME = name


def log(msg: str) -> None:
    print(f"[{_NAME} {time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver(preload: list[str]) -> Any:
    """A forkserver context that has imported ``preload`` once (nothing else: no thread, no
    gRPC state), which saves every child several seconds of ``import torch``."""
    global _forkserver
    if _forkserver is None:
        _forkserver = mp.get_context("forkserver")
        _forkserver.set_forkserver_preload(preload)
    return _forkserver


def start(ctx: Any, name: str, target: Any, args: tuple[Any, ...]) -> Any:
    p = ctx.Process(target=target, args=args, name=name, daemon=True)
    p.start()
    _LIVE.append(p)
    return p


def reap(procs: list[Any], grace: float) -> None:
    """Join every process; terminate, then kill, whatever is still alive after ``grace`` s."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log(f"  {p.name} (pid {p.pid}) still alive: terminating")
            p.terminate()
            p.join(5)
        if p.is_alive():
            log(f"  {p.name} (pid {p.pid}) ignored SIGTERM: killing")
            p.kill()
            p.join(5)
        if p in _LIVE:
            _LIVE.remove(p)


def reap_all() -> None:
    if _LIVE:
        reap(list(_LIVE), 0.0)


def dump_stacks(procs: list[Any], stack_files: dict[str, str]) -> str:
    """SIGUSR1 every live process of ``procs`` (faulthandler writes all threads' stacks), then
    read ``stack_files`` (label -> path)."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(1.5)
    parts = []
    for label, path in stack_files.items():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        parts.append(f"--- {label} stacks ---\n{text or '(none written)'}")
    return "\n".join(parts)


def child_setup(stack_file: str | None, lifeline: Any, tag: str) -> Any:
    """In a child: die with the orchestrator, make the benchmark modules importable, send
    stdout to stderr, arm stack dumps. Returns the stack file, which must stay open.

    ``lifeline`` is the read end of a pipe only the orchestrator writes to: when it dies (even
    by SIGKILL) the pipe reports EOF and this process exits. PR_SET_PDEATHSIG alone is not
    enough: a forkserver child's parent is the forkserver, which outlives the orchestrator as
    long as any of its children do.
    """
    import threading

    def watch() -> None:
        try:
            lifeline.recv()  # blocks without CPU; nothing is ever sent
        except (EOFError, OSError):
            pass
        os._exit(70)

    threading.Thread(target=watch, name=f"{tag}-lifeline", daemon=True).start()
    try:  # PR_SET_PDEATHSIG: a SIGKILLed orchestrator must not leave orphans burning CPU
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        if os.getppid() == 1:  # the parent already died before prctl took effect
            os._exit(3)
    except Exception:
        pass
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    # The orchestrator's stdout carries only the table: children write to stderr.
    sys.stdout.flush()
    os.dup2(2, 1)
    import logging
    import warnings

    logging.basicConfig(
        level=logging.WARNING, format=f"[pid {os.getpid()}] %(levelname)s %(name)s: %(message)s"
    )
    warnings.filterwarnings("ignore", category=UserWarning)
    handle = None
    if stack_file:
        import faulthandler

        handle = open(stack_file, "w")  # noqa: SIM115 - must stay open for the process's life
        faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return handle


def nothing() -> None:
    """A process that only starts (warms the forkserver up)."""


def wait_for_stop(conn: Any) -> None:
    """In a child, after a failure: stay alive (so stacks and the peers' errors can be collected)
    until the orchestrator stops the group, then exit."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def injected(var: str, system: str, phase: str, rank: int, default_rank: int) -> bool:
    """Whether ``$var`` (``system:phase[:rank],...``) asks this rank to fail / hang in ``phase``."""
    for item in filter(None, os.environ.get(var, "").split(",")):
        parts = item.split(":")
        if len(parts) >= 2 and parts[0] == system and parts[1] == phase:
            if (int(parts[2]) if len(parts) > 2 else default_rank) == rank:
                return True
    return False


# ------------------------------------------------------------------------------------------------
# machine load and speed
# ------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2 :].split()  # fields[0] is "state" (field 3)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sched_seconds(pid: int) -> float:
    """Run time of all live threads of a process in ns precision (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def machine_cpu() -> tuple[float, float]:
    """Seconds of CPU the whole machine spent busy, and stolen by the hypervisor (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    tck = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tck, steal / tck


def load_snapshot(pids: Iterable[int]) -> dict[str, float]:
    """Machine-wide busy/steal CPU and the CPU of this process and of the processes ``pids``."""
    busy, steal = machine_cpu()
    ours = sum(os.times()[:2])
    for pid in pids:
        try:
            ours += cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            pass
    return {"t": time.monotonic(), "busy": busy, "steal": steal, "ours": ours}


def load_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """CPU seconds used by other work on the machine (not this benchmark), stolen by the
    hypervisor, and used by this benchmark between two snapshots, and the wall time."""
    return {
        "foreign_core_s": max(0.0, (b["busy"] - a["busy"]) - (b["ours"] - a["ours"])),
        "steal_core_s": b["steal"] - a["steal"],
        "ours_core_s": b["ours"] - a["ours"],
        "seconds": max(1e-9, b["t"] - a["t"]),
    }


def foreign_load(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Cores used by other work on the machine (not this benchmark) between two snapshots."""
    d = load_delta(a, b)
    wall = d["seconds"]
    return {
        "foreign_cores": d["foreign_core_s"] / wall,
        "steal_cores": d["steal_core_s"] / wall,
        "ours_cores": d["ours_core_s"] / wall,
        "seconds": wall,
    }


def load_cores(load: dict[str, float] | None) -> dict[str, float] | None:
    """A round's load in cores, from either ``foreign_load`` or ``load_delta`` numbers."""
    if not load or "foreign_cores" in load:
        return load
    wall = load["seconds"]
    return {"foreign_cores": load["foreign_core_s"] / wall, "steal_cores": load["steal_core_s"] / wall}


def load_text(load: dict[str, float] | None) -> str:
    load = load_cores(load) or {}
    return (
        f"{load.get('foreign_cores', float('nan')):.2f} cores, "
        f"steal {load.get('steal_cores', float('nan')):.2f}"
    )


def machine_probe() -> dict[str, float]:
    """How fast this machine is right now (to compare with the baselines' machine)."""
    import numpy as np

    a = np.ones(16 << 20, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    loop = min(_timed(lambda: sum(range(1_000_000))) for _ in range(3))
    return {"memcpy_GBps": a.nbytes / best / 1e9, "py_Mloops_per_s": 1.0 / loop}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# numbers
# ------------------------------------------------------------------------------------------------
def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    """Per-call times (ns) -> median / p10 / p90 in µs."""
    s = sorted(samples_ns)
    n = len(s)

    def pct(p: float) -> float:
        return s[min(n - 1, int(p * n))] / 1e3

    return {"median_us": statistics.median(s) / 1e3, "p10_us": pct(0.10), "p90_us": pct(0.90)}


def stats_ns(samples_ns: list[int]) -> dict[str, float]:
    """Per-call times (ns) -> median / p10 / p90 / mean in µs, and the count."""
    n = len(samples_ns)
    return {**percentiles_us(samples_ns), "mean_us": sum(samples_ns) / n / 1e3, "n": n}


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` (an exception's message in a traceback)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def problem(err: str) -> str:
    """Why a round has no number for a phase, from the phase's error text."""
    if err.startswith("HANG"):
        return "HANG"
    if err.startswith("skipped"):
        return "SKIP"
    if err.startswith("LOST") or not err:
        return "LOST"
    return "ERR"


# ------------------------------------------------------------------------------------------------
# command line and run metadata
# ------------------------------------------------------------------------------------------------
def add_common_args(
    ap: argparse.ArgumentParser, quick_help: str, repeats_help: str, systems: Iterable[str], systems_help: str
) -> None:
    """--quick, --repeats, --json and --systems."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--repeats", type=int, default=None, help=repeats_help)
    ap.add_argument("--json", metavar="PATH", help="write all per-round numbers and failures here")
    ap.add_argument("--systems", default=",".join(systems), help=systems_help)


def repeats_and_systems(
    ap: argparse.ArgumentParser, args: argparse.Namespace, known: Iterable[str]
) -> tuple[int, list[str]]:
    """Rounds per system (default 5; 1 with --quick) and the systems asked for."""
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(known)
    if unknown:
        ap.error(f"unknown systems: {sorted(unknown)}")
    return repeats, systems


def run_main(main: Any) -> None:
    """Exit with ``main()``'s code; whatever happens, no child outlives the run."""
    try:
        sys.exit(main())
    finally:
        reap_all()


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so ``finally`` blocks reap the children."""

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)


def start_meta(
    args: argparse.Namespace, repeats: int, cfg: dict[str, Any], systems: list[str], packages: list[str]
) -> dict[str, Any]:
    """The run's settings, versions of ``packages`` and the machine at the start."""
    from importlib.metadata import version

    meta: dict[str, Any] = {
        "quick": args.quick,
        "repeats": repeats,
        "cfg": cfg,
        "systems": systems,
        "python": platform.python_version(),
    }
    meta.update({pkg: version(pkg) for pkg in packages})
    meta.update(cpus=os.cpu_count(), loadavg_start=os.getloadavg(), probe_start=machine_probe())
    return meta


def end_meta(meta: dict[str, Any]) -> None:
    meta["probe_end"] = machine_probe()
    meta["seconds"] = time.monotonic() - T0
    meta["loadavg_end"] = os.getloadavg()


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    log(f"wrote {path}")


# ------------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------------
def table_lines(header: list[str], table: list[list[str]], right: set[int]) -> list[str]:
    """Header, dashes and rows, columns padded to their widest cell (``right``: right-aligned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table, strict=True)]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in pairs).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in table]


def round_values(system: str, texts: list[str], problems: list[str]) -> str:
    """``system: v1 v2 ... [problems]``: one system's per-round values."""
    txt = " ".join(texts) or "-"
    if problems:
        txt += f" [{', '.join(problems)}]"
    return f"{system}: {txt}"


def round_loads(rounds: list[dict[str, Any]]) -> list[str]:
    """Other load while measuring (cores) of each round, '?' where unknown."""
    loads = [load_cores(r.get("load")) for r in rounds]
    return [f"{load['foreign_cores']:.2f}" if load else "?" for load in loads]


def machine_line(meta: dict[str, Any], packages: list[str]) -> str:
    p0, p1 = meta["probe_start"], meta["probe_end"]
    versions = "".join(f", {pkg} {meta[pkg]}" for pkg in packages)
    return (
        f"machine: {meta['cpus']} CPUs, python {meta['python']}{versions}; "
        f"memcpy {p0['memcpy_GBps']:.1f} / {p1['memcpy_GBps']:.1f} GB/s and "
        f"{p0['py_Mloops_per_s']:.1f} / {p1['py_Mloops_per_s']:.1f} M python loop iterations/s "
        f"(start / end); loadavg {meta['loadavg_start'][0]:.2f} / {meta['loadavg_end'][0]:.2f}"
    )
