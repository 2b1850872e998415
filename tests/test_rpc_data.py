"""What travels: tensors of every common dtype (to self and to the other worker, by rpc_sync,
rpc_async and remote), non-contiguous tensors, nested containers with numpy arrays, 0-byte
tensors, a 256 MiB tensor, 1,000 calls in flight; WorkerInfo as destination; RRefs; the
Future API; async functions, blocking functions and @async_execution with the blocking API.

Three launches of two worker processes: ``run`` runs every check with default options (large
buffers between these co-located workers go through shared memory); ``grpc_only`` repeats the
transport checks with shared memory turned off, so everything travels on the gRPC stream;
``tcp_only`` the same on framed TCP links (``transport="tcp"``).
Each test asserts one recorded check (see ``rpc_scenarios``).
"""

from __future__ import annotations

import pytest
from _harness import GroupRun, run_group

pytestmark = pytest.mark.timeout(360)

# The names of rpc_scenarios.DTYPES and rpc_scenarios.non_contiguous_cases() (spelled out so that
# this process need not import torch; a name missing there fails as "not recorded").
DTYPES = [
    *("float16", "float32", "float64", "bfloat16"),
    *("int8", "int16", "int32", "int64", "uint8", "bool", "complex64"),
]
NON_CONTIGUOUS = ["transposed", "step_slice", "expanded", "channels_last", "offset_view", "conj_view"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("data"), "data", 2, "env", timeout=300)


def _transport_checks_on(tmp_path_factory: pytest.TempPathFactory, carrier: str) -> GroupRun:
    """The transport checks with shared memory off, every byte on ``carrier``'s links."""
    return run_group(
        tmp_path_factory.mktemp(f"data_{carrier}"),
        "data_transport",
        2,
        "tcp",
        params={"shm_threshold_bytes": 0, "transport": carrier},
        timeout=300,
    )


@pytest.fixture(scope="module")
def grpc_only(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _transport_checks_on(tmp_path_factory, "grpc")


@pytest.fixture(scope="module")
def tcp_only(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _transport_checks_on(tmp_path_factory, "tcp")


@pytest.fixture(params=["default", "grpc_only", "tcp_only"])
def transport(request: pytest.FixtureRequest) -> GroupRun:
    return request.getfixturevalue("run" if request.param == "default" else request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_round_trip(transport: GroupRun, dtype: str) -> None:
    """Same dtype, shape, strides and values; the callee and the caller can write into them."""
    transport.check(f"dtype/{dtype}")


@pytest.mark.parametrize("case", NON_CONTIGUOUS)
def test_non_contiguous_tensor(transport: GroupRun, case: str) -> None:
    transport.check(f"noncontig/{case}")


def test_nested_containers_with_numpy(transport: GroupRun) -> None:
    transport.check("nested")


def test_zero_byte_tensors(transport: GroupRun) -> None:
    transport.check("zero_bytes/tensors")


def test_zero_byte_numpy_arrays_are_writable(transport: GroupRun) -> None:
    transport.check("zero_bytes/numpy")


def test_buffers_across_chunk_boundaries(transport: GroupRun) -> None:
    transport.check("chunked_buffers")


def test_large_received_buffers_reuse_kept_memory_and_carry_their_own_bytes(
    transport: GroupRun, request: pytest.FixtureRequest
) -> None:
    reused = transport.check("large_buffers_reuse_kept_memory")
    if request.node.callspec.params["transport"] != "default":  # (same host: shared memory)
        # On stream carriers the callee served the 2nd and 3rd 40 MiB arguments from memory
        # kept since the previous message was freed.
        assert reused >= 2, reused


def test_256_mib_tensor_round_trip(transport: GroupRun) -> None:
    transport.check("large_256mib")


def test_1_gib_tensor_round_trip(transport: GroupRun) -> None:
    transport.check("large_1gib")


def test_a_notice_runs_on_the_callee_and_answers_nothing(run: GroupRun) -> None:
    run.check("notice_runs_and_answers_nothing")


def test_callee_threads_follow_torch_set_num_threads(run: GroupRun) -> None:
    run.check("torch_threads_on_callee")


def test_1000_calls_in_flight(run: GroupRun) -> None:
    run.check("concurrency_1000")


def test_worker_info_as_destination(run: GroupRun) -> None:
    run.check("worker_info")


@pytest.mark.parametrize(
    "name",
    [
        "to_here",
        "ownership",
        "local_value_owner",
        "local_value_non_owner",
        "proxies",
        "raises/w1",
        "raises/w0",
        "plain_pickle_refused",
    ],
)
def test_rref(run: GroupRun, name: str) -> None:
    run.check(f"rref/{name}")


@pytest.mark.parametrize("name", ["api", "errors", "torch_futures", "await_other_loop"])
def test_future(run: GroupRun, name: str) -> None:
    run.check(f"future/{name}")


def test_rpc_calls_show_in_torchs_profiler_with_torchs_names(run: GroupRun) -> None:
    run.check("profiler/rpc_events")


def test_callee_events_come_back_into_the_callers_profile(run: GroupRun) -> None:
    run.check("profiler/remote_events")


def test_async_function_runs_on_callee_loop(run: GroupRun) -> None:
    run.check("callee_loop/sync_mode")


def test_blocking_function_does_not_stall_other_calls(run: GroupRun) -> None:
    run.check("blocking_does_not_stall/sync_mode")


def test_async_execution(run: GroupRun) -> None:
    run.check("async_execution/sync_mode")


def test_large_arguments_and_results_reuse_shared_memory_slots(run: GroupRun) -> None:
    run.check("slots/reused_by_calls_and_results")


def test_large_argument_is_kept_in_its_slot_without_a_copy(run: GroupRun) -> None:
    run.check("slots/large_argument_kept_without_copy")


def test_clean_exit(transport: GroupRun) -> None:
    transport.assert_clean_exit()


def test_no_shared_memory_left_behind(transport: GroupRun) -> None:
    transport.assert_no_shm_leftovers()


@pytest.mark.parametrize(("fixture", "kind"), [("grpc_only", "GrpcLink"), ("tcp_only", "TcpLink")])
def test_the_checks_travelled_on_the_chosen_carrier(
    request: pytest.FixtureRequest, fixture: str, kind: str
) -> None:
    assert request.getfixturevalue(fixture).check("transport/link_kind") == kind
