"""The one reviewed list of torch tests that do not run to their end against rpcdist.

A test is listed only if what it needs is a torch internal that no reimplementation should
copy; each entry is ``"<torch test class>.<test method>": Skip(category, reason)``, and its
category is one of :data:`CATEGORIES`. A public behaviour a torch user can reach is never
listed: if rpcdist gets it wrong, the test fails.

How each category is applied (``launcher.generate_tests``):

* ``TORCHSCRIPT``: the test *runs*. It counts as skipped only if it stops at rpcdist's
  refusal of a TorchScript RemoteModule (``_module_interface_cls``), raised by
  ``rpcdist.nn.api.remote_module._refuse_torchscript``; whatever it asserted before that point
  must hold (e.g. ``test_forward_async`` checks the Python RemoteModule first), and any other
  error fails it.
* every other category (``TORCHSCRIPT_FUNCTION`` too: a ``@torch.jit.script`` function sent
  over RPC runs through torch's C++ TorchScript RPC path): the test is not started.

``test_substitution.py`` checks that every entry names an existing test of a suite in
``suites.SUITES`` and has one of these categories.

:data:`KNOWN_FAILURES`, kept apart from the reviewed list, is not a skip list: it names public
behaviours rpcdist does not implement yet. Those tests run as torch wrote them and are
reported as xfail (``strict=False``: one that starts passing is reported XPASS, not failed);
each reason starts with "not yet implemented: ".
"""

from __future__ import annotations

from typing import NamedTuple

TORCHSCRIPT = "TorchScript"  # scripted RemoteModules, torch.jit functions over RPC
CUDA = "CUDA"  # CUDA tensors, device maps
TENSORPIPE = "TensorPipe"  # TensorPipe-only options (transports, channels)
TORCH_PRIVATE = "torch-private"  # torch's `_`-prefixed agent hooks and internal counters
TORCHSCRIPT_FUNCTION = "TorchScript-function"  # @torch.jit.script functions called over RPC
FAULTY_AGENT = "faulty-agent"  # fault injection of torch's (TensorPipe-internal) faulty agent

CATEGORIES = frozenset({TORCHSCRIPT, CUDA, TENSORPIPE, TORCH_PRIVATE, TORCHSCRIPT_FUNCTION, FAULTY_AGENT})


class Skip(NamedTuple):
    """Why a test does not run to its end: its category and what exactly it needs."""

    category: str
    reason: str


_SCRIPTED_REMOTE_MODULE = (
    "a TorchScript RemoteModule (_RemoteModule(..., _module_interface_cls=...) and torch.jit.script "
    "of it) needs torch's C++ RRef and TorchScript RPC"
)

_GRAPH = (
    "inspects torch's per-worker autograd graph through dist_autograd._current_context() / "
    "_retrieve_context() (its send/recv functions, known worker ids): private internals"
)
_CLEANUP = (
    "checks that a context is gone on every worker by polling the private "
    "dist_autograd._retrieve_context(id) until it raises"
)
_JIT_CALL = "calls a @torch.jit.script function over RPC (torch's C++ TorchScript RPC path)"


def _autograd_skips(suite: str, suffix: str) -> dict[str, Skip]:
    """The entries shared by DistAutogradTest and its sparse twins (``suffix`` "_sparse")."""
    entries = {
        **{
            f"test_graph_for_{kind}{suffix}": Skip(TORCH_PRIVATE, _GRAPH)
            for kind in (
                "builtin_call",
                "python_call",
                "builtin_remote_call",
                "python_remote_call",
                "py_nested_call",
                "py_nested_remote_call",
                "py_nested_call_itself",
                "py_nested_remote_call_itself",
            )
        },
        f"test_no_graph_with_tensors_not_require_grad{suffix}": Skip(TORCH_PRIVATE, _GRAPH),
        f"test_no_graph_with_tensors_not_require_grad_remote{suffix}": Skip(TORCH_PRIVATE, _GRAPH),
        f"test_rpc_complex_args{suffix}": Skip(TORCH_PRIVATE, _GRAPH),
        f"test_remote_complex_args{suffix}": Skip(TORCH_PRIVATE, _GRAPH),
        f"test_context_cleanup_tensor_with_grad{suffix}": Skip(TORCH_PRIVATE, _CLEANUP),
        f"test_context_cleanup_tensor_no_grad{suffix}": Skip(TORCH_PRIVATE, _CLEANUP),
        f"test_context_cleanup_nested_rpc{suffix}": Skip(TORCH_PRIVATE, _CLEANUP),
        f"test_backward_simple_script_call{suffix}": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
    }
    return {f"{suite}.{test}": skip for test, skip in entries.items()}


_RREF_FUTURE = "the private RRef._get_future() (torch's C++ creation future)"
_PROFILING_FUTURE = "the private RRef._get_profiling_future() (torch's C++ profiling future of an RRef)"
_PROFILING_KEY = "builds its expected event names with torch's private rpc.internal._build_rpc_profiling_key"
_RREF_LEAK = (
    "mocks the private rpc.api._delete_all_user_and_unforked_owner_rrefs and sets the private "
    "api._ignore_rref_leak flag"
)
_IDS = "matches torch's internal RRef/fork GloballyUniqueId(created_on, local_id) counters in the text"


def _rpc_test_skips() -> dict[str, Skip]:
    """The entries of rpc_test.RpcTest."""
    entries = {
        "test_all_gather": Skip(
            TORCH_PRIVATE, "the private rpc.api._all_gather() and _get_current_rpc_agent()"
        ),
        "test_all_gather_timeout": Skip(
            TORCH_PRIVATE, "the private rpc.api._all_gather() and _set_rpc_timeout()"
        ),
        "test_build_rpc_profiling_key": Skip(TORCH_PRIVATE, _PROFILING_KEY),
        "test_debug_info": Skip(
            TORCH_PRIVATE,
            "compares the keys of the private _get_debug_info(), "
            "_rref_context_get_debug_info() and dist_autograd._get_debug_info() counters",
        ),
        "test_disable_gil_profiling": Skip(
            TORCH_PRIVATE,
            "reads a GIL wait counter of torch's agent (get_debug_info()['agent.gil_average_wait_time_us'])",
        ),
        "test_duplicate_name": Skip(TORCH_PRIVATE, "the private rpc._init_rpc_backend() on a raw store"),
        "test_register_rpc_backend_and_set_and_start_rpc_backend": Skip(
            TORCH_PRIVATE,
            "registers a backend in torch's backend_registry and calls the private "
            "rpc.api._set_and_start_rpc_agent()",
        ),
        "test_rref_context_debug_info": Skip(
            TORCH_PRIVATE, "the private _rref_context_get_debug_info() counters"
        ),
        "test_rref_get_future": Skip(TORCH_PRIVATE, _RREF_FUTURE),
        "test_rref_timeout": Skip(TORCH_PRIVATE, _RREF_FUTURE),
        "test_server_process_global_profiler": Skip(
            TORCH_PRIVATE, "the private rpc._server_process_global_profile (torch's server-side profiler)"
        ),
        "test_shutdown_errors": Skip(
            TORCH_PRIVATE,
            "mocks the private rpc.api._broadcast_to_followers and "
            "_delete_all_user_and_unforked_owner_rrefs to inject shutdown failures",
        ),
        "test_use_rpc_pickler": Skip(
            TORCH_PRIVATE, "the private rpc.api._use_rpc_pickler/_internal_rpc_pickler"
        ),
        "test_py_nested_pickle": Skip(
            TORCH_PRIVATE,
            "its argument pickles itself with torch's private rpc.internal._internal_rpc_pickler",
        ),
        "test_ignore_rref_leak": Skip(TORCH_PRIVATE, _RREF_LEAK),
        "test_rref_leak": Skip(TORCH_PRIVATE, _RREF_LEAK),
        "test_wait_all_workers_timeout": Skip(
            TORCH_PRIVATE, "mocks the private rpc.api._all_gather to make rpc.api._wait_all_workers time out"
        ),
        "test_local_value_not_on_owner": Skip(TORCH_PRIVATE, _IDS),
        "test_rref_str": Skip(TORCH_PRIVATE, _IDS),
        "test_use_rref_after_shutdown": Skip(
            TORCH_PRIVATE,
            "after to_here() (which passes), pickles the RRef with torch's internal "
            "rpc.internal.serialize (its C++ RPC pickler)",
        ),
        "test_profiler_remote_events_profiled": Skip(TORCH_PRIVATE, _PROFILING_KEY),
        "test_profiler_remote_events_profiled_single_threaded": Skip(TORCH_PRIVATE, _PROFILING_KEY),
        **{
            f"test_profiler_with_remote_{kind}": Skip(TORCH_PRIVATE, _PROFILING_FUTURE)
            for kind in ("builtin", "builtin_single_threaded", "udf", "udf_single_threaded")
        },
        # TorchScript functions over RPC
        **{
            f"test_profiler_with_script_{kind}": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL)
            for kind in (
                "async_rpc",
                "async_rpc_single_threaded",
                "remote_rpc",
                "remote_rpc_single_threaded",
                "sync_rpc",
                "sync_rpc_single_threaded",
            )
        },
        "test_rpc_profiling_async_function": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
        "test_rpc_profiling_async_function_single_threaded": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
        "test_stress_heavy_rpc_torchscript": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
        "test_wait_all_exit_early_script_function": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
        "test_async_record_function_cbs_jit_call": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
    }
    return {f"RpcTest.{test}": skip for test, skip in entries.items()}


SKIPS: dict[str, Skip] = {
    # --- torch/testing/_internal/distributed/nn/api/remote_module_test.py
    "RemoteModuleTest.test_forward_async": Skip(
        TORCHSCRIPT, f"the Python RemoteModule passed; then {_SCRIPTED_REMOTE_MODULE}"
    ),
    "RemoteModuleTest.test_forward_sync": Skip(
        TORCHSCRIPT, f"the Python RemoteModule passed; then {_SCRIPTED_REMOTE_MODULE}"
    ),
    "RemoteModuleTest.test_forward_async_script": Skip(TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE),
    "RemoteModuleTest.test_forward_sync_script": Skip(TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE),
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": Skip(
        TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE
    ),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": Skip(
        TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE
    ),
    # --- torch/testing/_internal/distributed/rpc/dist_autograd_test.py
    **_autograd_skips("DistAutogradTest", ""),
    **_autograd_skips("TensorPipeAgentDistAutogradTest", "_sparse"),
    "DistAutogradTest.test_autograd_context": Skip(
        TORCH_PRIVATE, "reads dist_autograd._get_max_id() and dist_autograd._retrieve_context(id)"
    ),
    "DistAutogradTest.test_context_cleanup_no_tensors": Skip(TORCH_PRIVATE, _CLEANUP),
    "DistAutogradTest.test_worker_ids_recorded": Skip(
        TORCH_PRIVATE, "reads _current_context()._known_worker_ids(), a private counter"
    ),
    "DistAutogradTest.test_debug_info": Skip(
        TORCH_PRIVATE, "reads the internal counters of dist_autograd._get_debug_info()"
    ),
    "DistAutogradTest.test_clean_context_during_backward": Skip(
        TORCH_PRIVATE, "makes contexts with the private dist_autograd._new_context()/_release_context()"
    ),
    "DistAutogradTest.test_trainer_ps_torchscript_functions": Skip(TORCHSCRIPT_FUNCTION, _JIT_CALL),
    # --- torch/testing/_internal/distributed/rpc/rpc_test.py
    **_rpc_test_skips(),
}


KNOWN_FAILURE_PREFIX = "not yet implemented: "


class KnownFailure(NamedTuple):
    """A test that fails today: why (starts with :data:`KNOWN_FAILURE_PREFIX`), and, for one
    that hangs, how many seconds torch's machinery waits for its workers (torch's
    ``TIMEOUT_OVERRIDE``, by method name) instead of the default."""

    reason: str
    timeout: int | None = None


_HANG_TIMEOUT = 10  # s, instead of 60 (torch then spends ~5 s per worker fetching its stack)

# "<torch test class>.<test method>": why it fails today (public behaviour rpcdist lacks).
KNOWN_FAILURES: dict[str, KnownFailure] = {
    # --- torch/testing/_internal/distributed/rpc/rpc_test.py
    "RpcTest.test_init_pg_then_rpc": KnownFailure(
        KNOWN_FAILURE_PREFIX + "a gloo group and RPC rendezvous on one file:// file: rpcdist's "
        "FileStore has its own file format, so it cannot share torch's FileStore file"
    ),
    "RpcTest.test_init_rpc_then_pg": KnownFailure(
        KNOWN_FAILURE_PREFIX + "as test_init_pg_then_rpc (RPC first, then gloo on the same file: hangs)",
        _HANG_TIMEOUT,
    ),
    "RpcTest.test_profiler_export_trace": KnownFailure(
        KNOWN_FAILURE_PREFIX + "the callee's events are not merged into the caller's profile, so the "
        "exported Chrome trace lacks the remote ops"
    ),
    "RpcTest.test_profiler_with_async_rpc_udf": KnownFailure(
        KNOWN_FAILURE_PREFIX + "the callee's events are not merged into the caller's profile"
    ),
    "RpcTest.test_profiler_with_async_rpc_udf_single_threaded": KnownFailure(
        KNOWN_FAILURE_PREFIX + "the callee's events are not merged into the caller's profile"
    ),
    # --- torch/testing/_internal/distributed/rpc/dist_autograd_test.py
    "DistAutogradTest.test_backward_unused_send_function": KnownFailure(
        KNOWN_FAILURE_PREFIX + "torch's FAST-mode backward never completes when an RPC's result is "
        "unused, and the test asserts that hang; rpcdist's backward completes"
    ),
    "DistAutogradTest.test_dist_autograd_profiling": KnownFailure(
        KNOWN_FAILURE_PREFIX + "profiler events named SendRpcBackward / RecvRpcBackward / "
        "torch::distributed::autograd::backward for a distributed backward pass"
    ),
}
