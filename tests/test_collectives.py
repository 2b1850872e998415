"""The c10d collectives (``import rpcdist as dist``): every collective on worlds of 2, 3 and 4
ranks, every dtype and applicable ReduceOp, tiny, ring-sized and 64 MiB tensors, object
collectives, barriers, sub-groups, async ops (blocking threads and asyncio), errors, timeouts,
the init methods, and c10d next to RPC in one process.

Launches (scenarios in ``c10d_scenarios``; checks named from the tables in ``c10d_functions``):
``c10d_collectives`` once per world size (2 over tcp://, 3 over env://, 4 over file://; 64 MiB
cases on 2 and 3 only), ``c10d_errors``, ``c10d_timeouts`` and ``c10d_asyncio`` on 3 ranks,
``c10d_init`` on 2 ranks per init method, ``c10d_with_rpc`` on 2 ranks per set-up order.
Every rank computes the expected result of every check itself, from every rank's inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from _harness import GroupRun
from c10d_functions import (
    DATA_MOVEMENT,
    DTYPES,
    OBJECT_COLLECTIVES,
    REDUCTIONS,
    RING_CASES,
    TINY,
    assert_checks,
    launch,
    reduction_checks,
)

pytestmark = pytest.mark.timeout(300)  # the first test of a launch waits for it

WORLDS = (2, 3, 4)
SUITE_INIT = {2: "tcp", 3: "env", 4: "file"}
LARGE_WORLDS = (2, 3)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], GroupRun]:
    """The ``c10d_collectives`` run of a world size, launched the first time it is asked for."""
    runs: dict[int, GroupRun] = {}

    def get(world: int) -> GroupRun:
        if world not in runs:
            runs[world] = launch(
                tmp_path_factory.mktemp(f"c10d_world{world}"),
                "c10d_collectives",
                world,
                SUITE_INIT[world],
                params={"large": world in LARGE_WORLDS},
                timeout=270,
            )
        return runs[world]

    return get


def _all(run: GroupRun, world: int, *names: str) -> None:
    assert_checks(run, list(names), range(world))


# ============================================================================ 1. collectives
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("collective", REDUCTIONS)
@pytest.mark.parametrize("world", WORLDS)
def test_reduction(suite: Callable[[int], GroupRun], world: int, collective: str, dtype: str) -> None:
    """Every ReduceOp that applies to the dtype (bitwise on int/bool, AVG on floats)."""
    _all(suite(world), world, *reduction_checks(collective, dtype))


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_ring_path(suite: Callable[[int], GroupRun], world: int) -> None:
    _all(suite(world), world, *(f"ring/{dtype}/{op}" for dtype, op in RING_CASES))


@pytest.mark.parametrize(
    "name", ["all_reduce/legacy_reduce_op", "all_reduce/default_op_is_sum", "all_reduce/contiguous_view"]
)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_details(suite: Callable[[int], GroupRun], world: int, name: str) -> None:
    _all(suite(world), world, name)


@pytest.mark.parametrize("collective", DATA_MOVEMENT)
@pytest.mark.parametrize("world", WORLDS)
def test_data_movement(suite: Callable[[int], GroupRun], world: int, collective: str) -> None:
    """Every dtype; the root (src/dst) rotates over the ranks from dtype to dtype."""
    _all(suite(world), world, *(f"{collective}/{dtype}" for dtype in DTYPES))


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_single_zero_splits(suite: Callable[[int], GroupRun], world: int) -> None:
    _all(suite(world), world, "all_to_all_single/zero_splits")


@pytest.mark.parametrize("collective", TINY)
@pytest.mark.parametrize("world", WORLDS)
def test_one_element_tensors(suite: Callable[[int], GroupRun], world: int, collective: str) -> None:
    _all(suite(world), world, f"tiny/{collective}")


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
@pytest.mark.parametrize("world", LARGE_WORLDS)
def test_64_mib(suite: Callable[[int], GroupRun], world: int, collective: str) -> None:
    _all(suite(world), world, f"large/{collective}")


@pytest.mark.parametrize("collective", OBJECT_COLLECTIVES)
@pytest.mark.parametrize("world", WORLDS)
def test_object_collectives(suite: Callable[[int], GroupRun], world: int, collective: str) -> None:
    _all(suite(world), world, collective)


@pytest.mark.parametrize(
    "name", ["barrier", "barrier/async_op", "monitored_barrier", "monitored_barrier/wait_all_ranks"]
)
@pytest.mark.parametrize("world", WORLDS)
def test_barriers(suite: Callable[[int], GroupRun], world: int, name: str) -> None:
    """Rank 0 arrives late; no rank leaves the barrier before it arrived."""
    _all(suite(world), world, name)


# ============================================================================ 2. sub-groups
@pytest.mark.parametrize(
    "name",
    [
        "rank_and_size",
        "all_reduce",
        "non_member_call_warns_and_skips",
        "global_ranks_as_src_dst",
        "dst_outside_group_raises",
        "concurrent_async",
        "interleaved_with_world",
        "members_only_barrier",
        "new_group_bad_rank_raises",
        "world_still_in_step",
    ],
)
@pytest.mark.parametrize("world", (3, 4))
def test_sub_groups(suite: Callable[[int], GroupRun], world: int, name: str) -> None:
    _all(suite(world), world, f"groups/{name}")


# ============================================================================ 3. async ops
@pytest.mark.parametrize("name", ["interleaved", "pending_until_peer_joins", "get_future", "many_in_flight"])
@pytest.mark.parametrize("world", WORLDS)
def test_async_ops(suite: Callable[[int], GroupRun], world: int, name: str) -> None:
    _all(suite(world), world, f"async/{name}")


@pytest.mark.parametrize("world", WORLDS)
def test_suite_clean_exit(suite: Callable[[int], GroupRun], world: int) -> None:
    run = suite(world)
    _all(run, world, "destroyed")
    run.assert_clean_exit()


@pytest.fixture(scope="module")
def aio(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return launch(tmp_path_factory.mktemp("c10d_asyncio"), "c10d_asyncio", 3, "env", timeout=150)


@pytest.mark.parametrize(
    "name",
    [
        "await_all_reduce",
        "several_started_then_awaited",
        "p2p_ring",
        "loop_runs_while_pending",
        "blocking_api_from_worker_thread",
        "blocking_destroy_refused",
        "blocking_call_refused",
        "destroyed",
    ],
)
def test_asyncio(aio: GroupRun, name: str) -> None:
    """init_process_group_async inside asyncio.run; every op started with async_op=True and
    awaited."""
    _all(aio, 3, f"asyncio/{name}")


def test_asyncio_destroy_async_is_exported(aio: GroupRun) -> None:
    """``dist.destroy_process_group_async``, the counterpart of ``init_process_group_async``."""
    _all(aio, 3, "asyncio/destroy_async_exported")


def test_asyncio_refused_blocking_call_keeps_ranks_in_step(aio: GroupRun) -> None:
    """Rank 0's blocking all_reduce on the loop was refused: it must not count as a collective."""
    _all(aio, 3, "asyncio/in_step_after_refused_call")


def test_asyncio_clean_exit(aio: GroupRun) -> None:
    aio.assert_clean_exit()


# ============================================================================ 5. errors
@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return launch(tmp_path_factory.mktemp("c10d_errors"), "c10d_errors", 3, "env", timeout=150)


@pytest.mark.parametrize(
    "name",
    [
        "bitwise_on_float",
        "rank_outside_group",
        "non_contiguous",
        "in_step_after_local_errors",
        "shape_mismatch",
        "dtype_mismatch",
        "mismatch_in_work",
        "ring_shape_mismatch",
        "collective_mismatch_everyone_receives",
        "usable_after",
    ],
)
def test_errors(errors: GroupRun, name: str) -> None:
    _all(errors, 3, f"errors/{name}")


def test_collective_mismatch(errors: GroupRun) -> None:
    """Rank 1 calls all_reduce while ranks 0 and 2 broadcast: rank 1 gets an error naming both
    collectives (the broadcast source only sends, so it cannot tell)."""
    assert_checks(errors, ["errors/collective_mismatch"], [0, 1, 2])


def test_errors_clean_exit(errors: GroupRun) -> None:
    errors.assert_clean_exit()


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return launch(tmp_path_factory.mktemp("c10d_timeouts"), "c10d_timeouts", 3, "env", timeout=150)


@pytest.mark.parametrize(
    "name",
    [
        "recv",
        "all_reduce",
        "monitored_barrier",
        "monitored_barrier_names_every_missing_rank",
        "monitored_barrier_names_first_missing_rank",
        "world_usable_after",
    ],
)
def test_timeouts(timeouts: GroupRun, name: str) -> None:
    """A process group with timeout=3 s: operations whose peer never comes fail (no hang)."""
    _all(timeouts, 3, f"timeout/{name}")


def test_timeouts_clean_exit(timeouts: GroupRun) -> None:
    timeouts.assert_clean_exit()


# ============================================================================ 6. init methods
@pytest.mark.parametrize("init", ["env", "tcp", "file", "env_vars_only"])
def test_init_methods(tmp_path_factory: pytest.TempPathFactory, init: str) -> None:
    """init_process_group("gloo", init_method=...) with each init method (and, last, with
    nothing but MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment)."""
    from_env = init == "env_vars_only"
    run = launch(
        tmp_path_factory.mktemp(f"c10d_init_{init}"),
        "c10d_init",
        2,
        "env" if from_env else init,
        params={"from_env": from_env},
        timeout=120,
    )
    _all(run, 2, "init", "state", "all_reduce", "send_recv", "destroyed")
    run.assert_clean_exit()


@pytest.mark.parametrize("order", ["pg_first", "rpc_first"])
def test_with_rpc_in_same_process(tmp_path_factory: pytest.TempPathFactory, order: str) -> None:
    """init_process_group and init_rpc in one process: an rpc_sync, an all_reduce, both at once,
    both shut down (the first one set up is shut down last)."""
    run = launch(
        tmp_path_factory.mktemp(f"c10d_rpc_{order}"), "c10d_with_rpc", 2, "env", params={"order": order}
    )
    _all(run, 2, "init_both", "rpc_sync", "all_reduce", "both_in_flight", "shut_down_both")
    run.assert_clean_exit()


# ============================================================================ 8. exit at once
# What the programs below share: a link made slow on purpose, and a launcher of ``world``
# processes that runs ``run(rank, *argv[2:])`` with MASTER_PORT=argv[1] and exits non-zero if any
# of them failed.
_PROGRAM_PRELUDE = r"""
import asyncio, os, sys, time
from datetime import timedelta

import torch
from torch.multiprocessing import Process

import rpcdist as dist
from rpcdist.transport.writer import FrameWriter


def slow_link(seconds):
    # Every frame this process writes from now on leaves ``seconds`` late: all go through the
    # writer task (none at once on the loop), which waits before each.
    original = FrameWriter._write_batch

    async def delayed(self, messages):
        await asyncio.sleep(seconds)
        return await original(self, messages)

    def to_the_task(self):
        self._flush_due = False
        self._wake.set()

    FrameWriter._write_batch = delayed
    FrameWriter._flush = to_the_task


def launch(world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    processes = [Process(target=run, args=(rank, *sys.argv[2:])) for rank in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    sys.exit(max(abs(p.exitcode) if p.exitcode is not None else 99 for p in processes))
"""


def _run_program(tmp_path: Path, name: str, body: str, *args: str) -> tuple[str, str]:
    """Run the prelude plus ``body`` as a script (a free port first, then ``args``); returns its
    stdout and the report to fail with. Fails the test unless it exits 0."""
    import subprocess
    import sys

    from _harness import free_port

    script = tmp_path / f"{name}.py"
    script.write_text(_PROGRAM_PRELUDE + body)
    command = [sys.executable, str(script), str(free_port()), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    return proc.stdout, report


EXIT_AFTER_COLLECTIVE = r"""
def run(rank, op):
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=30))
    tensor = torch.full((4,), float(rank + 1))
    if rank == 0:
        time.sleep(1.0)  # the others' messages are here first: rank 0's collective needs no wait
        slow_link(0.3)  # ... and its own leave on a slow link
    if op == "all_reduce":
        dist.all_reduce(tensor)
    elif op == "barrier":
        dist.barrier()
    else:
        dist.broadcast(tensor, src=0)
    sys.stdout.write(f"rank {rank} {op} {tensor.tolist()}\n")  # one write: the ranks share a pipe
    sys.stdout.flush()
    # No destroy_process_group(): the process ends here, as a tutorial's does.


if __name__ == "__main__":
    launch(3)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["all_reduce", "barrier", "broadcast"])
def test_a_rank_exiting_right_after_a_collective_loses_nothing(tmp_path: Path, op: str) -> None:
    """A rank returns from its last collective and its process ends at once (no
    destroy_process_group, as in the tutorials): the messages that collective sent still
    reach the other ranks. (A small collective's messages are one-way notices; the collective
    returns only once they are written.)"""
    stdout, report = _run_program(tmp_path, "exit_after_collective", EXIT_AFTER_COLLECTIVE, op)
    expected = {"all_reduce": [6.0] * 4, "barrier": None, "broadcast": [1.0] * 4}[op]
    for rank in range(3):
        found = re.search(rf"rank {rank} {op} (\[[^\]]*\])", stdout)
        assert found is not None, report
        if expected is not None:
            assert found.group(1) == str(expected), report


UNWRITTEN_NOTICE = r"""
def run(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=2))
    if rank == 0:
        slow_link(6.0)  # its messages stay unwritten past the group's timeout
    tensor = torch.full((4,), float(rank + 1))
    try:
        dist.broadcast(tensor, src=0)
        outcome = "returned"
    except dist.CollectiveTimeoutError as exc:
        outcome = f"timeout: {exc}"
    sys.stdout.write(f"rank {rank} {outcome}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    launch(2)
"""


@pytest.mark.timeout(120)
def test_a_collective_whose_messages_cannot_be_written_times_out(tmp_path: Path) -> None:
    """The wait for a collective's messages to be written is bounded by the group's timeout:
    a root whose link takes longer gets a CollectiveTimeoutError naming the peer (and its
    receiver one of its own), never a hang."""
    stdout, report = _run_program(tmp_path, "unwritten_notice", UNWRITTEN_NOTICE)
    unwritten = r"rank 0 timeout: broadcast .* rank\(s\) \[1\] were not written within 2 s"
    assert re.search(unwritten, stdout), report
    assert re.search(r"rank 1 timeout: .*no message from rank 0 within 2 s", stdout), report
