"""Shared-memory handoff of large buffers between workers on one host.

The sender writes a buffer into a new file under ``/dev/shm`` (one copy, done by the kernel)
and sends only its name; the receiver maps the file as the memory of the rebuilt tensor
(no copy) and unlinks it at once, so the memory lives exactly as long as that tensor.

Whether two workers share ``/dev/shm`` is tested, not guessed: each worker leaves a probe
file there and publishes its name; a peer is co-located when it can see that file (two
containers on one machine with private ``/dev/shm`` correctly come out as not co-located).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import secrets
from collections.abc import Iterable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "rpcdist-"
_names = itertools.count()
_session = secrets.token_hex(4)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def create_probe() -> str:
    """Leave a probe file in /dev/shm; returns its name ("" without /dev/shm)."""
    if not available():
        return ""
    name = f"{_PREFIX}probe-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        with open(os.path.join(SHM_DIR, name), "wb"):
            pass
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
    """A fresh path for this worker's Unix socket, next to the probe (same visibility)."""
    return os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.sock")


def remove_socket(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
