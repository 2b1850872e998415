"""Importing rpcdist chooses gRPC's polling engine for the process (fewer thread hand-offs per
message), and leaves a user's own choice, and other programs, alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

# Runs in a fresh interpreter (gRPC Core reads its engine choice once, when grpc is loaded):
# imports as told, then counts how often gRPC's EventEngine threads wake while a grpc.aio stream
# makes 200 echo round trips on 127.0.0.1.
_PROBE = r"""
import asyncio, glob, json, os, sys
first = sys.argv[1]
if first == "grpc":
    import grpc
import rpcdist
from rpcdist import _grpc_engine
import grpc

def engine_thread_wakeups():
    total = 0
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if f.read().strip() != "event_engine":
                    continue
            with open(f"{task}/status") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        except OSError:
            pass
    return total

async def main():
    same = lambda b: b
    server = grpc.aio.server()
    async def echo(requests, context):
        async for message in requests:
            yield message
    handler = grpc.stream_stream_rpc_method_handler(echo, same, same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Echo", {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.stream_stream("/probe.Echo/Echo", request_serializer=same, response_deserializer=same)()
    for _ in range(20):
        await call.write(b"x"); await call.read()
    before = engine_thread_wakeups()
    for _ in range(200):
        await call.write(b"x"); assert await call.read() == b"x"
    woke = engine_thread_wakeups() - before
    call.cancel(); await channel.close(); await server.stop(None)
    variable = os.environ.get("GRPC_EXPERIMENTS")
    print(json.dumps({"chosen": _grpc_engine.chosen, "variable": variable, "woke": woke}))

asyncio.run(main())
"""


def _probe(first: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, first], env=environ, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts thread wake-ups in /proc")
def test_rpcdist_moves_grpc_messages_off_the_event_engine_threads() -> None:
    default = _probe("rpcdist", GRPC_EXPERIMENTS="")  # an explicit (empty) choice: gRPC's defaults
    chosen = _probe("rpcdist")
    assert default["chosen"] is False and default["variable"] == ""  # the user's choice is kept
    assert chosen["chosen"] is True
    assert chosen["variable"] is None  # set for grpc's import only: child programs keep gRPC's defaults
    # gRPC's defaults wake an EventEngine thread several times per round trip; with rpcdist's
    # choice the poller thread that wakes the event loop does the I/O itself.
    assert default["woke"] >= 200, default
    assert chosen["woke"] < 50, chosen


def test_grpc_imported_first_keeps_its_defaults() -> None:
    assert _probe("grpc")["chosen"] is False
