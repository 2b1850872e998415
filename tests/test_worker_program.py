"""The rpcdist-worker program: serving imported functions, stopping on request or on a signal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import worker_functions as wf
from _harness import free_port

import rpcdist.rpc as rpc
from rpcdist.programs import worker as worker_program

HOST = "127.0.0.1"
TESTS_DIR = Path(__file__).resolve().parent
WAIT = 60.0  # seconds any one step may take (workers import torch at start-up)


# -- helpers -----------------------------------------------------------------------------------
def worker_command() -> list[str]:
    script = Path(sys.executable).with_name("rpcdist-worker")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "rpcdist.programs.worker"]


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, text: str, stream: str = "stdout", timeout: float = WAIT) -> None:
        """Wait until ``text`` appears in the worker's stdout (or stderr)."""
        path = self.out if stream == "stdout" else self.err
        deadline = time.monotonic() + timeout
        while text not in path.read_text():
            if self.proc.poll() is not None and text not in path.read_text():
                raise AssertionError(
                    f"worker exited ({self.proc.returncode}) before printing {text!r}:\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"worker did not print {text!r} in {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)

    def exit_code(self, timeout: float = WAIT) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker still running after {timeout} s:\n{self.stderr()}") from None


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator:
    """Starts rpcdist-worker processes (tests/ is on their PYTHONPATH); kills any left at the end."""
    workers: list[Worker] = []

    def start(*args: str, extra_path: Path | None = None) -> Worker:
        index = len(workers)
        out, err = tmp_path / f"worker{index}.out", tmp_path / f"worker{index}.err"
        path = [str(p) for p in (extra_path, TESTS_DIR) if p] + [os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen([*worker_command(), *args], stdout=stdout, stderr=stderr, env=env)
        worker = Worker(proc, out, err)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(10)


def group_args(name: str, rank: int, world_size: int, port: int, *extra: str) -> list[str]:
    return [
        "--name", name, "--rank", str(rank), "--world-size", str(world_size),
        "--init-method", f"tcp://{HOST}:{port}", "--import", "worker_functions", *extra,
    ]  # fmt: skip


def join_as_driver(world_size: int, port: int, rank: int = 0) -> None:
    """Join the group (rank 0 hosts the store); the caller must call rpc.shutdown() in a finally."""
    options = rpc.RpcBackendOptions(init_method=f"tcp://{HOST}:{port}", rpc_timeout=30, store_timeout=WAIT)
    rpc.init_rpc("driver", rank=rank, world_size=world_size, rpc_backend_options=options)


# -- serving calls -----------------------------------------------------------------------------
def test_workers_serve_imported_functions_and_stop_on_request(start_worker) -> None:
    port = free_port()
    workers = {
        name: start_worker(*group_args(name, rank, 3, port)) for rank, name in ((1, "alice"), (2, "bob"))
    }
    try:
        join_as_driver(3, port)
        for name, worker in workers.items():
            worker.wait_for(f"rpcdist-worker {name} (rank {1 if name == 'alice' else 2}/3) ready")

        # Each call really runs in the worker process, as that worker.
        for rank, (name, worker) in enumerate(workers.items(), start=1):
            assert rpc.rpc_sync(name, wf.whoami) == (name, rank, worker.proc.pid)

        assert torch.equal(
            rpc.rpc_sync("alice", wf.scale, args=(torch.arange(4.0), 2.5)), torch.arange(4.0) * 2.5
        )
        futures = [
            rpc.rpc_async(name, wf.delayed_sum, args=([1, 2, i], 0.05)) for i in range(4) for name in workers
        ]
        assert [f.wait() for f in futures] == [3 + i for i in range(4) for _ in workers]
        assert rpc.rpc_sync("bob", wf.relay, args=("alice", [4, 5])) == 9  # bob calls alice

        counter = rpc.remote("bob", wf.Counter, args=(10,))
        assert counter.rpc_sync().add(5) == 15
        assert counter.to_here().value == 15

        with pytest.raises(ValueError, match="no good") as caught:
            rpc.rpc_sync("alice", wf.fail, args=("no good",))
        assert caught.value.remote_worker == "alice"

        for name in workers:
            assert rpc.rpc_sync(name, worker_program.request_stop) is None
    finally:
        rpc.shutdown()  # with the workers asked to stop, the shutdown barrier completes
    for name, worker in workers.items():
        assert worker.exit_code() == 0, worker.stderr()
        assert "stop requested by a peer" in worker.stderr()
        assert f"{name} stopped" in worker.stderr()


def test_worker_hosting_the_store_stops_on_request(start_worker) -> None:
    port = free_port()
    worker = start_worker(*group_args("host", 0, 2, port))
    try:
        join_as_driver(2, port, rank=1)  # rank 1: the worker program (rank 0) serves the store
        # At once, without waiting for "ready": the worker may still be finishing its own join.
        assert rpc.rpc_sync(0, wf.delayed_sum, args=([1, 1], 0.0)) == 2
        rpc.rpc_sync("host", worker_program.request_stop)
    finally:
        rpc.shutdown()
    assert worker.exit_code() == 0, worker.stderr()
    assert "rpcdist-worker host (rank 0/2) ready" in worker.stdout()
    assert "barrier failed" not in worker.stderr()


def test_request_stop_outside_a_worker_program_raises() -> None:
    with pytest.raises(RuntimeError, match="not one"):
        asyncio.run(worker_program.request_stop())


# -- signals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lone_worker_exits_0_on_signal(start_worker, sig: int) -> None:
    worker = start_worker(*group_args("solo", 0, 1, free_port()))
    worker.wait_for("rpcdist-worker solo (rank 0/1) ready")
    worker.proc.send_signal(sig)
    assert worker.exit_code() == 0, worker.stderr()
    assert f"{signal.Signals(sig).name} received" in worker.stderr()


def test_sigterm_leaves_the_group_with_the_driver(start_worker) -> None:
    port = free_port()
    worker = start_worker(*group_args("w1", 1, 2, port, "--rpc-timeout", "0.5"))
    try:
        join_as_driver(2, port)
        worker.wait_for("rpcdist-worker w1 (rank 1/2) ready")
        assert rpc.rpc_sync("w1", wf.scale, args=(torch.ones(2), 3.0)).tolist() == [3.0, 3.0]
        with pytest.raises(TimeoutError, match="timed out after 0.5 s"):  # the worker's --rpc-timeout
            rpc.rpc_sync("w1", wf.sleep_on, args=("driver", 2.0))
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_for("w1 leaving the group", stream="stderr")
    finally:
        rpc.shutdown()
    assert worker.exit_code() == 0, worker.stderr()
    assert "shutdown barrier failed" not in worker.stderr()


def test_shutdown_after_sigterm_is_bounded_when_the_group_never_shuts_down(start_worker) -> None:
    port = free_port()
    worker = start_worker(*group_args("w1", 1, 2, port, "--shutdown-timeout", "1"))
    try:
        join_as_driver(2, port)
        worker.wait_for("rpcdist-worker w1 (rank 1/2) ready")
        worker.proc.send_signal(signal.SIGTERM)
        # The driver does not shut down, so the worker's barrier gives up after --shutdown-timeout.
        assert worker.exit_code(timeout=30) == 0, worker.stderr()
        assert "shutdown barrier failed" in worker.stderr()
    finally:
        rpc.shutdown()


def test_sigterm_before_the_group_forms_exits_0(start_worker) -> None:
    worker = start_worker(*group_args("early", 0, 2, free_port()))
    worker.wait_for("serves the store", stream="stderr")  # joining, waiting for rank 1
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.exit_code() == 0, worker.stderr()
    assert "stopped before the group had formed" in worker.stderr()
    assert "ready" not in worker.stdout()


# -- the command line --------------------------------------------------------------------------
def test_unknown_import_exits_2_with_a_clear_message(start_worker) -> None:
    worker = start_worker(*group_args("w", 0, 1, free_port()), "--import", "no_such_module_for_rpcdist")
    assert worker.exit_code() == 2
    err = worker.stderr()
    assert "cannot import --import module 'no_such_module_for_rpcdist'" in err
    assert "ModuleNotFoundError" in err
    assert "Traceback" not in err
    assert worker.stdout() == ""


def test_module_failing_at_import_exits_2_with_its_traceback(start_worker, tmp_path: Path) -> None:
    (tmp_path / "broken_functions.py").write_text("raise RuntimeError('config file missing')\n")
    worker = start_worker(
        *group_args("w", 0, 1, free_port()), "--import", "broken_functions", extra_path=tmp_path
    )
    assert worker.exit_code() == 2
    err = worker.stderr()
    assert "Traceback" in err
    assert "cannot import --import module 'broken_functions': RuntimeError: config file missing" in err


def test_help_via_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rpcdist.programs.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for option in ("--name", "--rank", "--world-size", "--init-method", "--import", "--rpc-timeout"):
        assert option in proc.stdout
