"""Shared-memory slots (rpcdist.transport.shm): what a sender lends is what a receiver reads,
byte for byte, however large, and slots are reused once given back."""

from __future__ import annotations

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
