"""Lending large tensors to co-located peers through reusable shared-memory slots.

Collectives move the same large buffers again and again. Instead of a new shared-memory file
per message (page allocation on both sides every time), the sender keeps a few slots per
peer: it copies the tensor into a free slot and sends only its name; the receiver maps the
slot once (then unlinks the file: both sides keep their mappings), reads or reduces straight
from it, and releases it when done, which is when the sender's message completes and the
slot is free again. One copy in, zero or one copy out, and no page faults once warm.
"""

from __future__ import annotations

from typing import Any

import torch

from rpcdist.transport import shm

LOAN_MIN_BYTES = 256 << 10


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def lend_tensor(pool: shm.SlotPool, peer: int, tensor: torch.Tensor) -> tuple[shm.Slot, tuple[Any, ...]]:
    """Copy ``tensor`` into a slot for ``peer``; returns the slot and what the receiver needs."""
    data = _bytes_of(tensor)
    slot = pool.lend(peer, data)
    return slot, (slot.name, data.numel(), tensor.dtype, tuple(tensor.shape))


def borrow_tensor(descriptor: tuple[Any, ...]) -> torch.Tensor:
    """The receiver's view of a lent tensor (valid until released)."""
    name, nbytes, dtype, shape = descriptor
    return shm.borrowings.view(name, nbytes).view(dtype).view(shape)


class Loan:
    """A received tensor that lives in the sender's slot until :meth:`release`."""

    __slots__ = ("tensor", "_released")

    def __init__(self, tensor: torch.Tensor, released: Any) -> None:
        self.tensor = tensor
        self._released = released

    def release(self) -> None:
        if not self._released.done():
            self._released.set_result(None)
