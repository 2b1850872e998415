"""Several "hosts" on one machine: Linux network namespaces joined by a veth pair.

The test process makes the namespaces (:func:`two_hosts`); a worker process moves itself into
one at start-up (:func:`enter`), with a private ``/dev/shm`` of its own, so nothing is shared
with workers on the other "host" but the network (co-location cannot be mistaken across
them). Needs root and iproute2; callers skip otherwise (see :func:`unavailable`).

Imports only the standard library: workers call :func:`enter` before anything else loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


@contextlib.contextmanager
def two_hosts(tag: str) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: ((name, address), (name, address)).
    Removed on exit. ``tag`` keeps concurrent users apart (a few characters)."""
    hosts = ((f"rdA{tag}", "10.231.0.1"), (f"rdB{tag}", "10.231.0.2"))
    links = (f"rdA{tag}v", f"rdB{tag}v")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        for name, _ in hosts:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for (name, address), link in zip(hosts, links, strict=True):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name, _ in hosts:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@contextlib.contextmanager
def hosts(tag: str, count: int) -> Iterator[list[tuple[str, str, str]]]:
    """``count`` network namespaces on one switch (a bridge in a namespace of its own):
    [(name, address, the host's cable: its veth end on the switch side)]. Taking a cable down
    (``ip -n <switch> link set <cable> down``) cuts that host off without closing anything.
    Removed on exit."""
    switch = f"rdS{tag}"
    made = [(f"rd{i}{tag}", f"10.232.0.{i + 1}", f"rd{i}{tag}c") for i in range(count)]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for name, address, cable in made:
            ip("netns", "add", name)
            ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", cable, "netns", switch)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", switch, "link", "set", cable, "master", "br0")
            ip("-n", switch, "link", "set", cable, "up")
        yield made
    finally:
        for name, _, _ in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", switch], capture_output=True, timeout=30)


def cut(tag: str, cable: str) -> None:
    """Take a host's cable down on the switch of :func:`hosts` ``tag``."""
    subprocess.run(["ip", "-n", f"rdS{tag}", "link", "set", cable, "down"], check=True, timeout=30)


def enter(name: str) -> None:
    """Move this (single-threaded, freshly started) process onto host ``name``: its network
    namespace, and a mount namespace with an empty private ``/dev/shm``."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None), "mount tmpfs /dev/shm")
