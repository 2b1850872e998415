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

A process that ends without closing its transport (a torch program that never calls
``destroy_process_group``) removes its probe, socket directory and slots at exit. One that is
killed (SIGKILL, the OOM killer, a crash) cannot. So a live worker holds a shared ``flock``
on its probe and its socket directory, and each process's first probe sweeps ``/dev/shm``
(:func:`sweep_stale`): this user's entries that nobody holds any more go, and with a probe
the slots of the process that made it. A lock dies with its process, whatever ends it, and
works across PID namespaces sharing one ``/dev/shm``, where a PID would mislead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import itertools
import logging
import mmap
import multiprocessing.util
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
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


_PROBE_PREFIX = f"{_PREFIX}probe-"
_SOCKET_DIR_PREFIX = f"{_PREFIX}sock-"
_SOCKET_NAME = "agent.sock"  # (the only entry of a socket directory)
STALE_AFTER_SECONDS = 60.0
"""Entries younger than this are never swept: their maker may not hold its lock yet."""
# Entry path -> the descriptor whose shared flock marks it as in use (closed with the entry),
# and the process that made it (a forked child inherits the table, not the entries).
_held: dict[str, tuple[int, int]] = {}
_held_lock = threading.Lock()
_swept = False


def create_probe() -> str:
    """Leave a probe file in /dev/shm, held (see :func:`sweep_stale`) until :func:`remove`
    deletes it; returns its name ("" without /dev/shm). A process's first probe first sweeps
    what killed workers left there."""
    global _swept
    if not available():
        return ""
    if not _swept:
        _swept = True
        try:
            sweep_stale()
        except OSError as exc:  # never a reason not to start
            log.debug("could not sweep %s: %s", SHM_DIR, exc)
    # The process's session token in the name ties its slots to it (see sweep_stale).
    name = f"{_PROBE_PREFIX}{os.getpid()}-{_session}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o600)
    except OSError:
        return ""
    _hold(path, fd)
    return name


def _hold(path: str, fd: int) -> None:
    """Mark ``path`` as in use for as long as this process lives (or until released)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:  # (a file system without flock: the entry is then never swept)
        log.debug("cannot lock %s: %s", path, exc)
    _remove_at_exit()
    with _held_lock:
        _held[path] = (fd, os.getpid())


def _release(path: str) -> None:
    with _held_lock:
        held = _held.pop(path, None)
    if held is not None:
        os.close(held[0])


def _remove_own_entries() -> None:
    """At the exit of a process that never closed its transport (a torch program ending
    without ``destroy_process_group``, say): remove the probe, socket directory and slots it
    made, as closing would have."""
    me = os.getpid()
    with _held_lock:
        paths = [path for path, (_, pid) in _held.items() if pid == me]
    for path in paths:  # (what close() would have done: the same removals)
        if os.path.isdir(path):
            remove_socket(os.path.join(path, _SOCKET_NAME))
        else:
            remove([os.path.basename(path)])
    for pool in list(_pools):
        if pool.pid == me:
            pool.close()


atexit.register(_remove_own_entries)
_exit_hook_pid = 0


def _remove_at_exit() -> None:
    """Have this process remove its entries at exit also if it is a multiprocessing child:
    one ends with ``os._exit``, which skips atexit but runs multiprocessing's finalizers (and
    a forked one starts with those cleared, so this is done per process, on first use)."""
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        multiprocessing.util.Finalize(None, _remove_own_entries, exitpriority=0)


def sweep_stale(now: float | None = None) -> list[str]:
    """Remove this user's rpcdist entries in /dev/shm that no live process holds: probes and
    Unix-socket directories whose lock nobody has (their worker is gone), and slots whose
    maker has no live probe (it died before a receiver mapped them). Entries younger than
    :data:`STALE_AFTER_SECONDS` stay. Returns the names removed."""
    now = time.time() if now is None else now
    uid = os.geteuid()
    old: dict[str, os.stat_result] = {}
    live: set[str] = set()  # the makers (see _maker) of every probe, until found unheld
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if not entry.name.startswith(_PREFIX):
                continue
            if entry.name.startswith(_PROBE_PREFIX):
                live.add(_maker(entry.name, _PROBE_PREFIX))
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid and now - st.st_mtime >= STALE_AFTER_SECONDS:
                old[entry.name] = st
    removed = []
    for name, st in old.items():
        path = os.path.join(SHM_DIR, name)
        if name.startswith(_PROBE_PREFIX) and stat.S_ISREG(st.st_mode):
            if _unheld(path, os.O_RDONLY):
                live.discard(_maker(name, _PROBE_PREFIX))
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(name)
        elif name.startswith(_SOCKET_DIR_PREFIX) and stat.S_ISDIR(st.st_mode):
            if _unheld(path, os.O_RDONLY | os.O_DIRECTORY):
                with contextlib.suppress(OSError):
                    shutil.rmtree(path)
                    removed.append(name)
    for name, st in old.items():
        if name.startswith(_SLOT_PREFIX) and stat.S_ISREG(st.st_mode):
            if _maker(name, _SLOT_PREFIX) not in live:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
    if removed:
        log.info("removed %d entries of rpcdist workers that are gone from %s", len(removed), SHM_DIR)
    return removed


def _maker(name: str, prefix: str) -> str:
    """The "<pid>-<session>" of the process that made a probe or slot, from its name."""
    return "-".join(name[len(prefix) :].split("-")[:2])


def _unheld(path: str, flags: int) -> bool:
    """Whether no process holds ``path`` (a probe or socket directory) in use."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def sees_probe(name: str) -> bool:
    return bool(name) and os.path.exists(os.path.join(SHM_DIR, name))


def remove(names: Iterable[str]) -> None:
    """Delete shared-memory files (slots nobody will map any more)."""
    for name in names:
        if name:
            _release(os.path.join(SHM_DIR, name))
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.debug("could not remove %s: %s", name, exc)


def socket_path() -> str:
    """A fresh path for this worker's Unix socket, next to the probe (same visibility), inside
    a new directory only this user can enter (mode 0700, unguessable name)."""
    directory = tempfile.mkdtemp(prefix=_SOCKET_DIR_PREFIX, dir=SHM_DIR)
    _hold(directory, os.open(directory, os.O_RDONLY | os.O_DIRECTORY))
    return os.path.join(directory, _SOCKET_NAME)


def remove_socket(path: str) -> None:
    """Remove the socket and its private directory."""
    if path:
        _release(os.path.dirname(path))
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


_pools: weakref.WeakSet[SlotPool] = weakref.WeakSet()


def _remove_slots(names: set[str], pid: int) -> None:
    if os.getpid() == pid:  # (not in a forked child, whose copy of the pool is no maker)
        remove(list(names))


class SlotPool:
    """A sender's slots, per receiving peer. Thread-safe.

    A slot is *lent* (:meth:`lend`: the sender learns by other means when the receiver is
    done, as a call's reply, and calls :meth:`give_back`) or *given* (:meth:`give`: the
    receiver may keep it as the memory of the tensor it rebuilt, and names it in a
    ``SLOTS_READ`` notice once done, see :meth:`returned`).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()  # its slots' maker (removes them at exit if not closed before)
        _remove_at_exit()
        _pools.add(self)
        self._free: dict[int, list[Slot]] = {}
        self._names: set[str] = set()
        # A pool dropped without close() (its transport freed) removes its slots all the same.
        weakref.finalize(self, _remove_slots, self._names, self.pid).atexit = False
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
            names = list(self._names)
            self._names.clear()
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
