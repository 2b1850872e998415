"""Memory for large received buffers, kept mapped after the tensors built over it are freed.

A tensor that arrives over a stream (gRPC, TCP, or a Unix socket below the shared-memory
threshold) is copied into memory of its own. Memory that large is often new to the process:
glibc maps every allocation of 32 MB or more afresh, and smaller ones too until a block of their
size has been freed (or after a heap was trimmed), and the copy then faults every page in. On
this VM a 64 MB copy took 32-49 ms into fresh memory and 7 ms into memory used before, and a
16 MB call over gRPC took 9 ms in one run and 20 ms in the next, depending on glibc's state.
So received buffers of ``WARM_MIN_BYTES`` or more come from here: each is a block that goes back
to a free list when the last tensor (or view) over it is freed, and the next message of about
that size reuses it, its pages still in place.

glibc raises its thresholds (mmap 32 MB, trim 64 MB) after freeing a block that large; blocks
kept here never are freed, and gRPC's 1 MB chunks then went to fresh mappings, or to a heap
trimmed after each, faulting their pages in at every chunk. So the first block made here sets
those thresholds where glibc's own rule would have put them (``mallopt``; glibc only).

At most ``RPCDIST_WARM_RECEIVE_MB`` (default 256; 0 turns the cache off) of free blocks are kept
per process; beyond that a freed block is given back to the system. Blocks in use are the
tensors' own memory and are not counted.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

WARM_MIN_BYTES = 4 << 20
"""Received buffers this large come from kept blocks."""

GLIBC_MMAP_MAX = 32 << 20
"""glibc's largest dynamic mmap threshold on 64-bit: an allocation this size never reuses memory."""

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3


def settle_glibc_thresholds() -> bool:
    """Set glibc's mmap and trim thresholds to where its dynamic rule puts them once a block of
    ``GLIBC_MMAP_MAX`` is freed; returns whether it did (False off glibc, or if refused)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_MAX) == 1
    done = mallopt(_M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_MAX) == 1 and done
    if not done:
        log.debug("glibc refused the mmap/trim thresholds")
    return done


def _keep_limit() -> int:
    raw = os.environ.get("RPCDIST_WARM_RECEIVE_MB", "256")
    try:
        megabytes = float(raw)
    except ValueError:
        raise ValueError(f"RPCDIST_WARM_RECEIVE_MB must be a number of megabytes, not {raw!r}") from None
    return max(0, int(megabytes * (1 << 20)))


def size_class(size: int) -> int:
    """The block size serving ``size`` bytes: ``size`` rounded up to a quarter of its power of
    two (at most 25 % more than asked, so blocks are shared by messages of similar sizes)."""
    step = max(1 << (size.bit_length() - 1) >> 2, 4096)
    return -(-size // step) * step


class OwnedMemory:
    """The owner of memory that tensors are built over (``np.asarray`` of it is their buffer;
    ``memory`` is kept alive meanwhile): when the last tensor or view using it is freed,
    ``on_free()`` runs, from whichever thread dropped it."""

    def __init__(self, memory: torch.Tensor, nbytes: int, on_free: Callable[[], None]) -> None:
        self._memory = memory
        self._on_free = on_free
        self.__array_interface__ = {
            "data": (memory.data_ptr(), False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        try:
            self._on_free()
        except Exception:  # noqa: BLE001 - at interpreter exit nobody is listening any more
            pass


class WarmBuffers:
    """Free blocks by size class, at most ``keep_bytes`` of them in all. Thread-safe: blocks
    come back from whichever thread frees the last tensor over them."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, collections.deque[torch.Tensor]] = {}
        self._free_bytes = 0
        # Re-entrant: a block can come back (its tensor freed by the garbage collector) while
        # this thread is inside take().
        self._lock = threading.RLock()
        self.reused = 0  # blocks handed out again (counted for tests and diagnostics)
        self._settled = False

    @property
    def free_bytes(self) -> int:
        """Bytes of free blocks kept mapped now."""
        return self._free_bytes

    def take(self, size: int) -> memoryview:
        """``size`` bytes of writable memory, 64-byte aligned, owned by the returned view (and
        by the tensors built over it)."""
        block_size = size_class(size)
        memory = None
        with self._lock:
            free = self._free.get(block_size)
            if free:
                memory = free.pop()
                self._free_bytes -= block_size
                self.reused += 1
        if memory is None:
            if not self._settled:
                self._settled = True
                settle_glibc_thresholds()
            memory = torch.empty(block_size, dtype=torch.uint8)
        return memoryview(np.asarray(OwnedMemory(memory, size, functools.partial(self._give_back, memory))))

    def _give_back(self, memory: torch.Tensor) -> None:
        block_size = memory.numel()
        with self._lock:
            if self._free_bytes + block_size > self.keep_bytes:
                return  # dropped: the allocator gives it back to the system
            self._free.setdefault(block_size, collections.deque()).append(memory)
            self._free_bytes += block_size

    def clear(self) -> None:
        """Give every free block back to the system."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


warm_buffers = WarmBuffers(_keep_limit())


def receive_buffer(size: int) -> memoryview:
    """Writable memory of its own for a received buffer of ``size`` bytes (64-byte aligned):
    a warm block from :data:`warm_buffers` when large and the cache is on, else fresh."""
    if size >= WARM_MIN_BYTES and warm_buffers.keep_bytes:
        return warm_buffers.take(size)
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy())
