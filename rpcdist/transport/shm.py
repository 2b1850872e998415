"""Shared-memory handoff of large buffers between workers on one host.

A sender copies a large buffer into one of its reusable *slots* (a warm mapping under
``/dev/shm`` it keeps, :class:`SlotPool`) and sends only the slot's name; the receiver maps
the slot once (:class:`Borrowings`). A *lent* slot (call arguments below ``KEEP_MIN_BYTES``,
collectives) is copied out or reduced from by the receiver and reused once the sender hears
that it is done (the call's reply, the collective's acknowledgment). A *given* slot (larger
arguments, every result) may be kept by the receiver as the memory of the tensor it rebuilds,
without a copy; the receiver names it in a ``SLOTS_READ`` notice once that tensor is freed.
Each copy is one ``memcpy`` with the GIL released. No page is allocated per message on
either side once the slots are warm.

Whether two workers share ``/dev/shm`` is tested, not guessed: each worker leaves a probe
file there and publishes its name; a peer is co-located when it can see that file (two
containers on one machine with private ``/dev/shm`` correctly come out as not co-located).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import mmap
import os
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from rpcdist.transport import warm

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


def remove(names: Iterable[str]) -> None:
    """Delete shared-memory files (slots nobody will map any more)."""
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
GIVEN = "+"  # marks a given slot's name in a message: the receiver names it back once done
_GIVEN_SLOT_PREFIX = GIVEN + _SLOT_PREFIX
KEEP_MIN_BYTES = 4 << 20  # a given slot this large becomes the received tensor's memory


def is_slot(entry: str) -> bool:
    """Whether a message's shared-buffer entry names a slot (lent or given)."""
    return entry.startswith(_SLOT_PREFIX) or entry.startswith(_GIVEN_SLOT_PREFIX)


def is_given(entry: str) -> bool:
    return entry.startswith(_GIVEN_SLOT_PREFIX)


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
    """A sender's slots, per receiving peer. Thread-safe.

    A slot is *lent* (:meth:`lend`: the sender learns by other means when the receiver is
    done, as a call's reply, and calls :meth:`give_back`) or *given* (:meth:`give`: the
    receiver may keep it as the memory of the tensor it rebuilt, and names it in a
    ``SLOTS_READ`` notice once done, see :meth:`returned`).
    """

    def __init__(self) -> None:
        self._free: dict[int, list[Slot]] = {}
        self._names: set[str] = set()
        self._given: dict[str, tuple[int, Slot]] = {}
        self._lock = threading.Lock()
        self.lends = 0  # how many buffers went out through the slots

    @property
    def given(self) -> int:
        """How many given slots their receivers have not handed back yet."""
        return len(self._given)

    def give(self, peer: int, data: memoryview | torch.Tensor) -> Slot:
        """As :meth:`lend`, for a slot that comes back through :meth:`returned`."""
        slot = self.lend(peer, data)
        with self._lock:
            self._given[slot.name] = (peer, slot)
        return slot

    def returned(self, peer: int, names: Iterable[str]) -> None:
        """``peer`` is done with these slots we gave it: they may be lent again. (Names of
        slots given to anyone else are ignored: only their holder can hand them back.)"""
        with self._lock:
            for name in names:
                entry = self._given.get(name)
                if entry is not None and entry[0] == peer:
                    del self._given[name]
                    self._free.setdefault(peer, []).append(entry[1])

    def drop_given(self, peer: int) -> None:
        """``peer`` may never hand back the slots it holds (its connection ended): they are
        never lent again. Their files stay until :meth:`close` (a message still on its way
        may name one the peer has not mapped yet)."""
        with self._lock:
            for name in [name for name, (to, _) in self._given.items() if to == peer]:
                del self._given[name]

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
            self._given.clear()
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
            if "/" in name or not name.startswith(_SLOT_PREFIX):
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

    def keep(self, name: str, nbytes: int, release: Callable[[str], None]) -> memoryview:
        """The first ``nbytes`` of given slot ``name`` as memory of a received buffer (no
        copy); ``release(name)`` runs once nothing uses it any more (from whichever thread
        drops the last reference)."""
        owner = warm.OwnedMemory(self.view(name, nbytes), nbytes, functools.partial(release, name))
        return memoryview(np.asarray(owner))

    def copy(self, name: str, nbytes: int) -> memoryview:
        """A private, writable copy of the first ``nbytes`` of slot ``name``."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes >= warm.GLIBC_MMAP_MAX:
            # Memory this large is always new (glibc maps it afresh): the copy is spent in page
            # faults, which torch's threads take in parallel (64 MB: 20 ms instead of 36 ms).
            out.copy_(self.view(name, nbytes))
        else:
            copy_bytes(out, self.view(name, nbytes), nbytes)
        return memoryview(out.numpy())


borrowings = Borrowings()
