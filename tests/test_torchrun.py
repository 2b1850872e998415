"""rpcdist programs under torch's own launcher (``python -m torch.distributed.run``), with no
extra flag: the elastic agent's TCPStore on MASTER_PORT is used, not fought over.

Three launches: ``--standalone``; the c10d rendezvous backend on one host; and two "hosts" as
network namespaces joined by a veth pair, each with a private /dev/shm (so nothing is shared
between them but the network), one torchrun per namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import free_port

pytestmark = pytest.mark.timeout(240)

PROGRAM = Path(__file__).with_name("torchrun_program.py")
LAUNCH_TIMEOUT = 150


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _results(out: Path, world: int) -> list[dict]:
    found = sorted(out.glob("rank*.json"))
    assert len(found) == world, f"ranks that finished: {[p.name for p in found]}"
    return [json.loads(p.read_text()) for p in found]


def _assert_worked(results: list[dict], world: int) -> None:
    for r in results:
        rank = r["rank"]
        peer = (rank + 1) % world
        assert r["world"] == world
        assert r["agent_store"] == "True", "torchrun did not run this program with its agent store"
        assert r["rpc"] == float((peer + 2) ** 2) or r["rpc"] == float((rank + 2) ** 2), r
        assert r["all_reduce"] == sum(range(1, world + 1)), r


def _torchrun(args: list[str], out: Path, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    command = [*(prefix or []), sys.executable, "-m", "torch.distributed.run", *args, str(PROGRAM), str(out)]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=LAUNCH_TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, log in zip(procs, logs, strict=False):
        assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{log[-4000:]}"
    return logs


def test_standalone_two_workers(tmp_path: Path) -> None:
    _finish([_torchrun(["--standalone", "--nproc-per-node", "2"], tmp_path)])
    results = _results(tmp_path, 2)
    _assert_worked(results, 2)
    assert all(r["peer_colocated"] for r in results)  # one host: Unix socket and shared memory


def test_c10d_rendezvous_on_one_host(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    _finish([_torchrun([*args, "--rdzv-id", "one-host"], tmp_path)])
    _assert_worked(_results(tmp_path, 2), 2)


def test_two_hosts_in_network_namespaces(tmp_path: Path, two_hosts: tuple[tuple[str, str], ...]) -> None:
    (host_a, addr_a), (host_b, addr_b) = two_hosts
    endpoint = f"{addr_a}:{free_port()}"
    procs = []
    for i, (name, address) in enumerate(two_hosts):
        # Each "host" gets its own /dev/shm, so co-location cannot be mistaken across them.
        prefix = [
            "ip",
            "netns",
            "exec",
            name,
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
            "sh",
        ]
        args = [
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "two-hosts", "--rdzv-conf", f"is_host={1 if i == 0 else 0}", "--local-addr", address,
        ]  # fmt: skip
        procs.append(_torchrun(args, tmp_path, prefix))
    _finish(procs)
    results = _results(tmp_path, 2)
    _assert_worked(results, 2)
    assert not any(r["peer_colocated"] for r in results), "namespaced hosts must talk over the network"
