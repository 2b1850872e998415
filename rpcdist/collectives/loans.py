"""Lending large tensors to co-located peers through reusable shared-memory slots.

Collectives move the same large buffers again and again. Instead of a new shared-memory file
per message (page allocation on both sides every time), the sender keeps a few slots per
peer: it copies the tensor into a free slot and sends only its name; the receiver maps the
slot once (then unlinks the file: both sides keep their mappings), reads or reduces straight
from it, and releases it when done, which is when the sender's message completes and the
slot is free again. One copy in, zero or one copy out, and no page faults once warm.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from rpcdist.rpc import shm

LOAN_MIN_BYTES = 256 << 10
_names = itertools.count()
_session = secrets.token_hex(4)


@dataclass
class _Slot:
    name: str
    capacity: int
    mapping: mmap.mmap
    memory: torch.Tensor  # uint8 view of the mapping


def _new_mapping(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class SlotPool:
    """The sender's slots, per peer rank. Runs on the event loop."""

    def __init__(self) -> None:
        self._free: dict[int, list[_Slot]] = {}
        self._all: list[_Slot] = []

    def lend(self, peer: int, tensor: torch.Tensor) -> tuple[_Slot, tuple[Any, ...]]:
        """Copy ``tensor`` into a free slot for ``peer``; returns the slot and its descriptor."""
        data = _bytes_of(tensor)
        nbytes = data.numel()
        free = self._free.setdefault(peer, [])
        slot = next((s for s in free if s.capacity >= nbytes), None)
        if slot is None:
            capacity = max(1 << 20, 1 << (nbytes - 1).bit_length())
            name = f"rpcdist-slot-{os.getpid()}-{_session}-{next(_names)}"
            mapping = _new_mapping(os.path.join(shm.SHM_DIR, name), capacity, create=True)
            slot = _Slot(name, capacity, mapping, torch.frombuffer(mapping, dtype=torch.uint8))
            self._all.append(slot)
        else:
            free.remove(slot)
        slot.memory[:nbytes].copy_(data)
        return slot, (slot.name, slot.capacity, nbytes, tensor.dtype, tuple(tensor.shape))

    def give_back(self, peer: int, slot: _Slot) -> None:
        self._free.setdefault(peer, []).append(slot)

    def close(self) -> None:
        shm.remove([s.name for s in self._all])
        self._free.clear()
        self._all.clear()  # mappings go with the last tensor views on them


class Borrowings:
    """The receiver's mappings of its peers' slots, by name. Runs on the event loop."""

    def __init__(self) -> None:
        self._mapped: dict[str, torch.Tensor] = {}

    def view(self, descriptor: tuple[Any, ...]) -> torch.Tensor:
        name, capacity, nbytes, dtype, shape = descriptor
        memory = self._mapped.get(name)
        if memory is None:
            if "/" in name or not name.startswith("rpcdist-slot-"):
                raise ValueError(f"not an rpcdist slot: {name!r}")
            path = os.path.join(shm.SHM_DIR, name)
            memory = torch.frombuffer(_new_mapping(path, capacity, create=False), dtype=torch.uint8)
            shm.remove([name])  # both sides hold mappings now; nothing to leak if either dies
            self._mapped[name] = memory
        return memory[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        self._mapped.clear()


class Loan:
    """A received tensor that lives in the sender's slot until :meth:`release`."""

    __slots__ = ("tensor", "_released")

    def __init__(self, tensor: torch.Tensor, released: Any) -> None:
        self.tensor = tensor
        self._released = released

    def release(self) -> None:
        if not self._released.done():
            self._released.set_result(None)
