"""Restricted mode and the per-peer in-flight limit, across real processes.

One launch of two workers in restricted mode (``security_scenarios.restricted``): w0 calls w1's
exposed and allowlisted functions, is refused the others (its own module's unexposed function,
``os.getpid``, ``torch.add``), unregistered classes and malicious pickles (``os.system``,
``eval``, ``open`` reductions, and a raw hand-made request), and checks the marker files
those would create are absent and w1 keeps serving. w0 allows 2 calls in flight per peer
(further calls wait), w1 allows 8, so w1's bursts to w0 are partly refused by w0.

Also collectives and their object ops, and the parameter-server example (distributed autograd,
RRefs, the DistributedOptimizer), in restricted mode (``RPCDIST_RESTRICTED=1``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import _examples
import pytest
from _harness import GroupRun, ImportFirst, run_group

from rpcdist import serialization
from rpcdist.errors import RestrictedError


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(
        tmp_path_factory.mktemp("restricted"),
        "restricted",
        2,
        "env",
        params={"scenarios": ImportFirst("security_scenarios")},
        rank_params={0: {"max_inflight_calls_per_peer": 2}, 1: {"max_inflight_calls_per_peer": 8}},
        timeout=150,
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "name",
    ["exposed/work", "exposed/remote_error_keeps_type", "rref/works_and_private_methods_refused"],
)
def test_exposed_functions_work(run: GroupRun, name: str) -> None:
    run.check(name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "name",
    [
        "refused/not_exposed",
        "refused/os_getpid",
        "refused/unregistered_class_argument",
        "refused/unregistered_class_result",
    ],
)
def test_unexposed_refused_with_a_clear_error(run: GroupRun, name: str) -> None:
    run.check(name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["refused/malicious_pickles", "refused/raw_malicious_request"])
def test_malicious_pickles_refused_and_nothing_runs(run: GroupRun, name: str) -> None:
    run.check(name)  # the worker checked that no marker file appeared


@pytest.mark.timeout(200)
def test_caller_keeps_at_most_the_limit_in_flight(run: GroupRun) -> None:
    run.check("limits/caller_waits")
    assert "timed out" in run.check("limits/waiting_call_times_out")


@pytest.mark.timeout(200)
def test_callee_refuses_calls_above_its_limit(run: GroupRun) -> None:
    run.check("limits/callee_refuses_excess", rank=1)


@pytest.mark.timeout(200)
def test_workers_exit_cleanly(run: GroupRun) -> None:
    run.assert_clean_exit()


def test_allowlist_typo_fails_at_init() -> None:
    with pytest.raises(ValueError, match="no_such_module.f"):
        serialization.resolve_allowlist(["no_such_module.f"])


def test_restricted_loads_refuses_before_importing() -> None:
    # A global from a module this process never imported: refused without importing it.
    payload = b"\x80\x02cantigravity\ngeohash\n."
    assert "antigravity" not in sys.modules
    with pytest.raises(RestrictedError, match="antigravity.geohash"):
        serialization.loads(payload, restricted=True)
    assert "antigravity" not in sys.modules


@pytest.mark.timeout(200)
def test_collectives_and_object_collectives_work_restricted(tmp_path: Path) -> None:
    run = run_group(
        tmp_path,
        "restricted_collectives",
        2,
        "env",
        params={"scenarios": ImportFirst("security_scenarios")},
        timeout=150,
    )
    for rank in (0, 1):
        run.check("collectives/restricted_agent", rank=rank)
        run.check("collectives/tensors", rank=rank)
        for name in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"):
            run.check(name, rank=rank)


ACCURACY = re.compile(r"result: test accuracy ([\d.]+)")


@pytest.mark.timeout(220)
def test_parameter_server_trains_in_restricted_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_example_ps_pipeline's quick run (3 epochs: one is too noisy to judge), restricted."""
    pytest.importorskip("sklearn")
    monkeypatch.setenv("RPCDIST_RESTRICTED", "1")
    stdout, report = _examples.run_example("parameter_server.py", "--quick", cwd=tmp_path, timeout=200)
    for trainer in ("trainer1", "trainer2"):
        assert re.search(rf"epoch +3/3 +{trainer} +loss [\d.]+", stdout), report
    assert "all 3 workers shut down cleanly" in stdout, report
    match = ACCURACY.search(stdout)
    assert match is not None, f"no result line\n{report}"
    assert float(match.group(1)) > 0.6, report
