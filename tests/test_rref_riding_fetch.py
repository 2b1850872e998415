"""A ``to_here()`` made before its RRef's ``remote()`` call has left rides on that call: the
owner answers the creation with the value (one request and one answer instead of two of each),
on gRPC links and on Unix sockets alike (metrics on: every call goes through the loop there).

The checks run in ``rref_riding_scenarios.rref_riding_fetch`` (2 workers: w0 drives, w1 owns);
the wire field itself is checked here too, through both frame decoders.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from _harness import GroupRun, ProcSpec, run_processes

from rpcdist.agent.markers import with_value_variant
from rpcdist.errors import RpcError
from rpcdist.rpc import rref as rref_module
from rpcdist.transport import frames

pytestmark = pytest.mark.timeout(300)

CHECKS = [
    "riding/one_request_and_answer_each",
    "riding/tensor_value",
    "riding/value_that_cannot_travel",
    "riding/failed_creation",
    "riding/a_shorter_fetch_timeout_holds",
    "riding/two_fetches_before_it_leaves",
    "riding/not_into_an_autograd_context",
    "riding/threads_at_once",
    "riding/not_for_other_functions",
    "riding/nothing_left_behind",
]
TRANSPORTS = {
    "grpc": {"transport": "grpc", "shm_threshold_bytes": 0},
    "unix": {},
    "grpc-restricted": {
        "transport": "grpc",
        "shm_threshold_bytes": 0,
        "restricted": True,
        "allowlist": [
            "rpc_functions.add",
            "rpc_functions.raise_value_error",
            "rpc_functions.arrive",
            "rpc_functions.release",
            "rpc_functions.wait_idle",
            "rref_functions.made_slowly",
            "rref_functions.debug",
            "rref_riding_scenarios.served_from",
            "rref_riding_scenarios.with_lock",
            "rref_riding_scenarios.owned_count",
            "rref_riding_scenarios.leaf_sum",
            "rref_riding_scenarios.has_gradient",
            "rpcdist.rpc.api.get_worker_info",
        ],
    },
}


class _ImportInWorker:
    """Unpickled in the worker before its scenario starts: imports the scenarios module."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        return importlib.import_module, (self.module,)


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    params = {"scenarios_module": _ImportInWorker("rref_riding_scenarios"), **TRANSPORTS[request.param]}
    specs = [ProcSpec("rref_riding_fetch", rank, 2, dict(params)) for rank in range(2)]
    return run_processes(tmp_path_factory.mktemp(f"riding_{request.param}"), specs, "env", timeout=240)


@pytest.mark.parametrize("name", CHECKS)
def test_riding_fetch(group: GroupRun, name: str) -> None:
    group.check(name)


def test_a_second_fetch_sends_its_own(group: GroupRun) -> None:
    """Of two to_here() made before the creation left, one rides on it, the other is a fetch
    (two fetches when the creation left first: see the scenario's first check)."""
    served = group.check("riding/two_fetches_before_it_leaves")
    assert 1 <= served.get("RRef.to_here", 0) <= 2, served


def test_a_riding_fetch_times_out_while_its_creation_waits(tmp_path: Path) -> None:
    """A remote() queued behind the in-flight limit (not encoded yet): a to_here(0.3) riding
    on it fails after its 0.3 s, not once the creation leaves after the 2 s call ahead of it."""
    params = {
        "scenarios_module": _ImportInWorker("rref_riding_scenarios"),
        **TRANSPORTS["grpc"],
        "max_inflight_calls_per_peer": 1,
    }
    specs = [ProcSpec("rref_riding_queued", rank, 2, dict(params)) for rank in range(2)]
    run = run_processes(tmp_path, specs, "env", timeout=120)
    run.check("riding/queued_creation_fetch_timeout")


@pytest.mark.parametrize("size", [100, 200_000])  # protobuf's parser, and the zero-copy reader
def test_with_value_travels_in_the_envelope(size: int) -> None:
    payload = b"p" * size
    for asked in (True, False):
        entries = list(frames.encode_message(9, frames.REQUEST, payload, [], function="f", with_value=asked))
        raw = b"".join(bytes(piece) for entry in entries for piece in entry)
        (envelope,) = frames.decode_frame(raw)
        assert envelope.call_id == 9 and bool(envelope.with_value) is asked
        assert bytes(envelope.payload) == payload


def test_only_an_rrefs_creation_answers_with_its_value() -> None:
    assert with_value_variant(rref_module._create, "create") is rref_module._create_answering_value
    with pytest.raises(RpcError, match="cannot answer with the value"):
        with_value_variant(rref_module._fetch, "RRef.to_here")
