"""Kept memory for large received buffers (rpcdist.transport.warm): a block is reused only
once every tensor over it is freed, the free ones stay within their bound, and blocks come
back from any thread."""

from __future__ import annotations

import gc
import platform
import threading

import pytest
import torch

from rpcdist.transport import warm

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20


def _tensor_over(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)  # as rebuild_tensor does


def test_size_classes_round_up_by_at_most_a_quarter() -> None:
    for size in (MB, MB + 1, 3 * MB - 7, 40 * MB, 64 * MB, 100 * MB + 12345):
        block = warm.size_class(size)
        assert size <= block <= size * 1.25 + 4096, (size, block)
        assert block % 4096 == 0
    assert warm.size_class(40 * MB) == warm.size_class(40 * MB - 100)  # similar sizes share


def test_a_block_is_reused_only_after_the_last_tensor_over_it_is_freed() -> None:
    pool = warm.WarmBuffers(keep_bytes=16 * MB)
    first = _tensor_over(pool.take(2 * MB))
    first.fill_(7)
    address = first.data_ptr()
    view_of_first = first[MB:]  # a view keeps the block too
    del first
    gc.collect()
    second = _tensor_over(pool.take(2 * MB))
    assert second.data_ptr() != address  # still in use by the view
    assert bool((view_of_first == 7).all())
    del view_of_first
    third = _tensor_over(pool.take(2 * MB))
    assert third.data_ptr() == address and pool.reused == 1
    third.fill_(1)
    assert bool((third == 1).all())


def test_free_blocks_stay_within_the_bound() -> None:
    pool = warm.WarmBuffers(keep_bytes=5 * MB)
    held = [pool.take(2 * MB) for _ in range(4)]
    del held
    assert pool.free_bytes <= 5 * MB and pool.free_bytes == 2 * warm.size_class(2 * MB)
    pool.clear()
    assert pool.free_bytes == 0


def test_a_pool_that_keeps_nothing_never_reuses() -> None:
    pool = warm.WarmBuffers(keep_bytes=0)
    for _ in range(3):
        _tensor_over(pool.take(2 * MB)).fill_(1)  # made, used and freed
    assert pool.reused == 0 and pool.free_bytes == 0


def test_blocks_come_back_from_other_threads() -> None:
    pool = warm.WarmBuffers(keep_bytes=64 * MB)
    tensors = [_tensor_over(pool.take(MB)) for _ in range(8)]
    addresses = {t.data_ptr() for t in tensors}

    def drop() -> None:
        while tensors:
            tensors.pop()

    worker = threading.Thread(target=drop)
    worker.start()
    worker.join()
    again = [_tensor_over(pool.take(MB)) for _ in range(8)]
    assert {t.data_ptr() for t in again} == addresses and pool.reused == 8


def test_received_buffers_below_the_threshold_are_fresh_memory() -> None:
    before = warm.warm_buffers.reused
    for _ in range(3):
        view = warm.receive_buffer(2 * MB)
        assert len(view) == 2 * MB and not view.readonly
        del view
    assert warm.warm_buffers.reused == before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_thresholds_are_settled() -> None:
    assert warm.settle_glibc_thresholds() is True
