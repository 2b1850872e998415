"""rpcdist as a torch.distributed backend (``rpcdist.collectives.torch_backend``), against gloo.

Two launches (scenarios in ``torch_backend_scenarios``):

- ``torch_first`` on 3 ranks: ``torch.distributed.init_process_group("rpcdist", tcp://...)``
  builds rpcdist's world from torch's store; torch's collectives, object collectives, P2P and
  sub-groups on it give gloo's results (a gloo group of the same ranks, same inputs); DDP
  trains to gloo's gradients and parameters step by step; ``destroy_process_group`` tears
  rpcdist's world down too.
- ``rpcdist_first`` on 2 ranks: ``rpcdist.init_process_group`` makes torch's default group
  (DDP without ``process_group``, ``DistributedSampler``, ``get_rank``); its store is rpcdist's
  (gloo's sub-group rendezvous runs through it); ``rpcdist.destroy_process_group`` removes it;
  a default group the program made itself is left alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import HOST, GroupRun, ProcSpec, free_port, run_processes
from c10d_functions import ImportInWorker, assert_checks

pytestmark = pytest.mark.timeout(300)  # the first test of a launch waits for it

LAUNCH_TIMEOUT = 240.0
TORCH_FIRST_WORLD = 3
RPCDIST_FIRST_WORLD = 2

REDUCE_CASES = {
    "float32": ("SUM", "PRODUCT", "MIN", "MAX"),
    "float64": ("SUM", "MAX"),
    "int64": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "int32": ("SUM", "BXOR"),
}  # as torch_backend_scenarios.REDUCE_CASES (this module imports no torch)


def _launch(workdir: Path, scenario: str, world: int, params: dict[str, object] | None = None) -> GroupRun:
    base = {"scenarios_module": ImportInWorker("torch_backend_scenarios"), **(params or {})}
    specs = [ProcSpec(scenario, rank, world, dict(base)) for rank in range(world)]
    return run_processes(workdir, specs, "tcp", timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def torch_first(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("torch_first"), "torch_first", TORCH_FIRST_WORLD)


@pytest.fixture(scope="module")
def rpcdist_first(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    params = {"second_init": f"tcp://{HOST}:{free_port()}", "third_init": f"tcp://{HOST}:{free_port()}"}
    return _launch(tmp_path_factory.mktemp("rpcdist_first"), "rpcdist_first", RPCDIST_FIRST_WORLD, params)


def _torch_first(run: GroupRun, *names: str) -> None:
    assert_checks(run, list(names), range(TORCH_FIRST_WORLD))


def _rpcdist_first(run: GroupRun, *names: str) -> None:
    assert_checks(run, list(names), range(RPCDIST_FIRST_WORLD))


# ============================================================================ torch first
def test_torch_init_process_group_builds_rpcdist_world(torch_first: GroupRun) -> None:
    _torch_first(torch_first, "init")


@pytest.mark.parametrize("dtype", sorted(REDUCE_CASES))
def test_all_reduce_same_as_gloo(torch_first: GroupRun, dtype: str) -> None:
    _torch_first(torch_first, *(f"all_reduce/{dtype}/{op}" for op in REDUCE_CASES[dtype]))


def test_all_reduce_ring_sized_avg_and_async_future(torch_first: GroupRun) -> None:
    _torch_first(torch_first, "all_reduce/ring_sized", "all_reduce/AVG", "all_reduce/async_work_and_future")


@pytest.mark.parametrize(
    "names",
    [
        [f"broadcast/src{s}" for s in range(TORCH_FIRST_WORLD)],
        ["all_gather", "all_gather_into_tensor"],
        [f"reduce/dst{d}" for d in range(TORCH_FIRST_WORLD)],
        ["gather", "scatter"],
        ["reduce_scatter", "reduce_scatter_tensor"],
        ["all_to_all_single/even", "all_to_all_single/split_sizes", "all_to_all"],
        ["barrier"],
    ],
    ids=["broadcast", "all_gather", "reduce", "gather_scatter", "reduce_scatter", "all_to_all", "barrier"],
)
def test_collectives_same_as_gloo(torch_first: GroupRun, names: list[str]) -> None:
    _torch_first(torch_first, *names)


@pytest.mark.parametrize(
    "name",
    [
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
        "send_recv_object_list",
    ],
)
def test_object_collectives_same_as_gloo(torch_first: GroupRun, name: str) -> None:
    _torch_first(torch_first, name)


@pytest.mark.parametrize(
    "name",
    [
        "send_recv/ring_isend_irecv",
        "send_recv/blocking_with_tag",
        "send_recv/any_source",
        "batch_isend_irecv",
    ],
)
def test_point_to_point_same_as_gloo(torch_first: GroupRun, name: str) -> None:
    _torch_first(torch_first, name)


def test_new_group_on_rpcdist_backend(torch_first: GroupRun) -> None:
    _torch_first(
        torch_first,
        "subgroup/membership",
        "subgroup/all_reduce",
        "subgroup/broadcast_global_src",
        "subgroup/all_gather_object",
    )


def test_errors_are_clear_and_leave_ranks_in_step(torch_first: GroupRun) -> None:
    _torch_first(
        torch_first,
        "errors/premul_sum_refused",
        "errors/shape_mismatch_named",
        "errors/failed_future_raises",
        "errors/still_in_step",
    )


def test_ddp_gradients_equal_gloo(torch_first: GroupRun) -> None:
    _torch_first(torch_first, "ddp/same_as_gloo", "ddp/find_unused_parameters_and_no_sync")


def test_torch_destroy_tears_down_rpcdist(torch_first: GroupRun) -> None:
    _torch_first(torch_first, "destroy")
    torch_first.assert_clean_exit()


# ============================================================================ rpcdist first
def test_rpcdist_init_makes_torch_default_group(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "init", "torch_store_is_rpcdist_store", "torch_collectives")


def test_rpcdist_and_torch_collectives_interleave(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "rpcdist_and_torch_interleaved")


def test_functional_collectives_and_device_mesh(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "functional_collectives_and_device_mesh")


def test_ddp_without_process_group_equals_gloo(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "ddp_without_process_group_same_as_gloo")


def test_distributed_sampler_and_ddp(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "distributed_sampler_ddp")


def test_rpcdist_destroy_destroys_torch_default_group(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(rpcdist_first, "destroy")


def test_a_torch_group_the_program_made_is_left_alone(rpcdist_first: GroupRun) -> None:
    _rpcdist_first(
        rpcdist_first,
        "own_torch_group/init_both",
        "own_torch_group/new_group_rpcdist",
        "own_torch_group/left_alone",
    )
    rpcdist_first.assert_clean_exit()
