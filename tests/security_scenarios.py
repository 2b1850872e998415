"""Scenarios of the restricted-mode and limits tests (``test_security_restricted``).

``_harness`` looks scenarios up on ``rpc_scenarios``; importing this module registers them
there. Functions and classes are in ``security_functions``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import rpc_scenarios
import security_functions as sf
import torch
from _harness import check
from rpc_scenarios import CALL_TIMEOUT, _on_agent_loop, _raw_exchange, finish, init

import rpcdist.rpc as rpc
from rpcdist.errors import RestrictedError, RpcError, RpcTimeoutError, SerializationError
from rpcdist.rpc import api as rpc_api
from rpcdist.v1 import agent_pb2

ALLOWLIST = ["security_functions.allowlisted", "rpc_functions.arrive", "rpc_functions.release"]


def _raises(exc_type: type[BaseException], call: Any) -> BaseException:
    try:
        call()
    except exc_type as exc:
        return exc
    raise AssertionError(f"expected {exc_type.__name__}")


def restricted(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    opts.pop("scenarios", None)
    init(rank, world_size, init_method, restricted=True, allowlist=ALLOWLIST, **opts)
    if rank == 0:
        _caller_checks(Path(workdir))
    else:
        _callee_limit_checks()
    finish(rank, world_size)


def _caller_checks(workdir: Path) -> None:
    with check("exposed/work"):
        out = rpc.rpc_sync(
            1,
            sf.add,
            (torch.ones(3), np.arange(3.0), {"k": [1, 2.5, "s", None, (True,), {3}]}),
            timeout=CALL_TIMEOUT,
        )
        assert out["sum"].tolist() == [1.0, 2.0, 3.0], out
        assert out["extra"] == {"k": [1, 2.5, "s", None, (True,), {3}]}, out
        assert rpc.rpc_sync(1, sf.async_double, (torch.ones(2),), timeout=CALL_TIMEOUT).tolist() == [2.0, 2.0]
        assert rpc.rpc_sync(1, sf.allowlisted, timeout=CALL_TIMEOUT) == "allowlisted ran"
        assert rpc.rpc_sync(1, sf.echo, (sf.SafePoint(1, 2),), timeout=CALL_TIMEOUT) == sf.SafePoint(1, 2)

    with check("exposed/remote_error_keeps_type"):
        error = _raises(
            ValueError, lambda: rpc.rpc_sync(1, sf.raise_value_error, ("boom",), timeout=CALL_TIMEOUT)
        )
        assert "boom" in str(error), str(error)

    with check("refused/not_exposed") as c:
        error = _raises(RestrictedError, lambda: rpc.rpc_sync(1, sf.not_exposed, timeout=CALL_TIMEOUT))
        c.value = str(error)
        assert "security_functions.not_exposed" in c.value and "rpcdist.rpc.expose" in c.value, c.value
        assert "allowlist" in c.value, c.value

    with check("refused/os_getpid") as c:
        error = _raises(RestrictedError, lambda: rpc.rpc_sync(1, os.getpid, timeout=CALL_TIMEOUT))
        c.value = str(error)
        assert "getpid" in c.value, c.value
        error = _raises(RestrictedError, lambda: rpc.rpc_sync(1, torch.add, (1, 2), timeout=CALL_TIMEOUT))

    with check("refused/unregistered_class_argument") as c:
        error = _raises(
            RestrictedError, lambda: rpc.rpc_sync(1, sf.echo, (sf.UnsafePoint(1, 2),), timeout=CALL_TIMEOUT)
        )
        c.value = str(error)
        assert "security_functions.UnsafePoint" in c.value and "register_safe_class" in c.value, c.value

    with check("refused/unregistered_class_result") as c:
        error = _raises(
            SerializationError, lambda: rpc.rpc_sync(1, sf.make_unsafe_point, timeout=CALL_TIMEOUT)
        )
        c.value = str(error)
        assert "UnsafePoint" in c.value, c.value

    with check("refused/malicious_pickles") as c:
        outcomes = {}
        for how in ("system", "eval", "open"):
            marker = workdir / f"pwned_{how}"
            error = _raises(
                RestrictedError,
                lambda m=marker, h=how: rpc.rpc_sync(1, sf.echo, (sf.Pwn(str(m), h),), timeout=CALL_TIMEOUT),
            )
            outcomes[how] = str(error)
            assert not marker.exists(), f"{how}: the malicious pickle ran on the callee"
        c.value = outcomes
        assert rpc.rpc_sync(1, sf.echo, ("still serving",), timeout=CALL_TIMEOUT) == "still serving"

    with check("refused/raw_malicious_request") as c:
        # A non-rpcdist client: a hand-made REQUEST on a fresh Exchange stream.
        marker = workdir / "pwned_raw"
        payload = pickle.dumps((sf.Pwn(str(marker)), (), {}), protocol=5)
        header = agent_pb2.Envelope(
            call_id=7, kind=agent_pb2.REQUEST, payload=payload, function="x", caller_rank=0
        )
        frame = agent_pb2.Frame(envelopes=[header]).SerializeToString()
        agent = rpc_api._agent
        assert agent is not None
        c.value = _on_agent_loop(_raw_exchange(agent.addresses[1], frame))
        assert not marker.exists(), "the raw malicious pickle ran on the callee"
        assert c.value[0] == "OK", c.value  # answered with an error message, not a crash
        assert rpc.rpc_sync(1, sf.echo, ("after raw",), timeout=CALL_TIMEOUT) == "after raw"

    with check("rref/works_and_private_methods_refused") as c:
        counter = rpc.remote(1, sf.make_counter, timeout=CALL_TIMEOUT)
        assert counter.rpc_sync(timeout=CALL_TIMEOUT).bump(2) == 2
        assert counter.rpc_sync(timeout=CALL_TIMEOUT).bump(3) == 5
        tensor_rref = rpc.remote(1, sf.echo, (torch.arange(4.0),), timeout=CALL_TIMEOUT)
        assert tensor_rref.to_here(timeout=CALL_TIMEOUT).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert rpc.rpc_sync(1, sf.echo, (tensor_rref,), timeout=CALL_TIMEOUT).owner().id == 1
        error = _raises(RestrictedError, lambda: counter.rpc_sync(timeout=CALL_TIMEOUT)._secret())
        c.value = str(error)
        assert "_secret" in c.value, c.value

    with check("limits/caller_waits") as c:
        rpc.rpc_sync(1, sf.most_running, (True,), timeout=CALL_TIMEOUT)
        futures = [rpc.rpc_async(1, sf.slow, (0.3,), timeout=CALL_TIMEOUT) for _ in range(6)]
        assert [f.wait() for f in futures] == [1] * 6
        c.value = rpc.rpc_sync(1, sf.most_running, timeout=CALL_TIMEOUT)
        assert 1 <= c.value <= 2, f"{c.value} calls ran at once with max_inflight_calls_per_peer=2"

    with check("limits/waiting_call_times_out") as c:
        busy = [rpc.rpc_async(1, sf.slow, (3.0,), timeout=CALL_TIMEOUT) for _ in range(2)]
        late = rpc.rpc_async(1, sf.echo, ("late",), timeout=0.5)
        error = _raises(RpcTimeoutError, late.wait)
        c.value = str(error)
        assert [f.wait() for f in busy] == [1, 1]
        assert rpc.rpc_sync(1, sf.echo, ("next",), timeout=CALL_TIMEOUT) == "next"


def _callee_limit_checks() -> None:
    # w0 runs with max_inflight_calls_per_peer=2; this worker with 8 lets 6 calls out at once.
    with check("limits/callee_refuses_excess") as c:
        futures = [rpc.rpc_async(0, sf.slow, (1.0,), timeout=CALL_TIMEOUT) for _ in range(6)]
        ok, refused = 0, []
        for f in futures:
            try:
                f.wait()
                ok += 1
            except RpcError as exc:
                refused.append(str(exc))
        c.value = {"ok": ok, "refused": refused}
        assert refused and ok >= 1, c.value
        assert all("max_inflight_calls_per_peer=2" in text for text in refused), refused
        assert rpc.rpc_sync(0, sf.most_running, timeout=CALL_TIMEOUT) <= 2
        assert rpc.rpc_sync(0, sf.echo, ("w0 still serves",), timeout=CALL_TIMEOUT) == "w0 still serves"


def restricted_collectives(rank: int, world_size: int, init_method: str, workdir: str, **opts: Any) -> None:
    """Collectives (their object ops too) with ``RPCDIST_RESTRICTED=1`` in the environment."""
    import c10d_scenarios

    import rpcdist as dist
    from rpcdist.collectives.group import current_state

    os.environ["RPCDIST_RESTRICTED"] = "1"
    c10d_scenarios.init(rank, world_size, init_method, timeout=60)
    with check("collectives/restricted_agent"):
        assert current_state().agent.options.restricted
    with check("collectives/tensors"):
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [float(sum(range(1, world_size + 1)))] * 4
    c10d_scenarios._objects(rank, world_size, None)  # checks named object/<collective>
    dist.barrier()
    dist.destroy_process_group()


for _name in ("restricted", "restricted_collectives"):
    setattr(rpc_scenarios, _name, globals()[_name])
