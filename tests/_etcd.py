"""Real etcd servers for the tests: one member, or a cluster of three, on ephemeral ports.

Debian's ``etcd-server`` package provides ``/usr/bin/etcd`` (``.ci/run`` installs it); without
it the tests that need etcd skip, saying so. Each member runs in a temporary data directory
with its log in that directory (shown when it fails to start)::

    with EtcdCluster(tmp_path, size=3) as cluster:
        cluster.endpoints          # ["127.0.0.1:port", ...]
        cluster.kill(0)            # SIGKILL one member
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from _harness import free_port

HOST = "127.0.0.1"
ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
START_TIMEOUT = 60.0


def unavailable() -> str | None:
    """Why etcd cannot be run here, or None."""
    if ETCD is None:
        return "etcd is not installed (Debian's etcd-server package; .ci/run installs it as root)"
    return None


def _free_ports(count: int) -> list[int]:
    """Distinct ports that were free a moment ago (outside the kernel's ephemeral range: see
    ``_harness.free_port``)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1, started together as one new cluster."""

    def __init__(self, workdir: Path, size: int = 1) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.size = size
        self.procs: list[subprocess.Popen[bytes] | None] = []
        ports = _free_ports(2 * size)
        self.client_ports = ports[:size]
        self.peer_ports = ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.endpoints = [f"{HOST}:{p}" for p in self.client_ports]

    @property
    def url_hosts(self) -> str:
        """The endpoints as an etcd:// URL's host part."""
        return ",".join(self.endpoints)

    def _log(self, i: int) -> Path:
        return self.workdir / f"etcd-{self.names[i]}.log"

    def start(self) -> EtcdCluster:
        initial = ",".join(f"{n}=http://{HOST}:{p}" for n, p in zip(self.names, self.peer_ports, strict=True))
        token = f"rpcdist-test-{self.client_ports[0]}"
        for i, name in enumerate(self.names):
            client = f"http://{HOST}:{self.client_ports[i]}"
            peer = f"http://{HOST}:{self.peer_ports[i]}"
            command = [
                str(ETCD),
                f"--name={name}",
                f"--data-dir={self.workdir / ('etcd-' + name)}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster={initial}",
                f"--initial-cluster-token={token}",
                "--initial-cluster-state=new",
                # Elections as fast as a loaded test machine allows without flapping.
                "--heartbeat-interval=100",
                "--election-timeout=1000",
                "--log-level=warn",
                "--logger=zap",
            ]
            with open(self._log(i), "wb") as log:
                self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until every running member answers etcd's health check (the cluster has a leader)."""
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"etcd {self.names[i]} exited with {proc.returncode}:\n{self.log(i)}")
                try:
                    with urllib.request.urlopen(f"http://{self.endpoints[i]}/health", timeout=2) as answer:
                        if b'"true"' in answer.read():
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd {self.names[i]} not healthy within {timeout:g} s:\n{self.log(i)}"
                    )
                time.sleep(0.1)

    def _post(self, i: int, path: str, body: dict[str, object]) -> dict[str, object]:
        """A call of etcd's JSON gateway on member ``i``."""
        request = urllib.request.Request(f"http://{self.endpoints[i]}{path}", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    def leader(self) -> int:
        """The index of the member that leads the cluster now."""
        for i, proc in enumerate(self.procs):
            if proc is not None:
                status = self._post(i, "/v3/maintenance/status", {})
                leader = str(status["leader"])
                members = self._post(i, "/v3/cluster/member/list", {})["members"]
                names = {str(m["ID"]): m["name"] for m in members}  # type: ignore[index]
                return self.names.index(names[leader])
        raise RuntimeError("no etcd member is running")

    def count_keys(self, prefix: str) -> int:
        """How many keys start with ``prefix`` (read from any running member)."""
        key = prefix.encode()
        end = key[:-1] + bytes([key[-1] + 1])
        body = {"key": base64.b64encode(key).decode(), "range_end": base64.b64encode(end).decode()}
        i = next(i for i, proc in enumerate(self.procs) if proc is not None)
        return int(self._post(i, "/v3/kv/range", {**body, "count_only": True}).get("count", 0))  # type: ignore[arg-type]

    def log(self, i: int) -> str:
        try:
            return self._log(i).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (as a host that vanishes: no goodbye to the others)."""
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            self.procs[i] = None

    def stop(self) -> None:
        """Kill every member: their data is a test's, nothing needs a clean shutdown (which, with
        a member gone, takes etcd seconds)."""
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
