"""Distributed autograd and ``DistributedOptimizer``: gradients and updated parameters equal
those of the same model computed in one process.

Two launches (scenarios in ``autograd_scenarios``, functions in ``autograd_functions``):
``ag_main`` (3 workers: rank 0 drives; then w0 is a parameter server for trainers w1 and w2;
then 1,000 iterations and a leak check on every worker) and ``ag_asyncio`` (2 workers, each in
its own ``asyncio.run``: ``backward_async``, ``step_async``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import GroupRun, ImportFirst, ProcSpec, run_processes

pytestmark = pytest.mark.timeout(300)


def _launch(workdir: Path, scenario: str, world_size: int, timeout: float) -> GroupRun:
    specs = [
        ProcSpec(scenario, rank, world_size, {"scenarios": ImportFirst("autograd_scenarios")})
        for rank in range(world_size)
    ]
    return run_processes(workdir, specs, "env", timeout=timeout)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("ag_main"), "ag_main", 3, timeout=200)


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("ag_concurrent"), "ag_concurrent", 2, timeout=120)


@pytest.fixture(scope="module")
def aio(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("ag_asyncio"), "ag_asyncio", 2, timeout=120)


# ============================================================================ 1. split model
def test_split_model_gradients_on_both_workers(main: GroupRun) -> None:
    main.check("split/gradients")


def test_backward_async_from_a_blocking_program(main: GroupRun) -> None:
    main.check("split/backward_async_from_sync_program")


def test_gradients_for_the_caller_are_handed_back_not_called_back(main: GroupRun) -> None:
    main.check("split/gradients_handed_back_not_called_back")


# ============================================================================ 2. 3-stage chain
def test_three_stage_chain_with_nested_rpc(main: GroupRun) -> None:
    main.check("chain/gradients")


def test_micro_batches_make_one_backward_call_per_worker(main: GroupRun) -> None:
    main.check("chain/micro_batches_one_backward_call_per_worker")


# ============================================================================ 3. parameter server
@pytest.mark.parametrize("trainer", [1, 2])
def test_parameter_server_gradients_per_context(main: GroupRun, trainer: int) -> None:
    main.check("ps/gradients_per_context", rank=trainer)


@pytest.mark.parametrize("trainer", [1, 2])
def test_parameter_server_parameters_after_steps(main: GroupRun, trainer: int) -> None:
    main.check("ps/parameters_after_steps", rank=trainer)


@pytest.mark.parametrize("trainer", [1, 2])
def test_parameter_server_concurrent_steps_lose_no_update(main: GroupRun, trainer: int) -> None:
    main.check("ps/concurrent_steps_serialized", rank=trainer)


# ============================================================================ 4. RRefs
@pytest.mark.parametrize("way", ["proxy_rpc_sync", "proxy_rpc_async", "proxy_remote", "remote_then_to_here"])
def test_gradients_through_rrefs(main: GroupRun, way: str) -> None:
    main.check(f"rref/{way}")


# ============================================================================ 5. reuse
@pytest.mark.parametrize(
    "case",
    [
        "sent_twice",
        "same_tensor_twice_in_one_call",
        "parameter_sent_itself",
        "used_locally_and_sent",
        "remote_parameters_used_twice",
    ],
)
def test_tensor_used_twice_accumulates(main: GroupRun, case: str) -> None:
    main.check(f"reuse/{case}")


# ============================================================================ 6. retain_graph
def test_retain_graph_twice_accumulates(main: GroupRun) -> None:
    main.check("retain_graph/twice_accumulates")


# ============================================================================ 6b. no gradient copy
@pytest.mark.parametrize(
    "case", ["own_buffer_kept", "pass_through_buffer_kept", "shared_buffer_copied", "non_contiguous_copied"]
)
def test_gradient_stealing_as_torch(main: GroupRun, case: str) -> None:
    main.check(f"steal/{case}")


# ============================================================================ 7. cleanup
def test_no_context_leaked_after_1000_iterations(main: GroupRun) -> None:
    main.check("cleanup/1000_iterations")


def test_a_context_release_travels_ahead_of_the_next_call_or_alone_within_a_sweep(main: GroupRun) -> None:
    main.check("cleanup/release_travels_ahead_of_the_next_call")


def test_releases_keep_pace_with_a_loop_whose_calls_are_all_in_contexts(main: GroupRun) -> None:
    main.check("cleanup/releases_keep_pace_with_a_loop_that_never_leaves_a_context")


def test_no_context_leaked_by_rpcs_without_grad_tensors(main: GroupRun) -> None:
    main.check("cleanup/rpc_without_grad_tensors_in_context")


# ============================================================================ 8. errors
@pytest.mark.parametrize("case", ["remote_backward", "nested_remote_backward", "later_backward_works"])
def test_remote_backward_error_reaches_caller(main: GroupRun, case: str) -> None:
    main.check(f"error/{case}")


# ============================================================================ 9. optimizers
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_distributed_optimizer_matches_local(main: GroupRun, kind: str) -> None:
    main.check(f"optim/{kind}")


def test_main_clean_exit(main: GroupRun) -> None:
    main.assert_clean_exit()


# ============================================================================ asyncio
def test_backward_async_in_asyncio(aio: GroupRun) -> None:
    aio.check("asyncio/backward_async")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_step_async_in_asyncio(aio: GroupRun, kind: str) -> None:
    aio.check(f"asyncio/step_async/{kind}")


def test_asyncio_contexts_released(aio: GroupRun) -> None:
    aio.check("asyncio/contexts_released")


def test_asyncio_clean_exit(aio: GroupRun) -> None:
    aio.assert_clean_exit()


# ============================================================================ owner-side RRef stress
def test_remote_then_local_value_on_the_owner_never_stalls(main: GroupRun) -> None:
    main.check("stress/remote_then_local_value_on_owner")


@pytest.mark.parametrize("rank", [1, 2])
def test_optimizers_built_by_several_trainers_at_once_never_stall(main: GroupRun, rank: int) -> None:
    main.check(f"stress/optimizers_from_trainers/{rank}", rank=rank)


# ============================================================================ the owner leaves first
@pytest.fixture(scope="module")
def owner_exits(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _launch(tmp_path_factory.mktemp("ag_owner_exits"), "ag_owner_exits_first", 3, timeout=150)


@pytest.mark.parametrize("rank", [1, 2])
def test_optimizers_built_while_the_owner_shuts_down(owner_exits: GroupRun, rank: int) -> None:
    """A parameter server that calls shutdown() at once still serves its trainers: its
    graceful shutdown keeps the values whose RRefs it forked to them (this stalled for the
    60 s timeout, then failed, before)."""
    owner_exits.check(f"owner_exits/optimizers/{rank}", rank=rank)


def test_owner_exits_first_clean_exit(owner_exits: GroupRun) -> None:
    owner_exits.assert_clean_exit()


# ============================================================================ concurrent passes
def test_many_concurrent_backward_passes_with_small_pools(concurrent: GroupRun) -> None:
    """torch's test_async_dist_autograd: nested passes never hold a pool thread waiting."""
    concurrent.check("concurrent/backward_passes_finish")
    concurrent.assert_clean_exit()
