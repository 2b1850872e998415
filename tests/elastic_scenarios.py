"""Scenarios of the elastic-membership tests (``test_elastic.py``): workers join and leave a
running dynamic group (``init_rpc(name, world_size=None)``).

Roles (one process each, started in stages by the test; markers are files in ``workdir``):

- ``ps`` (rank 0, hosts the store): owns a linear model; records every membership change it
  hears (a listener) and checks them at the end; its shutdown serves the store until the
  others have left.
- ``trainer1`` (rank drawn): trains on the PS with distributed autograd and a
  DistributedOptimizer, before, during and after trainer2's stay.
- ``trainer2`` (joins later, twice: leaves, then a new process with the same name rejoins):
  calls the PS and trainer1, takes a training step, leaves.
- ``victim`` joins and dies (kill -9): the survivors take it off the group; a new process
  then joins under its name.

``_harness`` looks scenarios up on ``rpc_scenarios``; importing this module registers them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import rpc_functions as rf
import rpc_scenarios
import torch
from _harness import check
from rpc_scenarios import options, wait_until

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist.agent import current_agent
from rpcdist.errors import WorkerUnavailableError
from rpcdist.optim import DistributedOptimizer

CALL_TIMEOUT = 60.0
SERVE_TIMEOUT = 120.0

_model: torch.nn.Linear | None = None
_events: list[tuple[str, str]] = []
_events_lock = threading.Lock()


def ps_params() -> list[rpc.RRef[Any]]:
    """On the PS: RRefs to its parameters."""
    assert _model is not None
    return [rpc.RRef(p) for p in _model.parameters()]


def ps_forward(x: torch.Tensor) -> torch.Tensor:
    assert _model is not None
    return _model(x)


def ps_weight_sum() -> float:
    assert _model is not None
    return float(_model.weight.detach().sum())


def _record(event: str, info: rpc.WorkerInfo) -> None:
    with _events_lock:
        _events.append((event, info.name))


def _names() -> set[str]:
    return {info.name for info in rpc.get_worker_infos()}


def _train_steps(steps: int) -> float:
    """``steps`` steps of distributed autograd + DistributedOptimizer on the PS's model."""
    params = rpc.rpc_sync("ps", ps_params, timeout=CALL_TIMEOUT)
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    # One fixed batch for every trainer: each step anyone takes lowers the loss on it, so a
    # later loss can be compared with an earlier one (fresh random batches made that a coin toss).
    seeded = torch.Generator().manual_seed(1234)
    x, y = torch.randn(16, 4, generator=seeded), torch.randn(16, 2, generator=seeded)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync("ps", ps_forward, (x,), timeout=CALL_TIMEOUT)
            loss = torch.nn.functional.mse_loss(out, y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    return float(loss)


def elastic(  # noqa: C901 - one scenario, every role
    rank: int, world_size: int, init_method: str, workdir: str, role: str, **_: Any
) -> dict[str, Any]:
    """One member of the dynamic group (see the module docstring); ``rank``/``world_size``
    from the harness are not used: the PS asks for rank 0, the others get one drawn."""
    global _model
    marks = Path(workdir)
    report: dict[str, Any] = {}
    opts = options(init_method, rpc_timeout=CALL_TIMEOUT)
    if role == "ps":
        torch.manual_seed(0)
        _model = torch.nn.Linear(4, 2)
        rpc.init_rpc("ps", rank=0, world_size=None, rpc_backend_options=opts)
        rpc.on_membership_change(_record)
        (marks / "ps_up").touch()
        rf.wait_released(SERVE_TIMEOUT)  # trainer1 says when it is done
        with _events_lock:
            report["events"] = list(_events)
        report["peer_death_checks"] = current_agent().status()["counts"]["peer_death_checks"]
        report["members_at_end"] = sorted(_names())
    elif role == "trainer1":
        rpc.init_rpc("trainer1", world_size=None, rpc_backend_options=opts)
        report["rank"] = rpc.get_worker_info().id
        with check("elastic/trainer1_alone"):
            assert _names() == {"ps", "trainer1"}, _names()
            before = rpc.rpc_sync("ps", ps_weight_sum, timeout=CALL_TIMEOUT)
            report["loss_first"] = _train_steps(5)
            assert rpc.rpc_sync("ps", ps_weight_sum, timeout=CALL_TIMEOUT) != before
        (marks / "trainer1_trained").touch()
        with check("elastic/sees_the_joiner"):
            wait_until(lambda: "trainer2" in _names(), SERVE_TIMEOUT, "trainer2 to join")
            assert rpc.rpc_sync("trainer2", rf.whoami, timeout=CALL_TIMEOUT) == "trainer2"
        (marks / "trainer1_called_trainer2").touch()
        with check("elastic/sees_the_leaver"):
            wait_until(lambda: "trainer2" not in _names(), SERVE_TIMEOUT, "trainer2 to leave")
            try:
                rpc.rpc_sync("trainer2", rf.whoami, timeout=CALL_TIMEOUT)
                raise AssertionError("a call to a worker that left succeeded")
            except WorkerUnavailableError as exc:
                assert "trainer2" in str(exc), exc
        with check("elastic/trains_on_after_the_leave"):
            report["loss_after_leave"] = _train_steps(20)
            assert report["loss_after_leave"] < report["loss_first"], report
        (marks / "trainer2_may_rejoin").touch()
        with check("elastic/sees_the_rejoin"):
            wait_until(lambda: (marks / "trainer2_rejoined_and_left").exists(), SERVE_TIMEOUT, "the rejoin")
            assert _names() == {"ps", "trainer1"}, _names()
        (marks / "victim_may_join").touch()
        with check("elastic/a_dead_member_is_taken_off"):
            wait_until(lambda: (marks / "victim_joined").exists(), SERVE_TIMEOUT, "the victim to join")
            wait_until(lambda: "victim" not in _names(), 30, "the dead victim to be taken off")
            assert _names() == {"ps", "trainer1"}, _names()
        (marks / "victim_may_rejoin").touch()
        with check("elastic/a_dead_members_name_is_free_again"):
            wait_until(lambda: (marks / "victim_again_done").exists(), SERVE_TIMEOUT, "the successor")
        rpc.rpc_sync("ps", rf.release, timeout=CALL_TIMEOUT)
    elif role in ("victim", "victim_again"):  # joins, then dies (kill -9); its successor rejoins
        rpc.init_rpc("victim", world_size=None, rpc_backend_options=opts)
        if role == "victim":
            (marks / "victim_joined").touch()
            rf.die_in(0.0)
            time.sleep(60)
        with check("elastic/victim_again_joined"):
            assert _names() == {"ps", "trainer1", "victim"}, _names()
            assert rpc.rpc_sync("trainer1", rf.whoami, timeout=CALL_TIMEOUT) == "trainer1"
        rpc.shutdown()
        (marks / "victim_again_done").touch()
        return report
    else:  # trainer2, first or second life
        second = role == "trainer2_again"
        rpc.init_rpc("trainer2", world_size=None, rpc_backend_options=opts)
        report["rank"] = rpc.get_worker_info().id
        with check(f"elastic/{role}_joined"):
            assert _names() == {"ps", "trainer1", "trainer2"}, _names()
            assert rpc.rpc_sync("trainer1", rf.whoami, timeout=CALL_TIMEOUT) == "trainer1"
            report["loss"] = _train_steps(2)
        if not second:  # leave once trainer1 has called us
            wait_until((marks / "trainer1_called_trainer2").exists, SERVE_TIMEOUT, "trainer1's call")
    start = time.monotonic()
    rpc.shutdown()
    report["shutdown_seconds"] = round(time.monotonic() - start, 2)
    if role == "trainer2_again":
        (marks / "trainer2_rejoined_and_left").touch()
    return report


def _register() -> None:
    rpc_scenarios.elastic = elastic


_register()
