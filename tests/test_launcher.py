"""rpcdist-run (``rpcdist/run.py``) and init with no arguments under launchers.

The launcher runs as a real process: once through its real command line
(``python -m rpcdist.run``), otherwise forked from the test fork server, which has torch and
rpcdist imported already (importing torch costs seconds per process on the test machine);
that process calls the same ``rpcdist.run.main(argv)``. Its workers are always real programs
(``tests/launcher_program.py``), mostly on the standard library only, so that they start fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import THREAD_ENV, _mp_context, free_port

import rpcdist
from rpcdist import _launch_env
from rpcdist.run import (
    LaunchError,
    assign_node_ranks,
    config_from_args,
    describe_returncode,
    parse_args,
    traceback_tail,
)

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = Path(__file__).with_name("launcher_program.py")
TORCHRUN_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


def _base_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "RPCDIST_", "GROUP_", "ROLE_"))
        and k not in TORCHRUN_VARS
    }
    env.update(THREAD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class Forked:
    """A process forked from the test fork server running ``launcher_program.run_spec``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import launcher_program

        self.log = Path(spec["log"])
        self.process = _mp_context().Process(target=launcher_program.run_spec, args=(spec,))
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
            raise AssertionError(
                f"{self.log.stem} still running after {timeout:g} s:\n{self.output()[-6000:]}"
            )
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)


@pytest.fixture
def forked() -> Iterator[list[Forked]]:
    """Processes a test forked; whatever still runs at its end is killed."""
    started: list[Forked] = []
    yield started
    for proc in started:
        proc.kill()


def launch(
    forked: list[Forked],
    out: Path,
    args: list[str],
    mode: str,
    *,
    name: str = "launcher",
    netns: str = "",
    env: dict[str, str] | None = None,
) -> Forked:
    """Start a launcher running ``launcher_program.py MODE OUT`` with ``args`` (its logs go
    under the test's directory unless ``args`` say where)."""
    out.mkdir(parents=True, exist_ok=True)
    if "--log-dir" not in args:
        args = [*args, "--log-dir", str(out.parent / "logs")]
    spec = {
        "what": "launcher",
        "argv": [*args, str(PROGRAM), mode, str(out)],
        "env": env or _base_env(),
        "log": str(out.parent / f"{name}.log"),
        "netns": netns,
    }
    proc = Forked(spec)
    forked.append(proc)
    return proc


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _wait_for(paths: list[Path], timeout: float, what: str, proc: Forked | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            log = proc.output()[-4000:] if proc else ""
            raise AssertionError(f"{what}: missing {[p.name for p in paths if not p.exists()]}\n{log}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


# ============================================================================ no processes
@pytest.mark.timeout(10)
def test_slurm_nodelists_expand() -> None:
    assert _launch_env.expand_nodelist("node[01-03],other") == ["node01", "node02", "node03", "other"]
    assert _launch_env.expand_nodelist("a[1,3-4]b,c") == ["a1b", "a3b", "a4b", "c"]
    assert _launch_env.expand_nodelist("r[1-2]-n[08-09]") == ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]
    assert _launch_env.expand_nodelist("single") == ["single"]
    assert _launch_env.first_node("gpu[100-999999999],x") == "gpu100"  # not expanded in full
    for bad in ("n[1-2", "n]1[", "n[a-b]", "n[5-1]"):
        with pytest.raises(ValueError):
            _launch_env.expand_nodelist(bad)


@pytest.mark.timeout(10)
def test_launch_environment_is_read_as_torchrun_and_slurm_set_it() -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[07-08]"}
    assert _launch_env.launch_rank_and_size(slurm) == (3, 4)
    assert _launch_env.local_rank(slurm) == 1
    assert _launch_env.master_address(slurm) == ("n07", "29500")
    assert _launch_env.is_launched(slurm) and not _launch_env.is_torchelastic_launched(slurm)
    # torchrun's (or rpcdist-run's) variables win over Slurm's (a launcher started by srun).
    both = {
        **slurm,
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "7",
    }
    assert _launch_env.launch_rank_and_size(both) == (5, 8)
    assert _launch_env.local_rank(both) == 0
    assert _launch_env.master_address(both) == ("h", "7")
    assert _launch_env.launch_rank_and_size({}) == (None, None)
    assert _launch_env.master_address({"SLURM_NTASKS": "2"}) == (None, None)  # not a task: no Slurm
    assert _launch_env.is_torchelastic_launched({"TORCHELASTIC_RUN_ID": "x"})
    assert _launch_env.is_launched({"RPCDIST_LAUNCHED": "1"})
    assert not _launch_env.is_launched({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.timeout(10)
def test_not_launched_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "RPCDIST_LAUNCHED", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert not rpcdist.is_torchelastic_launched()
    assert not rpcdist.is_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    assert rpcdist.is_torchelastic_launched() and rpcdist.is_launched()


@pytest.mark.timeout(10)
def test_command_line_as_torchrun_spells_it() -> None:
    torchrun_style = "--nproc_per_node 3 --nnodes 1:4 --node_rank 2 --rdzv_endpoint h:1234 --rdzv-id j"
    args = parse_args([*torchrun_style.split(), "--max_restarts", "2", "-m", "pkg.mod", "--lr", "0.1"])
    config = config_from_args(args)
    assert (config.nproc_per_node, config.min_nodes, config.max_nodes, config.node_rank) == (3, 1, 4, 2)
    assert (config.rdzv_host, config.rdzv_port, config.run_id, config.max_restarts) == ("h", 1234, "j", 2)
    assert config.command == [sys.executable, "-u", "-m", "pkg.mod", "--lr", "0.1"]
    static = config_from_args(
        parse_args(["--nnodes", "2", "--master-addr", "m", "--master-port", "9", "x.py"])
    )
    assert (static.rdzv_host, static.rdzv_port, static.run_id) == ("m", 9, "none")
    assert config_from_args(parse_args(["--rdzv-endpoint", "h", "--nnodes", "2", "x.py"])).rdzv_port == 29400
    for bad in (["--standalone", "--nnodes", "2"], ["--nnodes", "3:2"], ["--nproc-per-node", "gpu"]):
        with pytest.raises(LaunchError):
            config_from_args(parse_args([*bad, "x.py"]))
    assert assign_node_ranks([None, 0, None], leader=2) == [2, 0, 1]
    assert assign_node_ranks([None, None], leader=None) == [0, 1]
    with pytest.raises(LaunchError, match="asked for --node-rank 1"):
        assign_node_ranks([1, 1], leader=0)
    assert describe_returncode(3) == "exited with code 3"
    assert describe_returncode(-9) == "was killed by signal SIGKILL (9)"
    lines = ["noise", "Traceback (most recent call last):", '  File "x", line 1', "ValueError: v"]
    assert traceback_tail(lines) == lines[1:]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'rpcdist-run = "rpcdist.run:main"' in pyproject


# ============================================================================ one node
@pytest.mark.timeout(60)
def test_every_worker_gets_the_environment_contract(tmp_path: Path) -> None:
    """Through the real command line (the installed ``rpcdist-run`` script, else ``python -m
    rpcdist.run``): torchrun's variables, per rank, and a store that answers."""
    out = tmp_path / "out"
    out.mkdir()
    script = Path(sys.executable).with_name("rpcdist-run")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "rpcdist.run"]
    flags = "--standalone --nproc-per-node 2 --rdzv-id contract-run --max-restarts 2 --role trainer"
    command = [*launcher, *flags.split(), str(PROGRAM), "env", str(out)]
    done = subprocess.run(command, env=_base_env(), capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = {r: _json(out / f"rank{r}.json") for r in range(2)}
    ports = set()
    for rank, result in seen.items():
        env = result["env"]
        assert env == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "2",
            "ROLE_NAME": "trainer",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": env["MASTER_PORT"],
            "TORCHELASTIC_RUN_ID": "contract-run",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2",
            "RPCDIST_LAUNCHED": "1",
        }, env
        assert result["store_reachable"], "nothing serves MASTER_ADDR:MASTER_PORT"
        ports.add(env["MASTER_PORT"])
        assert f"[rank{rank}]:hello on stderr from rank {rank}" in done.stderr  # passed through, prefixed
        assert _gone(result["pid"])
    assert len(ports) == 1


@pytest.mark.timeout(60)
def test_rpc_and_all_reduce_with_no_init_arguments(tmp_path: Path, forked: list[Forked]) -> None:
    out = tmp_path / "out"
    proc = launch(forked, out, ["--standalone", "--nproc-per-node", "2"], "rpc")
    assert proc.wait(50) == 0, proc.output()[-6000:]
    for rank in range(2):
        result = _json(out / f"rank{rank}.json")
        assert result["rpc_rank"] == result["pg_rank"] == rank
        assert result["rpc_world"] == result["pg_world"] == 2
        assert result["rpc"] == [1.0 + (1 - rank)] * 2  # torch.add(ones, peer) on the peer
        assert result["all_reduce"] == 3.0
        assert result["is_torchelastic_launched"] and result["is_launched"]
    assert "Address already in use" not in proc.output()  # rank 0 did not try to serve a store


@pytest.mark.timeout(40)
def test_a_failing_worker_restarts_the_group(tmp_path: Path, forked: list[Forked]) -> None:
    out = tmp_path / "out"
    proc = launch(
        forked, out, ["--nproc-per-node", "2", "--max-restarts", "2", "--term-timeout", "5"], "restart"
    )
    assert proc.wait(30) == 0, proc.output()[-6000:]
    first = [_json(out / f"rank{r}.attempt0.json") for r in range(2)]
    second = [_json(out / f"rank{r}.attempt1.json") for r in range(2)]
    assert [r["restart_count"] for r in second] == [1, 1]
    assert not (out / "rank0.attempt2.json").exists()  # one restart was enough
    assert all(_gone(r["pid"]) for r in first + second)
    log = proc.output()
    assert "rank 1 (local rank 1 on node 0" in log and "exited with code 3" in log
    assert "restarting the workers (restart 1 of 2)" in log
    assert "[rank1]:rank 1 fails on purpose in the first round" in log


@pytest.mark.timeout(40)
def test_a_failure_beyond_max_restarts_is_reported(tmp_path: Path, forked: list[Forked]) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--term-timeout", "5", "--log-dir", str(logs)]
    proc = launch(forked, out, args, "fail")
    assert proc.wait(30) == 7, proc.output()[-6000:]  # the failing worker's exit status
    log = proc.output()
    report = log[log.index("worker failure in round 1") :]
    assert "rank 1 (local rank 1 on node 0" in report and "exited with code 7" in report
    assert "last lines of its stderr:" in report
    assert 'in _explode\n        raise ValueError("boom from rank 1")' in report
    assert "ValueError: boom from rank 1" in report
    assert "giving up after 1 restart(s) (--max-restarts 1)" in log
    per_rank = sorted(logs.glob("*/attempt_1/rank1.stderr.log"))
    assert len(per_rank) == 1 and "ValueError: boom from rank 1" in per_rank[0].read_text()


@pytest.mark.timeout(40)
def test_sigint_is_forwarded_and_the_launcher_exits_with_the_workers_status(
    tmp_path: Path, forked: list[Forked]
) -> None:
    out = tmp_path / "out"
    proc = launch(forked, out, ["--nproc-per-node", "2", "--max-restarts", "3"], "sigint")
    _wait_for([out / "rank0.ready", out / "rank1.ready"], 25, "workers ready", proc)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(20) == 128 + signal.SIGINT, proc.output()[-6000:]
    for rank in range(2):
        assert _json(out / f"rank{rank}.sigint")["signal"] == signal.SIGINT
        assert _gone(_json(out / f"rank{rank}.ready")["pid"])
    assert not list(out.glob("*.timeout"))
    assert "restarting" not in proc.output()  # an interrupted group is not restarted


@pytest.mark.timeout(40)
def test_no_worker_outlives_a_killed_launcher(tmp_path: Path, forked: list[Forked]) -> None:
    out = tmp_path / "out"
    proc = launch(forked, out, ["--nproc-per-node", "2"], "sleep")
    _wait_for([out / "rank0.pid", out / "rank1.pid"], 25, "workers started", proc)
    pids = [_json(out / f"rank{r}.pid")["pid"] for r in range(2)]
    assert not any(_gone(pid) for pid in pids)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids), f"workers {pids} survived their launcher"


@pytest.mark.timeout(30)
def test_nnodes_min_max_starts_with_the_nodes_present(tmp_path: Path, forked: list[Forked]) -> None:
    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic"]
    args += ["--rdzv-conf", "last_call_timeout=1"]
    proc = launch(forked, out, args, "env")
    assert proc.wait(25) == 0, proc.output()[-6000:]
    env = _json(out / "rank0.json")["env"]
    seen = [env[key] for key in ("WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK", "RANK")]
    assert seen == ["1", "1", "0", "0"]
    assert env["TORCHELASTIC_RUN_ID"] == "elastic"
    assert _json(out / "rank0.json")["store_reachable"]


@pytest.mark.timeout(40)
def test_a_failure_on_one_node_restarts_every_node(tmp_path: Path, forked: list[Forked]) -> None:
    """Two launchers on this host: the second finds the endpoint served and joins. Rank 1 (on
    node 1) fails in round 0; node 0 learns it through the store, stops its worker, and both
    nodes meet again in round 1, on a fresh workers' store."""
    out = tmp_path / "out"
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    args += ["--rdzv-id", "two-here", "--max-restarts", "1", "--term-timeout", "5"]
    node_0 = launch(forked, out, args, "restart", name="node_0")
    node_1 = launch(forked, out, args, "restart", name="node_1")
    assert node_0.wait(30) == 0, node_0.output()[-6000:] + node_1.output()[-6000:]
    assert node_1.wait(10) == 0, node_1.output()[-6000:]
    rounds = [[_json(out / f"rank{r}.attempt{a}.json") for r in range(2)] for a in range(2)]
    assert [r["restart_count"] for r in rounds[1]] == [1, 1]
    assert rounds[0][0]["master_port"] == rounds[0][1]["master_port"]
    assert rounds[1][0]["master_port"] == rounds[1][1]["master_port"] != rounds[0][0]["master_port"]
    hosting, joining = (node_0, node_1) if "hosting the rendezvous" in node_0.output() else (node_1, node_0)
    assert "joining as a client" in joining.output()
    logs = node_0.output() + node_1.output()
    assert "stopping this node's workers: node 1 lost rank 1, which exited with code 3" in logs
    assert logs.count("restarting the workers (restart 1 of 1)") == 2


def _new_group(out: Path, world: int, known: set[int], procs: list[Forked], timeout: float = 45.0) -> str:
    """Wait for a new round whose ``world`` workers all started (launcher_program's ``elastic``
    mode): workers not in ``known`` (pids) that share a store port. Returns that port and adds
    the workers to ``known``. (A port alone does not name a round: a later round's store may
    get an earlier one's port.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds: dict[str, list[dict[str, Any]]] = {}
        for path in out.glob("seen.*.json"):
            seen = _json(path)
            if seen["pid"] not in known:
                rounds.setdefault(seen["port"], []).append(seen)
        for port, seen in rounds.items():
            if len(seen) == world:
                assert all(s["world"] == world for s in seen), seen
                known.update(s["pid"] for s in seen)
                return port
        time.sleep(0.1)
    logs = "".join(proc.output()[-3000:] for proc in procs)
    raise AssertionError(f"no new group of {world} workers within {timeout:g} s (known {known}):\n{logs}")


@pytest.mark.timeout(240)
def test_nodes_join_and_leave_a_running_elastic_group(tmp_path: Path, forked: list[Forked]) -> None:
    """--nnodes 2:3: the group re-forms when a third node arrives, when it leaves on SIGTERM,
    and when one vanishes (its launcher SIGKILLed: only its beats stopping tell); none of these
    is a failure (the restart count stays 0). Then the last group of two runs RPC and all_reduce."""
    out = tmp_path / "out"
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    args += ["--rdzv-id", "grow", "--term-timeout", "5", "--max-restarts", "0"]
    args += ["--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    node_a = launch(forked, out, [*args, "--node-rank", "0"], "elastic", name="node_a")
    node_b = launch(forked, out, args, "elastic", name="node_b")
    started: set[int] = set()  # the pids of the workers of the rounds seen so far
    _new_group(out, 2, started, [node_a, node_b])
    node_c = launch(forked, out, args, "elastic", name="node_c")
    _new_group(out, 3, started, [node_a, node_b, node_c])
    os.kill(node_c.pid, signal.SIGTERM)
    assert node_c.wait(30) == 128 + signal.SIGTERM, node_c.output()[-4000:]
    _new_group(out, 2, started, [node_a, node_b, node_c])
    node_d = launch(forked, out, args, "elastic", name="node_d")
    _new_group(out, 3, started, [node_a, node_b, node_d])
    node_d.kill()  # SIGKILL: its worker dies with it, nobody is told
    _new_group(out, 2, started, [node_a, node_b])
    (out / "finish").write_text("2")
    assert node_a.wait(90) == 0, node_a.output()[-6000:] + node_b.output()[-4000:]
    assert node_b.wait(30) == 0, node_b.output()[-6000:]
    for rank in range(2):  # one worker per node: rank = node rank, local rank 0
        result = _json(out / f"rank{rank}.json")
        assert result["rpc_rank"] == result["pg_rank"] == rank and result["local_rank"] == 0
        assert result["rpc_world"] == result["pg_world"] == 2 and result["all_reduce"] == 3.0
    seen = [_json(path) for path in out.glob("seen.*.json")]
    assert {s["restart_count"] for s in seen} == {0}
    assert sorted(s["group_world_size"] for s in seen) == [2] * 6 + [3] * 6
    logs = node_a.output() + node_b.output()
    assert "re-forming the group" in logs and "a node asked to join the group" in logs
    assert "left the group (SIGTERM)" in logs and "stopped answering for over 3 s" in logs


# ============================================================================ no launcher
def _init_group(tmp_path: Path, forked: list[Forked], envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    for i, env in enumerate(envs):
        spec = {"what": "init", "out": str(out), "env": env, "log": str(tmp_path / f"p{i}.log")}
        procs.append(Forked(spec))
        forked.append(procs[-1])
    for proc in procs:
        assert proc.wait(40) == 0, proc.output()[-6000:]
    return [_json(out / f"rank{r}.json") for r in range(len(envs))]


def _assert_group_worked(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["rpc_rank"] == result["pg_rank"] == rank
        assert result["rpc_world"] == result["pg_world"] == 2
        assert result["all_reduce"] == 3.0 and result["is_launched"]
        assert result["local_rank"] == rank  # LOCAL_RANK, or SLURM_LOCALID


@pytest.mark.timeout(60)
def test_torchrun_environment_set_by_hand(tmp_path: Path, forked: list[Forked]) -> None:
    import torch.distributed as tdist

    port = free_port()
    agent_store = tdist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False
    )  # as torchrun's agent
    try:
        envs = [
            _base_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                GROUP_RANK="0",
                ROLE_RANK=str(r),
                ROLE_WORLD_SIZE="2",
                ROLE_NAME="default",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RUN_ID="by-hand",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_USE_AGENT_STORE="True",
            )
            for r in range(2)
        ]
        results = _init_group(tmp_path, forked, envs)
    finally:
        del agent_store
    _assert_group_worked(results)
    assert all(r["is_torchelastic_launched"] for r in results)


@pytest.mark.timeout(60)
def test_slurm_environment_set_by_hand(tmp_path: Path, forked: list[Forked]) -> None:
    port = free_port()
    envs = [
        _base_env(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_JOB_ID="42",
            SLURM_JOB_NODELIST="127.0.0.[1-2],othernode",
            MASTER_PORT=str(port),
        )
        for r in range(2)
    ]  # no RANK, WORLD_SIZE or MASTER_ADDR: they come from Slurm's variables
    results = _init_group(tmp_path, forked, envs)
    _assert_group_worked(results)
    assert not any(r["is_torchelastic_launched"] for r in results)


# ============================================================================ two nodes
@pytest.mark.timeout(90)
def test_two_nodes_meet_through_the_launchers_store(
    tmp_path: Path, forked: list[Forked], two_hosts: tuple[tuple[str, str], ...]
) -> None:
    """One launcher per network-namespace "host"; the one at the endpoint's address hosts the
    rendezvous; node ranks come from join order; the workers run RPC and all_reduce across."""
    (host_a, addr_a), (host_b, _) = two_hosts
    endpoint = f"{addr_a}:{free_port()}"
    out = tmp_path / "out"
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
    node_b = launch(forked, out, args, "rpc", name="node_b", netns=host_b)  # first: it waits for the host
    node_a = launch(forked, out, args, "rpc", name="node_a", netns=host_a)
    assert node_b.wait(75) == 0, node_b.output()[-6000:] + node_a.output()[-6000:]
    assert node_a.wait(20) == 0, node_a.output()[-6000:]
    results = [_json(out / f"rank{r}.json") for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rpc_world"] == result["pg_world"] == 2 and result["pg_rank"] == rank
        assert result["all_reduce"] == 3.0 and result["is_torchelastic_launched"]
    assert "hosting the rendezvous" in node_a.output()
    assert "hosting the rendezvous" not in node_b.output()


# ============================================================================ etcd rendezvous
@pytest.mark.timeout(90)
def test_two_launchers_meet_on_etcd(tmp_path: Path, forked: list[Forked], etcd_server: Any) -> None:
    """--rdzv-backend etcd: two launchers (one worker each) meet on a real etcd, not on a store
    one of them serves; the first to claim the run leads it; the workers run RPC and all_reduce."""
    out = tmp_path / "out"
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd"]
    args += ["--rdzv-endpoint", ",".join(etcd_server.endpoints), "--rdzv-id", f"etcd-{uuid.uuid4().hex[:8]}"]
    node_0 = launch(forked, out, args, "rpc", name="node_0")
    node_1 = launch(forked, out, args, "rpc", name="node_1")
    assert node_0.wait(75) == 0, node_0.output()[-6000:] + node_1.output()[-6000:]
    assert node_1.wait(20) == 0, node_1.output()[-6000:]
    results = [_json(out / f"rank{r}.json") for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rpc_world"] == result["pg_world"] == 2 and result["pg_rank"] == rank
        assert result["all_reduce"] == 3.0 and result["is_torchelastic_launched"]
    logs = [node_0.output(), node_1.output()]
    assert sum("leading the rendezvous" in log for log in logs) == 1, logs
    assert not any("hosting the rendezvous" in log for log in logs)
