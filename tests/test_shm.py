"""Shared-memory slots (rpcdist.transport.shm): what a sender lends is what a receiver reads,
byte for byte, however large, and slots are reused once given back."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from rpcdist.transport import shm

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
]


@pytest.fixture
def pool():
    slots = shm.SlotPool()
    yield slots
    slots.close()


@pytest.mark.parametrize("nbytes", [1, 4097, 1 << 20, (1 << 20) + 3, 40 << 20])
def test_lent_bytes_arrive_exactly(pool: shm.SlotPool, nbytes: int) -> None:
    # 40 MB takes the receiver's page-fault-bound copy path, the others one memcpy.
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    slot = pool.lend(1, data)
    received = shm.borrowings.copy(slot.name, nbytes)
    assert torch.equal(torch.frombuffer(received, dtype=torch.uint8), data)
    data[0] ^= 0xFF  # the receiver's copy is its own
    assert torch.frombuffer(received, dtype=torch.uint8)[0] != data[0]


def test_a_slot_is_reused_only_once_given_back(pool: shm.SlotPool) -> None:
    first = pool.lend(1, torch.full((1000,), 7, dtype=torch.uint8))
    second = pool.lend(1, torch.full((1000,), 8, dtype=torch.uint8))
    assert second.name != first.name  # the first is still out
    assert shm.borrowings.copy(first.name, 1000).tobytes() == bytes([7]) * 1000
    pool.give_back(1, first)
    third = pool.lend(1, torch.full((10,), 9, dtype=torch.uint8))
    assert third.name == first.name
    assert shm.borrowings.copy(third.name, 10).tobytes() == bytes([9]) * 10


def test_lend_takes_a_memoryview(pool: shm.SlotPool) -> None:
    payload = bytearray(range(256)) * 5000
    slot = pool.lend(2, memoryview(payload))
    assert shm.borrowings.copy(slot.name, len(payload)).tobytes() == bytes(payload)


def test_copy_bytes_refuses_a_copy_that_does_not_fit() -> None:
    dest = torch.zeros(8, dtype=torch.uint8)
    source = torch.arange(16, dtype=torch.uint8)
    shm.copy_bytes(dest, source, 8)
    assert dest.tolist() == list(range(8))
    with pytest.raises(ValueError, match="does not fit"):
        shm.copy_bytes(dest, source, 16)
    with pytest.raises(ValueError, match="does not fit"):
        shm.copy_bytes(source, dest, 9)
    assert dest.tolist() == list(range(8))  # nothing written by a refused copy


def test_a_given_slot_comes_back_only_from_its_holder(pool: shm.SlotPool) -> None:
    slot = pool.give(1, torch.full((100,), 3, dtype=torch.uint8))
    assert pool.given == 1
    pool.returned(2, [slot.name])  # another peer cannot hand it back
    assert pool.given == 1
    assert pool.lend(1, torch.zeros(10, dtype=torch.uint8)).name != slot.name  # still out
    pool.returned(1, [slot.name, "rpcdist-slot-unknown-1048576"])
    assert pool.given == 0
    assert pool.lend(1, torch.zeros(10, dtype=torch.uint8)).name == slot.name


def test_slots_given_to_a_lost_peer_are_never_reused(pool: shm.SlotPool) -> None:
    slot = pool.give(5, torch.zeros(10, dtype=torch.uint8))
    pool.drop_given(5)
    assert pool.given == 0
    assert shm.borrowings.copy(slot.name, 10).tobytes() == bytes(10)  # still there to be read
    pool.returned(5, [slot.name])  # a late notice changes nothing
    assert pool.lend(5, torch.zeros(10, dtype=torch.uint8)).name != slot.name


def test_a_kept_slot_goes_back_when_the_last_tensor_using_it_is_freed(pool: shm.SlotPool) -> None:
    nbytes = 4 << 20
    data = torch.arange(nbytes // 4, dtype=torch.int32)
    slot = pool.give(1, data.view(torch.uint8))
    released: list[str] = []
    kept = torch.frombuffer(shm.borrowings.keep(slot.name, nbytes, released.append), dtype=torch.int32)
    assert torch.equal(kept, data)
    slot.memory[:4].fill_(0xFF)  # the sender's bytes themselves, not a copy of them
    assert kept[0].item() == -1
    view = kept[10:20]
    del kept
    assert released == []  # a view still uses the memory
    assert view.tolist() == list(range(10, 20))
    del view
    assert released == [slot.name]


# ------------------------------------------------------------------------------------------------
# What a worker leaves in /dev/shm: removed at its exit, or swept by the next one if it was killed
# ------------------------------------------------------------------------------------------------
_MAKER = """
import os, socket, sys, torch
from rpcdist.transport import shm
probe = shm.create_probe()
path = shm.socket_path()
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
pool = shm.SlotPool()  # (as a transport keeps it)
slot = pool.lend(1, torch.zeros(10, dtype=torch.uint8))  # never mapped by anyone
print(probe, path, slot.name, flush=True)
if sys.stdin.read() == "fork\\n":  # (else: killed, or told to clean up and exit)
    if os.fork() == 0:
        sys.exit(0)  # runs the child's exit handlers
    os.wait()
    kept = all(os.path.exists(os.path.join(shm.SHM_DIR, p)) for p in (probe, path, slot.name))
    print("child exited, entries kept" if kept else "child removed them", flush=True)
    sys.exit(0)  # without clean-up of its own: the exit handler's work
shm.remove_socket(path)
shm.remove([probe])
"""


def _start_maker() -> tuple[subprocess.Popen[str], list[str]]:
    """A process holding what a worker keeps in /dev/shm: a probe, a Unix socket (and its
    directory), a slot; returns it and the three paths."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    probe, socket_path, slot = proc.stdout.readline().split()  # type: ignore[union-attr]
    paths = [os.path.join(shm.SHM_DIR, probe), os.path.dirname(socket_path), os.path.join(shm.SHM_DIR, slot)]
    assert all(os.path.exists(p) for p in paths)
    return proc, paths


def _age(paths: list[str], seconds: float) -> None:
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then))


def test_what_a_killed_worker_left_is_swept() -> None:
    proc, paths = _start_maker()
    proc.kill()  # SIGKILL: nothing of its own clean-up runs
    proc.wait(10)
    assert all(os.path.exists(p) for p in paths)
    _age(paths, shm.STALE_AFTER_SECONDS + 5)
    removed = shm.sweep_stale()
    assert {os.path.basename(p) for p in paths} <= set(removed)
    assert not any(os.path.exists(p) for p in paths)


def test_a_live_workers_entries_and_young_ones_stay() -> None:
    proc, paths = _start_maker()
    killed, young = _start_maker()
    try:
        killed.kill()
        killed.wait(10)
        _age(paths, shm.STALE_AFTER_SECONDS + 5)  # old, but their maker lives
        removed = shm.sweep_stale()  # the killed one's entries are younger than the limit
        assert all(os.path.exists(p) for p in paths + young), removed
        proc.stdin.close()  # type: ignore[union-attr]
        assert proc.wait(10) == 0
        assert not any(os.path.exists(p) for p in paths)  # removed by their maker (its slot at exit)
    finally:
        proc.kill()
        _age(young, shm.STALE_AFTER_SECONDS + 5)
        shm.sweep_stale()
    assert not any(os.path.exists(p) for p in young)


def test_a_process_that_exits_without_closing_removes_its_entries() -> None:
    # A torch program ending without destroy_process_group: its transport never closes. A
    # child it forked (which inherits the table of entries) exits first and removes nothing.
    proc, paths = _start_maker()
    proc.stdin.write("fork\n")  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    assert proc.stdout.readline().strip() == "child exited, entries kept"  # type: ignore[union-attr]
    assert proc.wait(10) == 0
    assert not any(os.path.exists(p) for p in paths)


def _make_entries_and_return(queue: Any) -> None:
    pool = shm.SlotPool()
    slot = pool.lend(1, torch.zeros(10, dtype=torch.uint8))
    queue.put(
        [
            os.path.join(shm.SHM_DIR, shm.create_probe()),
            os.path.dirname(shm.socket_path()),
            os.path.join(shm.SHM_DIR, slot.name),
        ]
    )
    # returns: multiprocessing ends the child with os._exit (no atexit handlers)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_multiprocessing_child_removes_its_entries_at_exit(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_make_entries_and_return, args=(queue,))
    child.start()
    paths = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert not any(os.path.exists(p) for p in paths), [p for p in paths if os.path.exists(p)]
