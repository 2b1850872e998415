"""rpcdist-run: start a program's worker processes on this node, torchrun-style.

Usage (also ``python -m rpcdist.run``)::

    rpcdist-run --standalone --nproc-per-node 4 train.py --epochs 3
    rpcdist-run --nnodes 2 --nproc-per-node 2 --rdzv-endpoint node0:29400 --rdzv-id job7 train.py
    rpcdist-run --nproc-per-node 2 -m mypkg.train

Every worker gets torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS`` (and ``RPCDIST_LAUNCHED=1``), so
``rpcdist.init_process_group()`` and ``rpcdist.rpc.init_rpc(name)`` need no other argument.

The store the workers meet through
----------------------------------
``MASTER_ADDR:MASTER_PORT`` is an rpcdist store (gRPC) that the launcher itself serves, a new
one (on a fresh port) for every restart round; ``RPCDIST_AGENT_STORE=1`` tells rpcdist's
``env://`` init to connect to it (rank 0 embeds none). So the store is bound before any worker
starts (no race for a port), it outlives every worker (rank 0 may finish or fail first), and a
restarted group meets on an empty store. ``--master-port`` (single node) pins that port instead. The catch: a
program that initialises through torch's own ``env://`` (``torch.distributed.init_process_group``
with gloo, or with the ``"rpcdist"`` backend) expects a TCPStore there: start such programs with
``torchrun``, or init them with rpcdist.

Several nodes
-------------
The launchers agree on node ranks through a rendezvous store at ``--rdzv-endpoint`` (torchrun's
default port 29400; without it, ``--master-addr:--master-port`` as torchrun's static
rendezvous). The node given ``--node-rank 0``, or else the one whose own address is the
endpoint's host, serves it (``--rdzv-conf is_host=1`` forces it); the others connect (so does
a node whose machine already has another launcher serving the endpoint). Nodes without
``--node-rank`` get the free node ranks, the hosting node first (it normally joins first
anyway: the others wait for its store), then in the order they joined. ``--nnodes MIN:MAX``
starts once MIN nodes joined, after a last-call window (``--rdzv-conf last_call_timeout=S``,
default 30 s) for more, up to MAX. ``--rdzv-conf join_timeout=S`` (default 600 s) bounds the
wait for nodes. The node hosting the rendezvous also serves the workers' store, and keeps it
until every node's workers are done.

With ``--rdzv-backend etcd --rdzv-endpoint h1:2379[,h2:2379,...]`` the launchers meet on etcd
instead (keys under ``rpcdist-run/<run id>``, see :class:`~rpcdist.store.etcd_store.EtcdStore`):
no node serves the rendezvous, so it survives the loss of any etcd member; the first launcher
to claim it leads the rounds and serves the workers' store.

Nodes that come and go (``--nnodes MIN:MAX``, MIN < MAX)
--------------------------------------------------------
The group re-forms, as torchrun's does, in a new round (every worker stopped and started again
with the new ``WORLD_SIZE``, ranks and store) when: a node arrives while the group has fewer
than MAX nodes (it waits for that next round); a node leaves on a signal (SIGINT/SIGTERM/...:
the others go on without it); or a node vanishes (its launcher killed, its host gone): every
node bumps a counter in the rendezvous store each ``keep_alive_interval`` s (default 5), and
one whose counter stands still for ``keep_alive_max_attempt`` (3) intervals is left out.
None of these is a failure: ``TORCHELASTIC_RESTART_COUNT`` stays and no restart is used. A
re-formed round ends its last call as soon as every node of the previous group that did not
leave is back. The node that hosts the rendezvous cannot leave without ending the run (its
store goes with it).

Failures, restarts, signals
---------------------------
When a worker fails, the launcher stops the rest of its node's group (SIGTERM, then SIGKILL
after ``--term-timeout`` s) and tells the other nodes, which stop theirs; with restarts left
(``--max-restarts``), every node starts its group again in a new round
(``TORCHELASTIC_RESTART_COUNT`` one higher, a new ``MASTER_PORT``), unless a node's workers
had all succeeded in that round already (it is gone). Otherwise it reports the
failing rank, its exit code or signal and the tail of its stderr (its traceback), and exits
with its status (128+N for signal N). Each worker's stderr goes to the launcher's stderr,
each line prefixed with ``[rankN]:``, and to ``attempt_<restart>/rank<N>.stderr.log`` in the
run's log directory (``<log-dir>/<run id>_*``, or a temporary directory, removed when the run
succeeds); stdout is passed through as is.

SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to every worker's process group; the launcher
waits for the workers (a second signal kills them at once) and exits with their status (the
first non-zero one, by rank; 128+N for a worker killed by signal N). No worker outlives the
launcher: each gets SIGKILL from the kernel if the launcher dies, even by SIGKILL
(``PR_SET_PDEATHSIG``). Each runs in a process group of its own, which the launcher kills
whole at the end of every round, so what a worker started goes too; only when the launcher
itself is SIGKILLed must a worker's own children die with it by their own means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcdist import _launch_env, security
from rpcdist.errors import RpcdistError, StoreError, StoreTimeoutError
from rpcdist.rendezvous import is_loopback, local_address_towards
from rpcdist.security import Security
from rpcdist.store import EtcdStore, GrpcStore, HashStore, PrefixStore, Store, StoreServer
from rpcdist.store.etcd_store import parse_endpoints

log = logging.getLogger("rpcdist.run")

__all__ = ["LaunchConfig", "LaunchError", "main", "parse_args", "config_from_args", "worker_env"]

DEFAULT_RDZV_PORT = 29400  # torchrun's, for an --rdzv-endpoint without a port
DEFAULT_MASTER_PORT = 29500
EXIT_BARRIER_TIMEOUT = 300.0  # how long the hosting node waits for the other nodes to finish
WATCH_CONNECT_TIMEOUT = 10.0  # a rendezvous store gone silent this long while workers run is lost
TAIL_LINES = 200
TRACEBACK_LINES = 40
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
RDZV_CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "is_host",
)


class LaunchError(RpcdistError):
    """The launcher cannot start or keep the run going (bad arguments, rendezvous failed)."""


# ============================================================================ configuration
@dataclass(frozen=True)
class LaunchConfig:
    """Everything one launcher needs, from the command line (see :func:`config_from_args`)."""

    command: list[str]
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = DEFAULT_RDZV_PORT
    run_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    log_dir: Path | None = None
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    is_host: bool | None = None
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    term_timeout: float = 30.0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # The run's token and TLS files: the launcher's stores require them, the workers get them.
    security: Security = field(default_factory=Security)
    etcd_endpoints: str = ""  # --rdzv-backend etcd: the members, comma-separated

    @property
    def single_node(self) -> bool:
        """Whether the run has one node only (no rendezvous with other launchers)."""
        return self.max_nodes == 1

    @property
    def elastic(self) -> bool:
        """Whether the group may grow and shrink between rounds (``--nnodes MIN:MAX``, MIN < MAX)."""
        return self.min_nodes < self.max_nodes

    @property
    def rdzv_endpoint(self) -> str:
        return self.etcd_endpoints or f"{self.rdzv_host}:{self.rdzv_port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rpcdist-run",
        description="Start a program's worker processes with torchrun's environment (see rpcdist.run).",
        allow_abbrev=False,
    )

    def option(name: str, *more: str, **kwargs: Any) -> None:
        spellings = [name, *more]
        if name.startswith("--") and "-" in name[2:]:
            spellings.append("--" + name[2:].replace("-", "_"))  # torchrun's --nproc_per_node too
        parser.add_argument(*spellings, **kwargs)

    option("--nnodes", default="1:1", help="N, or MIN:MAX nodes (default 1)")
    option("--nproc-per-node", default="1", help="workers on this node: a number, or 'cpu'/'auto'")
    option("--node-rank", type=int, default=None, help="this node's rank (default: in the order nodes join)")
    option("--rdzv-endpoint", default="", help=f"HOST[:PORT] of the rendezvous (port {DEFAULT_RDZV_PORT})")
    option("--rdzv-id", default=None, help="the run's id, the same on every node (TORCHELASTIC_RUN_ID)")
    option(
        "--rdzv-backend",
        default="rpcdist",
        choices=["rpcdist", "c10d", "static", "etcd"],
        help="etcd: meet on the etcd at --rdzv-endpoint H:P[,H:P...]; the others (torchrun's names) "
        "meet through rpcdist's store",
    )
    option(
        "--rdzv-conf",
        default="",
        help="join_timeout=S,last_call_timeout=S,keep_alive_interval=S,keep_alive_max_attempt=N,is_host=0|1",
    )
    option("--standalone", action="store_true", help="a single node, on free local ports")
    option("--max-restarts", type=int, default=0, help="restarts of the group after a failure (default 0)")
    option("--monitor-interval", type=float, default=0.1, help="seconds between checks on the other nodes")
    option("--master-addr", default="127.0.0.1", help="rendezvous host without --rdzv-endpoint")
    option(
        "--master-port",
        type=int,
        default=None,
        help="several nodes: rendezvous port without --rdzv-endpoint; one node: the workers' MASTER_PORT",
    )
    option("--role", default="default", help="ROLE_NAME of the workers")
    option("--log-dir", default=None, help="where the per-rank stderr logs go (default: a temp dir)")
    option("--term-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL on stop")
    security.add_arguments(parser)
    option("--module", "-m", action="store_true", help="run the target as a module (python -m)")
    option("--no-python", action="store_true", help="run the target as an executable, not with python")
    parser.add_argument("training_script", help="the program (or module with -m)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of rpcdist-run."""
    return _parser().parse_args(argv)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    try:
        low, _, high = text.partition(":")
        bounds = (int(low), int(high) if high else int(low))
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise LaunchError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return bounds


def _parse_nproc(text: str) -> int:
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise LaunchError(
            f"--nproc-per-node must be a number, 'cpu' or 'auto' (CPU only), got {text!r}"
        ) from None
    if count < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {count}")
    return count


def _parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    host, port = text, default_port
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    if not host:
        raise LaunchError(f"rendezvous endpoint {text!r} has no host")
    return host, port


def _parse_rdzv_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise LaunchError(f"--rdzv-conf wants key=value pairs, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "y", "on")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command every worker runs: ``python -u script args`` (``-m module``, or the
    executable itself with ``--no-python``)."""
    if args.no_python:
        if args.module:
            raise LaunchError("--no-python and -m/--module cannot be combined")
        return [args.training_script, *args.training_script_args]
    python = [sys.executable, "-u"]
    if args.module:
        return [*python, "-m", args.training_script, *args.training_script_args]
    return [*python, args.training_script, *args.training_script_args]


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Check the command line and turn it into a :class:`LaunchConfig`."""
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if args.standalone and max_nodes > 1:
        raise LaunchError("--standalone runs a single node: it cannot be combined with --nnodes > 1")
    if args.max_restarts < 0:
        raise LaunchError("--max-restarts must be >= 0")
    if args.monitor_interval <= 0:
        raise LaunchError("--monitor-interval must be > 0")
    if args.node_rank is not None and not 0 <= args.node_rank < max_nodes:
        raise LaunchError(f"--node-rank {args.node_rank} is outside [0, {max_nodes})")
    conf = _parse_rdzv_conf(args.rdzv_conf)
    unknown = sorted(set(conf) - set(RDZV_CONF_KEYS))
    if unknown:
        log.warning("--rdzv-conf: ignoring %s (rpcdist-run knows %s)", unknown, ", ".join(RDZV_CONF_KEYS))
    try:
        keep_alive = float(conf.get("keep_alive_interval", 5.0))
        keep_alive_attempts = int(conf.get("keep_alive_max_attempt", 3))
    except ValueError:
        raise LaunchError(f"--rdzv-conf {args.rdzv_conf!r}: keep_alive_* must be numbers") from None
    if keep_alive <= 0 or keep_alive_attempts < 1:
        raise LaunchError("--rdzv-conf: keep_alive_interval must be > 0 and keep_alive_max_attempt >= 1")
    etcd_endpoints = ""
    if args.rdzv_backend == "etcd":
        if not args.rdzv_endpoint:
            raise LaunchError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] of etcd")
        try:
            etcd_endpoints = ",".join(parse_endpoints(args.rdzv_endpoint))
        except StoreError as exc:
            raise LaunchError(f"--rdzv-endpoint: {exc}") from None
        rdzv_host, rdzv_port = _parse_endpoint(etcd_endpoints.split(",")[0], DEFAULT_RDZV_PORT)
    elif args.rdzv_endpoint:
        rdzv_host, rdzv_port = _parse_endpoint(args.rdzv_endpoint, DEFAULT_RDZV_PORT)
    else:  # torchrun's static rendezvous: the master address is the meeting point
        rdzv_host, rdzv_port = args.master_addr, args.master_port or DEFAULT_MASTER_PORT
    single = max_nodes == 1
    run_id = args.rdzv_id or ("none" if not single else uuid.uuid4().hex[:12])
    try:
        credentials = security.from_arguments(args)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if credentials.token is None:
        if single:  # one host: a token for this run, which only its workers are given
            credentials = credentials.with_token(security.new_token())
        else:
            log.warning(
                "no auth token: anyone who can reach the rendezvous at %s:%d and the workers can join "
                "and call; give every node the same --auth-token-file (see README: Security)",
                rdzv_host,
                rdzv_port,
            )
    return LaunchConfig(
        command=worker_command(args),
        nproc_per_node=_parse_nproc(str(args.nproc_per_node)),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=args.node_rank,
        rdzv_host=rdzv_host,
        rdzv_port=rdzv_port,
        run_id=run_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        role=args.role,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        join_timeout=float(conf.get("join_timeout", 600.0)),
        last_call_timeout=float(conf.get("last_call_timeout", 30.0)),
        is_host=_truthy(conf["is_host"]) if "is_host" in conf else None,
        keep_alive_interval=keep_alive,
        keep_alive_max_attempt=keep_alive_attempts,
        term_timeout=args.term_timeout,
        master_addr=args.master_addr,
        master_port=args.master_port if single else None,
        security=credentials,
        etcd_endpoints=etcd_endpoints,
    )


def worker_env(
    base: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    role: str,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus torchrun's variables (and RPCDIST_LAUNCHED)."""
    env = dict(base)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": str(group_rank),
            "GROUP_WORLD_SIZE": str(group_world_size),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "ROLE_NAME": role,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            # The store at MASTER_PORT is rpcdist's, not a torch TCPStore.
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            _launch_env.LAUNCHED_MARKER: "1",
            _launch_env.AGENT_STORE_MARKER: "1",  # env:// connects; rank 0 serves no store
        }
    )
    if local_world_size > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: several workers would oversubscribe the cores
    return env


# ============================================================================ workers
# Every worker starts through this shim: it puts itself in a process group of its own, asks the
# kernel for SIGKILL when the launcher dies (PR_SET_PDEATHSIG), checks the launcher did not die
# before that was armed, and execs the worker's command (same pid). It is a separate exec, not a
# preexec_fn, because the launcher runs gRPC: a plain fork() runs gRPC's fork handlers, whose
# threads can abort the child before it execs; without a preexec_fn, subprocess uses vfork.
_WORKER_SHIM = """\
import ctypes, os, sys
os.setpgid(0, 0)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"cannot run {sys.argv[2]!r}: {exc.strerror}\\n")
    os._exit(127)
"""


def shim_command(command: Sequence[str], launcher_pid: int) -> list[str]:
    """``command`` behind the worker shim (see ``_WORKER_SHIM``)."""
    return [sys.executable, "-I", "-S", "-c", _WORKER_SHIM, str(launcher_pid), *command]


def exit_status(returncode: int) -> int:
    """A shell's view of a return code: the code, or 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_returncode(returncode: int) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL (9)``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {name} ({-returncode})"


def traceback_tail(lines: Sequence[str], limit: int = TRACEBACK_LINES) -> list[str]:
    """The last traceback in ``lines`` (at most ``limit`` lines of it), else the last lines."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        return lines[max(starts[-1], len(lines) - limit) :]
    return lines[-min(limit, 20) :]


@dataclass
class Worker:
    """One worker process of the current round."""

    rank: int
    local_rank: int
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    pump: asyncio.Task[None] | None = None
    exited_at: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (it and whatever it started)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


async def _pump_stderr(stream: asyncio.StreamReader, worker: Worker) -> None:
    """Copy a worker's stderr to its log file and, line by line with ``[rankN]:``, to ours."""
    prefix = f"[rank{worker.rank}]:".encode()
    out = getattr(sys.stderr, "buffer", None)

    echo = True

    def emit(line: bytes) -> None:
        nonlocal echo
        worker.tail.append(line.decode(errors="replace").rstrip("\r"))
        if not echo:
            return
        try:
            if out is None:
                sys.stderr.write((prefix + line).decode(errors="replace") + "\n")
                return
            sys.stderr.flush()  # whatever logging wrote first
            out.write(prefix + line + b"\n")
            out.flush()
        except (OSError, ValueError):  # our stderr is gone: keep logging to the file only
            echo = False

    partial = b""
    with open(worker.log_path, "ab") as log_file:
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            log_file.write(chunk)
            log_file.flush()
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                emit(line)
            if len(partial) > 65536:  # a very long line: pass it on in pieces
                emit(partial)
                partial = b""
        if partial:
            emit(partial)


# ============================================================================ rendezvous
@dataclass(frozen=True)
class RoundPlan:
    """What the nodes agreed for one round: this node's place, the world, the workers' store.

    ``round`` numbers every formation of the group; ``restart`` counts only those caused by a
    failure (TORCHELASTIC_RESTART_COUNT): a group re-formed because nodes came or went keeps it.
    ``members`` are the nodes' ids by node rank.
    """

    round: int
    restart: int
    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    max_restarts: int
    members: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (one of its addresses can be bound)."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def _port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (asked quietly, before gRPC tries and logs)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        return True
    except OSError:
        return False


def assign_node_ranks(requested: Sequence[int | None], leader: int | None) -> list[int]:
    """Node ranks for the joined nodes (in join order): the ones asked for with --node-rank,
    then the hosting node (``leader``, an index) the lowest free one, then the rest in join
    order. Raises LaunchError for a rank out of range or asked for twice."""
    count = len(requested)
    ranks: list[int | None] = list(requested)
    seen: dict[int, int] = {}
    for index, want in enumerate(requested):
        if want is None:
            continue
        if not 0 <= want < count:
            raise LaunchError(f"--node-rank {want} is outside [0, {count}) for the {count} nodes that joined")
        if want in seen:
            raise LaunchError(
                f"two nodes (join order {seen[want] + 1} and {index + 1}) asked for --node-rank {want}"
            )
        seen[want] = index
    free = iter(sorted(set(range(count)) - set(seen)))
    order = ([leader] if leader is not None else []) + [i for i in range(count) if i != leader]
    for index in order:
        if ranks[index] is None:
            ranks[index] = next(free)
    return [int(r) for r in ranks]  # every slot is filled: as many free ranks as unset slots


class NodeRendezvous:
    """The launchers of a run agree, round by round, on node ranks, the world size and the
    workers' store, through rpcdist's store (in this process's memory for a single node).

    Keys, under ``rpcdist-run/<run id>/r<round>/``: ``joined`` (counter), ``node/<i>`` (the
    i-th node to join), ``group`` (written by the hosting node: the round's plan), ``failed``
    (the first event that ends the round: a failure, a stop, or a re-forming of the group),
    ``done`` (counter of nodes whose workers succeeded), ``exit/<node rank>`` (a node's final
    status). Beside them: ``latest`` (the newest round with a group) and ``beat/<node id>``
    (a counter each node bumps every ``keep_alive_interval`` while it lives).
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.leader = False
        self.lost = False  # the rendezvous store stopped answering while the workers ran
        self._server: StoreServer | None = None
        self._worker_store: StoreServer | None = None
        self._clients: list[Store] = []
        self._kv: Store | None = None  # joins: waits as long as join_timeout
        self._watch: Store | None = None  # everything else: gives up on a silent store quickly
        self._join_index = 0
        self.node_id = uuid.uuid4().hex[:12]
        self._beating: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Host the rendezvous store, or connect to the node that does."""
        cfg = self.config
        prefix = f"rpcdist-run/{cfg.run_id}"
        if cfg.etcd_endpoints:
            await self._open_etcd(prefix)
            self._start_beating()
            return
        if cfg.single_node:
            memory = HashStore(timeout=cfg.join_timeout)
            self._clients.append(memory)
            self.leader = True
            self._kv = self._watch = PrefixStore(prefix, memory)
            return
        wants_host = cfg.is_host
        if wants_host is None:
            wants_host = cfg.node_rank == 0 or (cfg.node_rank is None and _is_local_address(cfg.rdzv_host))
        bind = cfg.rdzv_host if is_loopback(cfg.rdzv_host) else "0.0.0.0"
        # Only is_host=1 insists: another launcher on this machine (with or without a node
        # rank) may have bound the endpoint first, and node rank 0 need not host it.
        chosen = bool(cfg.is_host)
        if wants_host and not chosen and not _port_free(bind, cfg.rdzv_port):
            log.info("rendezvous port %d is taken here: joining as a client", cfg.rdzv_port)
            wants_host = False  # another launcher on this machine hosts it
        if wants_host:
            try:
                self._server = await StoreServer.start(bind, cfg.rdzv_port, security=cfg.security)
            except StoreError as exc:
                if chosen:
                    raise LaunchError(f"cannot host the rendezvous at {cfg.rdzv_endpoint}: {exc}") from exc
                log.info("rendezvous port %d is taken here (%s): joining as a client", cfg.rdzv_port, exc)
        self.leader = self._server is not None
        if self.leader:
            log.info("hosting the rendezvous of run %s at %s", cfg.run_id, cfg.rdzv_endpoint)
        joiner = GrpcStore(cfg.rdzv_host, cfg.rdzv_port, timeout=cfg.join_timeout, security=cfg.security)
        watcher = GrpcStore(
            cfg.rdzv_host,
            cfg.rdzv_port,
            timeout=cfg.join_timeout,
            connect_timeout=WATCH_CONNECT_TIMEOUT,
            security=cfg.security,
        )
        self._clients += [joiner, watcher]
        self._kv, self._watch = PrefixStore(prefix, joiner), PrefixStore(prefix, watcher)
        self._start_beating()

    def _start_beating(self) -> None:
        if self.config.elastic:
            self._beating = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        """Tell the other nodes this one lives, every ``keep_alive_interval`` s."""
        while not self.lost:
            await self._guarded("beating", lambda store: store.add_async(f"beat/{self.node_id}", 1), None)
            await asyncio.sleep(self.config.keep_alive_interval)

    async def first_round(self) -> int:
        """The round a node joins at start: the one after the newest round that has a group
        (a node arriving while the others run waits for the next re-forming), else 0."""
        if self.config.single_node or not await self.kv.check_async(["latest"]):
            return 0
        return int(await self.kv.get_async("latest")) + 1

    async def _open_etcd(self, prefix: str) -> None:
        """Meet on etcd: the first launcher to claim the run leads it."""
        cfg = self.config
        joiner = EtcdStore(cfg.etcd_endpoints, prefix, timeout=cfg.join_timeout)
        watcher = EtcdStore(
            cfg.etcd_endpoints, prefix, timeout=cfg.join_timeout, connect_timeout=WATCH_CONNECT_TIMEOUT
        )
        self._clients += [joiner, watcher]
        self._kv, self._watch = joiner, watcher
        me = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        try:
            self.leader = await joiner.compare_set_async("leader", b"", me) == me.encode()
        except StoreError as exc:
            raise LaunchError(f"the etcd rendezvous at {cfg.rdzv_endpoint} failed: {exc}") from exc
        if self.leader:
            log.info("leading the rendezvous of run %s on etcd at %s", cfg.run_id, cfg.rdzv_endpoint)

    @property
    def kv(self) -> Store:
        assert self._kv is not None, "open() first"
        return self._kv

    # -- joining a round -------------------------------------------------------------------------
    async def join(
        self, round_: int, restart: int, expected: frozenset[str] = frozenset()
    ) -> RoundPlan | None:
        """Join round ``round_`` and wait until the hosting node has closed it. None when it
        started without this node and the group is elastic (join the next one then).

        ``restart`` and ``expected`` matter on the hosting node only: the restart count the round
        gets, and the nodes (ids) it should wait for before its last call ends early."""
        cfg = self.config
        key = f"r{round_}"
        try:
            index = await self.kv.add_async(f"{key}/joined", 1)
            self._join_index = index
            info = {
                "host": socket.gethostname(),
                "nproc": cfg.nproc_per_node,
                "node_rank": cfg.node_rank,
                "id": self.node_id,
            }
            await self.kv.set_async(f"{key}/node/{index}", json.dumps(info))
            if self.leader:
                await self._close_round(round_, restart, expected)
            group = json.loads(await self.kv.get_async(f"{key}/group", cfg.join_timeout))
        except StoreTimeoutError:
            raise LaunchError(
                f"round {round_} of run {cfg.run_id!r} did not start within {cfg.join_timeout:g} s: "
                f"fewer than {cfg.min_nodes} nodes joined at {cfg.rdzv_endpoint}"
            ) from None
        except StoreError as exc:
            raise LaunchError(f"the rendezvous at {cfg.rdzv_endpoint} failed: {exc}") from exc
        if group.get("error"):
            raise LaunchError(group["error"])
        mine = next((node for node in group["nodes"] if node["join"] == index), None)
        if mine is None:
            if cfg.elastic:
                return None
            raise LaunchError(
                f"round {round_} of run {cfg.run_id!r} started with {len(group['nodes'])} nodes "
                f"without this one (--nnodes {cfg.min_nodes}): a fixed-size group takes no late node; "
                "--nnodes MIN:MAX lets nodes join a running group"
            )
        by_rank = sorted(group["nodes"], key=lambda node: node["node_rank"])
        return RoundPlan(
            round=round_,
            restart=group["restart"],
            node_rank=mine["node_rank"],
            nnodes=len(group["nodes"]),
            rank_offset=mine["rank_offset"],
            world_size=group["world_size"],
            master_addr=group["master_addr"],
            master_port=group["master_port"],
            max_restarts=group["max_restarts"],
            members=tuple(node["id"] for node in by_rank),
            hosts=tuple(node["host"] for node in by_rank),
        )

    async def _close_round(self, round_: int, restart: int, expected: frozenset[str]) -> None:
        """(Hosting node) wait for MIN nodes, then up to MAX during the last call (which ends
        early once every ``expected`` node is back); fix the group, serve the round's workers'
        store and publish the plan."""
        cfg, key = self.config, f"r{round_}"
        try:
            await self.kv.wait_async(
                [f"{key}/node/{i}" for i in range(1, cfg.min_nodes + 1)], cfg.join_timeout
            )
        except StoreTimeoutError:
            joined = await self.kv.add_async(f"{key}/joined", 0)
            error = (
                f"only {joined} of the {cfg.min_nodes} nodes needed joined run {cfg.run_id!r} "
                f"at {cfg.rdzv_endpoint} within {cfg.join_timeout:g} s"
            )
            await self.kv.set_async(f"{key}/group", json.dumps({"error": error}))
            raise LaunchError(error) from None
        if cfg.max_nodes > cfg.min_nodes:
            last_call = time.monotonic() + cfg.last_call_timeout
            while time.monotonic() < last_call:
                joined = await self.kv.add_async(f"{key}/joined", 0)
                if joined >= cfg.max_nodes or (expected and expected <= await self._ids_joined(key, joined)):
                    break
                await asyncio.sleep(min(0.1, max(0.0, last_call - time.monotonic())))
        joined = await self.kv.add_async(f"{key}/joined", 0)
        order = list(range(1, min(joined, cfg.max_nodes) + 1))
        if self._join_index not in order:  # the hosting node is always in its own group
            order[-1] = self._join_index
        count = len(order)
        nodes = [f"{key}/node/{i}" for i in order]
        await self.kv.wait_async(nodes, 30.0)  # each joiner writes its card right after counting in
        infos = [json.loads(await self.kv.get_async(node)) for node in nodes]
        leader = order.index(self._join_index)
        try:
            ranks = assign_node_ranks([info["node_rank"] for info in infos], leader)
        except LaunchError as exc:
            await self.kv.set_async(f"{key}/group", json.dumps({"error": str(exc)}))
            raise
        offsets, offset = {}, 0
        for node_rank, index in sorted((rank, i) for i, rank in enumerate(ranks)):
            offsets[node_rank] = offset
            offset += infos[index]["nproc"]
        master_addr, master_port = await self._serve_workers_store()
        group = {
            "nodes": [
                {
                    "join": order[i],
                    "node_rank": ranks[i],
                    "host": infos[i]["host"],
                    "nproc": infos[i]["nproc"],
                    "rank_offset": offsets[ranks[i]],
                }
                for i in range(count)
            ],
            "world_size": offset,
            "master_addr": master_addr,
            "master_port": master_port,
            "max_restarts": cfg.max_restarts,
            "restart": restart,
        }
        for i in range(count):
            group["nodes"][i]["id"] = infos[i]["id"]
        await self.kv.set_async(f"{key}/group", json.dumps(group))
        await self.kv.set_async("latest", str(round_))
        if count > 1:
            log.info(
                "round %d: %d nodes, %d workers, workers' store at %s:%d",
                round_,
                count,
                offset,
                master_addr,
                master_port,
            )

    async def _ids_joined(self, key: str, joined: int) -> set[str]:
        """The ids of the nodes whose cards are in round ``key`` so far."""
        cards = [f"{key}/node/{i}" for i in range(1, joined + 1)]
        # A node counts itself in before it writes its card.
        present = [card for card in cards if await self.kv.check_async([card])]
        return {json.loads(await self.kv.get_async(card))["id"] for card in present}

    async def _serve_workers_store(self) -> tuple[str, int]:
        """A fresh store for the round's workers (the previous round's is stopped)."""
        cfg = self.config
        if self._worker_store is not None:
            await self._worker_store.stop(grace=0.5)
            self._worker_store = None
        host = cfg.master_addr if cfg.single_node else cfg.rdzv_host
        if cfg.etcd_endpoints and not cfg.single_node and not is_loopback(host):
            host = local_address_towards(host)  # this node's address, as the etcd host sees it
        bind = host if is_loopback(host) else "0.0.0.0"
        port = cfg.master_port if cfg.single_node and cfg.master_port else 0
        try:
            self._worker_store = await StoreServer.start(bind, port, security=cfg.security)
        except StoreError as exc:
            raise LaunchError(f"cannot serve the workers' store on {bind}:{port}: {exc}") from exc
        return host, self._worker_store.port

    # -- during and after a round ---------------------------------------------------------------
    async def _guarded(self, what: str, op: Callable[[Store], Any], default: Any) -> Any:
        if self.lost or self._watch is None:
            return default
        try:
            return await op(self._watch)
        except StoreError as exc:
            self.lost = True
            log.warning(
                "the rendezvous store at %s is gone (%s while %s)", self.config.rdzv_endpoint, exc, what
            )
            return default

    async def failure(self, round_: int) -> dict[str, Any] | None:
        """The first event published in round ``round_`` (failure, stop, re-forming), if any."""
        key = f"r{round_}/failed"

        async def read(store: Store) -> dict[str, Any] | None:
            if not await store.check_async([key]):
                return None
            return json.loads(await store.get_async(key, 5.0))

        return await self._guarded("checking for failures", read, None)

    async def publish_failure(self, round_: int, info: dict[str, Any]) -> dict[str, Any]:
        """Publish an event that ends round ``round_``; returns the round's first (maybe another's)."""
        mine = json.dumps(info)

        async def publish(store: Store) -> dict[str, Any]:
            return json.loads(await store.compare_set_async(f"r{round_}/failed", b"", mine))

        return await self._guarded("publishing a failure", publish, info)

    async def someone_finished(self, round_: int) -> bool:
        """Whether a node's workers already finished round ``round_`` (it cannot restart)."""

        async def count(store: Store) -> bool:
            return await store.add_async(f"r{round_}/done", 0) > 0

        return await self._guarded("checking for finished nodes", count, False)

    async def waiting(self, round_: int) -> bool:
        """Whether a node is waiting to join the round after ``round_``."""

        async def count(store: Store) -> bool:
            return await store.add_async(f"r{round_ + 1}/joined", 0) > 0

        return await self._guarded("checking for joining nodes", count, False)

    async def beats(self, plan: RoundPlan) -> dict[str, int]:
        """The beat counters of the round's other nodes that have not ended their part of it."""

        async def read(store: Store) -> dict[str, int]:
            counts = {}
            for node_rank, node_id in enumerate(plan.members):
                ended = await store.check_async([f"r{plan.round}/exit/{node_rank}"])
                if node_id != self.node_id and not ended:
                    counts[node_id] = await store.add_async(f"beat/{node_id}", 0)
            return counts

        return await self._guarded("reading the other nodes' beats", read, {})

    async def finish(self, plan: RoundPlan, status: int) -> None:
        """Record this node's final status; the hosting node then keeps serving (the workers'
        store too) until every node has finished: at most EXIT_BARRIER_TIMEOUT s after its own
        workers succeeded, ``--term-timeout`` + 10 s after they failed or were stopped (the
        others are only stopping theirs then; a second signal ends the wait too)."""

        async def record(store: Store) -> None:
            if status == 0:
                await store.add_async(f"r{plan.round}/done", 1)
            await store.set_async(f"r{plan.round}/exit/{plan.node_rank}", str(status))

        await self._guarded("recording the exit", record, None)
        if not self.leader or plan.nnodes == 1 or self.lost:
            return
        keys = [f"r{plan.round}/exit/{n}" for n in range(plan.nnodes)]
        # After a success, the others may still be working; otherwise they are only stopping.
        limit = EXIT_BARRIER_TIMEOUT if status == 0 else self.config.term_timeout + 10.0
        try:
            await self.kv.wait_async(keys, limit)
            for n in range(plan.nnodes):
                other = int(await self.kv.get_async(f"r{plan.round}/exit/{n}"))
                if other != 0 and n != plan.node_rank:
                    log.warning("node %d finished with status %d", n, other)
        except StoreError as exc:
            log.warning("not every node reported its end (%s): stopping the stores", exc)

    async def close(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
        for client in self._clients:
            with contextlib.suppress(Exception):
                await client.close_async()
        for server in (self._worker_store, self._server):
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.stop(grace=0.5)


# ============================================================================ the agent
@dataclass
class _Outcome:
    kind: str  # "succeeded", "failed", "remote", "signal"
    failed: list[Worker] = field(default_factory=list)
    remote: dict[str, Any] | None = None


class LaunchAgent:
    """Runs one node of a launch: rendezvous, workers, supervision, restarts. :meth:`run`
    returns the launcher's exit status."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.rdzv = NodeRendezvous(config)
        self.workers: list[Worker] = []
        self._signal: int | None = None
        self._signalled = asyncio.Event()
        self._kill_now = asyncio.Event()
        self._main: asyncio.Task[Any] | None = None
        self._running = False  # workers are running: a signal is passed on to them
        self._cancellable = False  # waiting on the other nodes: a signal ends the wait
        self._next_beat_check = 0.0  # when the round's supervision next reads the nodes' beats
        self._run_dir: Path | None = None
        self._own_run_dir = False

    # -- signals ---------------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._signal is None:
            self._signal = sig
            self._signalled.set()
            if self._running:
                log.warning("got %s: passing it on to the workers", name)
        else:
            log.warning("got %s again: killing the workers", name)
            self._kill_now.set()
        if self._cancellable and self._main is not None:  # waiting on the other nodes: stop waiting
            log.warning("got %s while waiting for the other nodes: stopping", name)
            self._main.cancel()

    # -- the run -----------------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until the workers succeed, fail for good, or a signal stops them."""
        loop = asyncio.get_running_loop()
        self._main = asyncio.current_task()
        installed = []
        for sig in FORWARDED_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, int(sig))
                installed.append(sig)
        self._make_run_dir()
        status = 1
        try:
            self._cancellable = True
            await self.rdzv.open()
            status = await self._rounds()
        except asyncio.CancelledError:
            if self._signal is None:
                raise
            if self._main is not None and hasattr(self._main, "uncancel"):
                self._main.uncancel()  # handled: later timeouts must not mistake it for theirs
            status = exit_status(-self._signal)
        except LaunchError as exc:
            log.error("%s", exc)
            status = 1
        finally:
            self._cancellable = False
            with contextlib.suppress(Exception):
                await self._stop_workers(signal.SIGKILL, 0)
            await self.rdzv.close()
            for sig in installed:
                loop.remove_signal_handler(sig)
        run_dir = self._run_dir
        if self._own_run_dir and run_dir is not None and (status == 0 or not any(run_dir.rglob("*.log"))):
            shutil.rmtree(run_dir, ignore_errors=True)
        return status

    def _make_run_dir(self) -> None:
        safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", self.config.run_id)
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            self._run_dir = Path(tempfile.mkdtemp(prefix=f"{safe_id}_", dir=self.config.log_dir))
        else:
            self._run_dir = Path(tempfile.mkdtemp(prefix=f"rpcdist-run-{safe_id}-"))
            self._own_run_dir = True

    async def _rounds(self) -> int:
        restart, expected = 0, frozenset[str]()
        self._cancellable = True
        round_ = await self.rdzv.first_round()
        while True:
            self._cancellable = True
            plan = await self.rdzv.join(round_, restart, expected)
            self._cancellable = False
            if self._signal is not None:
                raise asyncio.CancelledError
            if plan is None:
                log.info("round %d started without this node: joining the group when it re-forms", round_)
                round_ += 1
                continue
            await self._start_workers(plan)
            outcome = await self._supervise(plan)
            if outcome.kind == "succeeded":
                await self._stop_workers(signal.SIGKILL, 0)  # leftovers of their process groups
                await self._finish(plan, 0)
                return 0
            if outcome.kind == "signal":
                status = await self._after_signal(plan)
                await self._finish(plan, status)
                return status
            status, first = await self._after_failure(plan, outcome)
            round_, restart = plan.round + 1, plan.restart
            finished = await self.rdzv.someone_finished(plan.round)
            if first.get("reform") and not finished and self._signal is None:
                # Nodes came or went: the same restart count, without the nodes that left.
                expected = frozenset(plan.members) - frozenset(first.get("left", ()))
                continue
            can_restart = (
                plan.restart < plan.max_restarts
                and not first.get("stop")
                and not finished
                and self._signal is None
            )
            if not can_restart:
                if plan.restart >= plan.max_restarts and outcome.kind == "failed":
                    log.error(
                        "giving up after %d restart(s) (--max-restarts %d)", plan.restart, plan.max_restarts
                    )
                await self._finish(plan, status)
                return status
            restart, expected = restart + 1, frozenset(plan.members)
            log.warning("restarting the workers (restart %d of %d)", restart, plan.max_restarts)

    async def _finish(self, plan: RoundPlan, status: int) -> None:
        self._cancellable = True
        try:
            await self.rdzv.finish(plan, status)
        finally:
            self._cancellable = False

    async def _start_workers(self, plan: RoundPlan) -> None:
        cfg = self.config
        assert self._run_dir is not None
        attempt_dir = self._run_dir / f"attempt_{plan.restart}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        first = plan.rank_offset
        log.info(
            "run %s, node %d of %d: starting ranks %d-%d of %d (restart %d, max %d); stderr logs in %s",
            cfg.run_id,
            plan.node_rank,
            plan.nnodes,
            first,
            first + cfg.nproc_per_node - 1,
            plan.world_size,
            plan.restart,
            plan.max_restarts,
            attempt_dir,
        )
        self.workers = []
        self._running = True
        command = shim_command(cfg.command, os.getpid())
        for local_rank in range(cfg.nproc_per_node):
            rank = first + local_rank
            env = worker_env(
                {**os.environ, **security.to_environment(cfg.security)},
                rank=rank,
                local_rank=local_rank,
                world_size=plan.world_size,
                local_world_size=cfg.nproc_per_node,
                group_rank=plan.node_rank,
                group_world_size=plan.nnodes,
                role=cfg.role,
                master_addr=plan.master_addr,
                master_port=plan.master_port,
                run_id=cfg.run_id,
                restart_count=plan.restart,
                max_restarts=plan.max_restarts,
            )
            worker = Worker(rank, local_rank, attempt_dir / f"rank{rank}.stderr.log")
            try:
                worker.process = await asyncio.create_subprocess_exec(
                    *command, env=env, stdin=subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {cfg.command[0]!r}: {exc}") from exc
            with contextlib.suppress(OSError):  # also from this side: no window without a group
                os.setpgid(worker.process.pid, worker.process.pid)
            assert worker.process.stderr is not None
            worker.pump = asyncio.ensure_future(_pump_stderr(worker.process.stderr, worker))
            self.workers.append(worker)

    async def _supervise(self, plan: RoundPlan) -> _Outcome:
        """Wait for the workers: all succeeded, one failed, another node failed, or a signal."""
        multi = not self.config.single_node
        exits: dict[asyncio.Future[int], Worker] = {}
        for worker in self.workers:
            assert worker.process is not None
            task = asyncio.ensure_future(worker.process.wait())
            task.add_done_callback(lambda _t, w=worker: setattr(w, "exited_at", time.monotonic()))
            exits[task] = worker
        pending: set[asyncio.Future[Any]] = set(exits)
        signalled = asyncio.ensure_future(self._signalled.wait())
        poll: asyncio.Future[dict[str, Any] | None] | None = None
        next_poll = time.monotonic() + self.config.monitor_interval
        beats_seen: dict[str, tuple[int, float]] = {}
        self._next_beat_check = 0.0
        try:
            while True:
                if self._signal is not None:
                    return _Outcome("signal")
                failed = [w for w in self.workers if w.returncode not in (None, 0)]
                if failed:
                    failed.sort(key=lambda w: w.exited_at or time.monotonic())
                    return _Outcome("failed", failed)
                if not pending:
                    return _Outcome("succeeded")
                if poll is not None and poll.done():
                    remote = poll.result()
                    poll = None
                    next_poll = time.monotonic() + self.config.monitor_interval
                    if remote is not None:
                        return _Outcome("remote", remote=remote)
                    if self.rdzv.lost:  # its host (and the workers' store) is gone: the run cannot go on
                        gone = f"the rendezvous store at {self.config.rdzv_endpoint} is gone"
                        return _Outcome("remote", remote={"stop": True, "reason": gone})
                if multi and poll is None and not self.rdzv.lost and time.monotonic() >= next_poll:
                    poll = asyncio.ensure_future(self._check_round(plan, beats_seen))
                waiting = pending | {signalled} | ({poll} if poll is not None else set())
                timeout = max(0.0, next_poll - time.monotonic()) if multi and poll is None else None
                done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            signalled.cancel()
            if poll is not None:
                poll.cancel()
            for task in pending:
                task.cancel()

    async def _check_round(
        self, plan: RoundPlan, seen: dict[str, tuple[int, float]]
    ) -> dict[str, Any] | None:
        """What ends the round, seen from the rendezvous store: the first event another node
        published; in an elastic run also a node waiting to join (while the group is below
        MAX) or a node whose beats stopped for ``keep_alive_interval x keep_alive_max_attempt``
        s (published here as a re-forming of the group). None while nothing does."""
        cfg = self.config
        first = await self.rdzv.failure(plan.round)
        if first is not None or not cfg.elastic:
            return first
        if plan.nnodes < cfg.max_nodes and await self.rdzv.waiting(plan.round):
            event = {"reform": True, "reason": "a node asked to join the group"}
            return await self.rdzv.publish_failure(plan.round, event)
        now = time.monotonic()
        if now < self._next_beat_check:
            return None
        self._next_beat_check = now + cfg.keep_alive_interval
        limit = cfg.keep_alive_interval * cfg.keep_alive_max_attempt
        silent = []
        for node_id, count in (await self.rdzv.beats(plan)).items():
            last = seen.get(node_id)
            if last is None or last[0] != count:
                seen[node_id] = (count, now)
            elif now - last[1] > limit:
                silent.append(node_id)
        if not silent:
            return None
        names = ", ".join(
            f"node {plan.members.index(i)} ({plan.hosts[plan.members.index(i)]})" for i in silent
        )
        event = {"reform": True, "left": silent, "reason": f"{names} stopped answering for over {limit:g} s"}
        return await self.rdzv.publish_failure(plan.round, event)

    async def _stop_workers(self, sig: int, grace: float) -> None:
        """Send ``sig`` to every worker still running; SIGKILL after ``grace`` s (or at once when
        the launcher gets a second signal); then kill whatever is left in their process groups
        and drain their stderr."""
        alive = [w for w in self.workers if w.returncode is None and w.process is not None]
        for worker in alive:
            worker.signal_group(sig)
        if alive and grace > 0 and sig != signal.SIGKILL:
            all_exited = asyncio.ensure_future(
                asyncio.gather(*(w.process.wait() for w in alive if w.process))
            )
            kill_now = asyncio.ensure_future(self._kill_now.wait())
            await asyncio.wait({all_exited, kill_now}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for task in (all_exited, kill_now):
                task.cancel()
            await asyncio.gather(all_exited, kill_now, return_exceptions=True)
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)  # stragglers, and anything left in their groups
        if alive:
            await asyncio.wait(
                [asyncio.ensure_future(w.process.wait()) for w in alive if w.process], timeout=10.0
            )
        pumps = [w.pump for w in self.workers if w.pump is not None and not w.pump.done()]
        if pumps:
            _, late = await asyncio.wait(pumps, timeout=2.0)  # a grandchild may hold the pipe open
            for pump in late:
                pump.cancel()
        self._running = False

    def _worker_where(self, plan: RoundPlan, worker: Worker) -> str:
        return (
            f"rank {worker.rank} (local rank {worker.local_rank} on node {plan.node_rank}, pid {worker.pid})"
        )

    def _report(self, plan: RoundPlan, worker: Worker, with_tail: bool) -> None:
        assert worker.returncode is not None
        lines = [f"{self._worker_where(plan, worker)} {describe_returncode(worker.returncode)}"]
        lines.append(f"  its stderr: {worker.log_path}")
        if with_tail:
            tail = traceback_tail(worker.tail)
            if tail:
                lines.append("  last lines of its stderr:")
                lines += [f"    {line}" for line in tail]
            else:
                lines.append("  (it wrote nothing to stderr)")
        log.error("%s", "\n".join(lines))

    async def _after_failure(self, plan: RoundPlan, outcome: _Outcome) -> tuple[int, dict[str, Any]]:
        """Stop the group, tell the other nodes, report; returns the node's exit status and the
        event that ended the round (a re-forming of the group is no failure: status 0)."""
        me = {"node_rank": plan.node_rank, "host": socket.gethostname()}
        if outcome.kind == "failed":
            root = outcome.failed[0]
            assert root.returncode is not None
            first = await self.rdzv.publish_failure(
                plan.round,
                {**me, "rank": root.rank, "status": describe_returncode(root.returncode)},
            )
        else:
            first = outcome.remote or {}
        await self._stop_workers(signal.SIGTERM, self.config.term_timeout)
        if first.get("reform"):
            log.warning("re-forming the group after round %d: %s", plan.round, _describe_remote(first))
            return 0, first
        if outcome.kind == "failed":
            log.error(
                "worker failure in round %d (restart %d of max %d):",
                plan.round,
                plan.restart,
                plan.max_restarts,
            )
            for i, worker in enumerate(outcome.failed):
                self._report(plan, worker, with_tail=i < 3)
            if first.get("node_rank") != plan.node_rank:
                log.error("the first failure was elsewhere: %s", _describe_remote(first))
            assert outcome.failed[0].returncode is not None
            return exit_status(outcome.failed[0].returncode) or 1, first
        log.error("stopping this node's workers: %s", _describe_remote(first))
        return 1, first

    async def _after_signal(self, plan: RoundPlan) -> int:
        assert self._signal is not None
        sig = self._signal
        if not self.config.single_node:
            name = signal.Signals(sig).name
            if self.config.elastic and not self.rdzv.leader:  # the others go on without this node
                reason = f"node {plan.node_rank} ({socket.gethostname()}) left the group ({name})"
                event: dict[str, Any] = {"reform": True, "left": [self.rdzv.node_id], "reason": reason}
            else:  # a fixed group cannot, and without the hosting node's store nobody can
                event = {"node_rank": plan.node_rank, "stop": True, "reason": f"got {name}"}
            await self.rdzv.publish_failure(plan.round, event)
        await self._stop_workers(sig, self.config.term_timeout)
        statuses = [exit_status(w.returncode) for w in self.workers if w.returncode is not None]
        status = next((s for s in statuses if s != 0), 0)
        log.warning("workers stopped after %s; exiting with status %d", signal.Signals(sig).name, status)
        return status


def _describe_remote(info: Mapping[str, Any]) -> str:
    if info.get("reform") or info.get("node_rank") is None:
        return str(info.get("reason", "another node failed"))
    if info.get("stop"):
        return f"node {info['node_rank']} was stopped ({info.get('reason', 'signal')})"
    return f"node {info['node_rank']} lost rank {info.get('rank')}, which {info.get('status', 'failed')}"


def _configure_logging() -> None:
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[rpcdist-run] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, stream=sys.stderr, format="[rpcdist-run] %(name)s: %(message)s"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rpcdist-run`` / ``python -m rpcdist.run``; returns the exit status.

    Run it on the main thread: workers are tied to the thread that started them (they get
    SIGKILL when it ends).
    """
    _configure_logging()
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except LaunchError as exc:
        log.error("%s", exc)
        return 2
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(LaunchAgent(config).run())
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
