"""gRPC's I/O engine, chosen before grpc is first imported (gRPC Core reads the choice then).

gRPC Core's default EventEngine client and listener hand every message between threads of
their own (an I/O thread, a callback thread, then grpc.aio's poller thread, which wakes the
event loop): a bare grpc.aio echo cost about 15 thread wake-ups per round trip in each process
on a 2-core machine. With the two turned off, grpc.aio's poller thread polls the sockets itself:
half the wake-ups, a round trip 137-192 µs instead of 205-297 µs, and rpcdist's gRPC path gained
10-39 % more all-to-all throughput and 19 % more PS training with 8 trainers (README, Transport).

So importing rpcdist sets ``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`` for
the import of grpc only (it is removed again at once: other programs this process starts keep
gRPC's defaults, and those importing rpcdist choose for themselves). Nothing changes when the
environment already sets ``GRPC_EXPERIMENTS`` (any value, even empty, which keeps gRPC's
defaults) or when grpc was imported before rpcdist (too late: gRPC's defaults stay).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

EXPERIMENTS = "-event_engine_client,-event_engine_listener"
_VARIABLE = "GRPC_EXPERIMENTS"


def choose() -> bool:
    """Import grpc with rpcdist's engine choice; returns whether the choice was applied."""
    if "grpc" in sys.modules:
        log.debug("grpc was imported before rpcdist: its default I/O engine stays")
        return False
    if _VARIABLE in os.environ:
        return False
    os.environ[_VARIABLE] = EXPERIMENTS
    try:
        import grpc  # noqa: F401 - gRPC Core reads the variable while this import loads it
    finally:
        del os.environ[_VARIABLE]
    return True


chosen = choose()
"""Whether this process's gRPC runs with rpcdist's engine choice."""
