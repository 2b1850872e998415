"""Shared-memory handoff of large buffers between workers on one host.

The sender writes a buffer into a new file under ``/dev/shm`` (one copy, done by the kernel)
and sends only its name; the receiver maps the file as the memory of the rebuilt tensor
(no copy) and unlinks it at once, so the memory lives exactly as long as that tensor.

For buffers that go back and forth (collectives, repeated calls) a sender can instead *lend*
them through reusable slots (:class:`SlotPool`): it copies into a warm mapping it keeps, the
receiver maps the slot once (:class:`Borrowings`) and copies out or reduces from it, and the
slot is reused once the receiver is done: no page allocation per message on either side.

Whether two workers share ``/dev/shm`` is tested, not guessed: each worker leaves a probe
file there and publishes its name; a peer is co-located when it can see that file (two
containers on one machine with private ``/dev/shm`` correctly come out as not co-located).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import secrets
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "rpcdist-"
_names = itertools.count()
# Unguessable by other processes (64 bits), so no one can predict (and pre-create) a name.
_session = secrets.token_hex(8)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def create_probe() -> str:
    """Leave a probe file in /dev/shm; returns its name ("" without /dev/shm)."""
    if not available():
        return ""
    name = f"{_PREFIX}probe-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        os.close(os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return ""
    return name


def sees_probe(name: str) -> bool:
    return bool(name) and os.path.exists(os.path.join(SHM_DIR, name))


def export(buffer: memoryview) -> str:
    """Copy ``buffer`` into a new shared-memory file; returns its name."""
    name = f"{_PREFIX}{os.getpid()}-{_session}-{next(_names)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], written)
    except BaseException:
        os.close(fd)
        remove([name])
        raise
    os.close(fd)
    return name


def adopt(name: str, size: int) -> memoryview:
    """Map the shared-memory file ``name`` as writable memory and unlink it.

    The returned view keeps the mapping alive; it is freed with the last object using it.
    """
    if "/" in name or not name.startswith(_PREFIX):
        raise ValueError(f"not an rpcdist shared-memory name: {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"shared buffer {name} holds {os.fstat(fd).st_size} bytes, expected {size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return memoryview(mapping)


def remove(names: Iterable[str]) -> None:
    """Delete shared-memory files a receiver never adopted (it unlinks the ones it did)."""
    for name in names:
        if name:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.debug("could not remove %s: %s", name, exc)


def socket_path() -> str:
    """A fresh path for this worker's Unix socket, next to the probe (same visibility), inside
    a new directory only this user can enter (mode 0700, unguessable name)."""
    directory = tempfile.mkdtemp(prefix=f"{_PREFIX}sock-", dir=SHM_DIR)
    return os.path.join(directory, "agent.sock")


def remove_socket(path: str) -> None:
    """Remove the socket and its private directory."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))


def copy_bytes(dest: torch.Tensor, source: torch.Tensor, nbytes: int) -> None:
    """Copy the first ``nbytes`` of contiguous ``source`` into contiguous ``dest``: one memcpy
    on this thread, the GIL released.

    Not ``Tensor.copy_``: that splits a large copy across the thread's OpenMP team, whose
    threads then spin-wait for the next parallel region. Two workers passing 16 MB tensors
    on a 2-core machine spent half of all CPU time spinning in libgomp that way (perf), and a
    16 MB call took 7.9 ms.
    """
    if nbytes > source.numel() * source.element_size() or nbytes > dest.numel() * dest.element_size():
        raise ValueError(f"copy of {nbytes} bytes does not fit its source or destination")
    ctypes.memmove(dest.data_ptr(), source.data_ptr(), nbytes)


_SLOT_PREFIX = f"{_PREFIX}slot-"
# glibc's largest dynamic mmap threshold on 64-bit: an allocation this size never reuses memory.
_FRESH_MEMORY_BYTES = 32 << 20


def is_slot(name: str) -> bool:
    return name.startswith(_SLOT_PREFIX)


def _mapping(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass
class Slot:
    """One reusable shared-memory region of a sender; its name carries its capacity."""

    name: str
    capacity: int
    memory: torch.Tensor  # uint8 view of the mapping


class SlotPool:
    """A sender's slots, per receiving peer. Thread-safe."""

    def __init__(self) -> None:
        self._free: dict[int, list[Slot]] = {}
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self.lends = 0  # how many buffers went out through the slots

    @property
    def made(self) -> int:
        """How many slots exist (each a mapping of at least 1 MB, kept for reuse)."""
        return len(self._names)

    def lend(self, peer: int, data: memoryview | torch.Tensor) -> Slot:
        """Copy ``data`` (bytes) into a free slot for ``peer`` (a new one if none fits)."""
        source = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
        nbytes = source.numel()
        with self._lock:
            free = self._free.setdefault(peer, [])
            slot = next((s for s in free if s.capacity >= nbytes), None)
            if slot is not None:
                free.remove(slot)
            self.lends += 1
        if slot is None:
            capacity = max(1 << 20, 1 << (nbytes - 1).bit_length())
            name = f"{_SLOT_PREFIX}{os.getpid()}-{_session}-{next(_names)}-{capacity}"
            mapping = _mapping(os.path.join(SHM_DIR, name), capacity, create=True)
            slot = Slot(name, capacity, torch.frombuffer(mapping, dtype=torch.uint8))
            with self._lock:
                self._names.add(name)
        copy_bytes(slot.memory, source.contiguous(), nbytes)
        return slot

    def give_back(self, peer: int, slot: Slot) -> None:
        """The receiver is done with ``slot``: it may be lent again."""
        with self._lock:
            self._free.setdefault(peer, []).append(slot)

    def discard(self, slot: Slot) -> None:
        """The receiver may still read ``slot`` (the call timed out): never reuse it."""
        with self._lock:
            self._names.discard(slot.name)
        remove([slot.name])

    def close(self) -> None:
        with self._lock:
            names, self._names = list(self._names), set()
            self._free.clear()
        remove(names)


class Borrowings:
    """A receiver's mappings of its peers' slots, by name (mapped once, file unlinked then:
    both sides hold mappings, so nothing is left behind if either dies)."""

    def __init__(self) -> None:
        self._mapped: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def view(self, name: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``name`` (uint8), valid until the sender reuses it."""
        with self._lock:
            memory = self._mapped.get(name)
        if memory is None:
            if "/" in name or not is_slot(name):
                raise ValueError(f"not an rpcdist slot: {name!r}")
            capacity = int(name.rsplit("-", 1)[1])
            memory = torch.frombuffer(
                _mapping(os.path.join(SHM_DIR, name), capacity, create=False), dtype=torch.uint8
            )
            remove([name])
            with self._lock:
                self._mapped[name] = memory
        if nbytes > memory.numel():
            raise ValueError(f"slot {name} holds {memory.numel()} bytes, {nbytes} announced")
        return memory[:nbytes]

    def copy(self, name: str, nbytes: int) -> memoryview:
        """A private, writable copy of the first ``nbytes`` of slot ``name``."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes >= _FRESH_MEMORY_BYTES:
            # Memory this large is always new (glibc maps it afresh): the copy is spent in page
            # faults, which torch's threads take in parallel (64 MB: 20 ms instead of 36 ms).
            out.copy_(self.view(name, nbytes))
        else:
            copy_bytes(out, self.view(name, nbytes), nbytes)
        return memoryview(out.numpy())


borrowings = Borrowings()
