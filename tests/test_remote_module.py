"""``rpcdist.nn.RemoteModule``: torch's RemoteModule semantics over rpcdist.

One launch (``rm_main`` in ``remote_module_scenarios``, 3 workers: rank 0 drives, w1 owns the
modules, w2 is a third worker): forward/forward_async against the local module, remote_device
formats (and CUDA refused), every unsupported nn.Module method, the module RRef and
``init_from_module_rref``, train/eval, pickling (over RPC only), constructor errors, training
with distributed autograd and ``DistributedOptimizer`` against local training, the
``forward_async`` pipeline with ``torch.futures.wait_all``, and no RRef left behind.
Parsing and the no-RPC error are checked in this process.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import GroupRun, ProcSpec, run_processes

pytestmark = pytest.mark.timeout(360)


class _ImportInWorker:
    """A scenario parameter whose unpickling (in the worker, before its scenario starts)
    imports ``module``, which registers its scenarios on ``rpc_scenarios`` for ``_harness``."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        return importlib.import_module, (self.module,)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    workdir: Path = tmp_path_factory.mktemp("rm_main")
    params = {"scenarios_module": _ImportInWorker("remote_module_scenarios")}
    specs = [ProcSpec("rm_main", rank, 3, dict(params)) for rank in range(3)]
    return run_processes(workdir, specs, "env", timeout=300)


# ============================================================================ in this process
def test_public_paths_mirror_torch() -> None:
    import rpcdist.nn
    from rpcdist.nn.api import remote_module

    assert rpcdist.nn.RemoteModule is remote_module.RemoteModule
    assert issubclass(remote_module.RemoteModule, remote_module._RemoteModule)
    assert issubclass(remote_module.RemoteModule, torch.nn.Module)
    assert rpcdist.nn.__all__ == ["RemoteModule"] and remote_module.__all__ == ["RemoteModule"]


@pytest.mark.parametrize(
    ("text", "on", "device"),
    [
        ("w1", "w1", "cpu"),
        ("trainer0/cpu", "trainer0", "cpu"),
        ("rank:1", 1, "cpu"),
        ("rank:12/cpu", 12, "cpu"),
        ("ps/cpu:0", "ps", "cpu:0"),
    ],
)
def test_remote_device_parsed(text: str, on: Any, device: str) -> None:
    from rpcdist.nn.api.remote_module import _parse_remote_device

    assert _parse_remote_device(text) == (on, torch.device(device))


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("w1/cuda:0", ValueError, "CPU-only"),
        ("rank:0/cuda", ValueError, "CUDA devices are not supported"),
        ("w1/meta", ValueError, "CPU-only"),
        ("w1/cuda:0/cuda:1", ValueError, "Could not parse remote_device: w1/cuda:0/cuda:1."),
        ("/", ValueError, "Could not parse remote_device: /. The valid format is '<workername>/<device>'"),
        ("/cuda:0", ValueError, "Could not parse remote_device: /cuda:0."),
        ("rank:one/cpu", ValueError, "Could not parse remote_device"),
        ("a:b:c/cpu", ValueError, "Could not parse remote_device"),
        ("host:w1/cpu", ValueError, "Could not parse remote_device"),
        ("w1/cpu2", RuntimeError, "Invalid device string: 'cpu2'"),
        ("w1/", RuntimeError, "Device string must not be empty"),
        ("cpu", ValueError, "names a device but no worker"),
        ("cuda:0", ValueError, "names a device but no worker"),
    ],
)
def test_remote_device_refused(text: str, error: type[Exception], match: str) -> None:
    from rpcdist.nn.api.remote_module import _parse_remote_device

    with pytest.raises(error, match=match.replace(".", r"\.").replace("(", r"\(")):
        _parse_remote_device(text)


def test_needs_rpc() -> None:
    from rpcdist.errors import RpcError
    from rpcdist.nn import RemoteModule

    with pytest.raises(RpcError, match="RemoteModule only works in RPC"):
        RemoteModule("w1/cpu", torch.nn.Linear, args=(2, 2))


# ============================================================================ 1. forward
@pytest.mark.parametrize(
    "name",
    [
        "sync_equals_local",
        "async_equals_local",
        "awaited",
        "module_cls_callable",
        "args_and_kwargs",
        "inside_local_module",
        "remote_error",
    ],
)
def test_forward(main: GroupRun, name: str) -> None:
    main.check(f"forward/{name}")


# ============================================================================ 2. remote_device
@pytest.mark.parametrize("name", ["formats", "cuda_refused", "malformed", "unknown_worker"])
def test_remote_device(main: GroupRun, name: str) -> None:
    main.check(f"device/{name}")


# ============================================================================ 3. unsupported methods
def test_unsupported_methods_raise_torchs_error(main: GroupRun) -> None:
    names = main.check("unsupported/methods")
    assert len(names) == 30, names


def test_parameters_points_to_remote_parameters(main: GroupRun) -> None:
    main.check("unsupported/parameters")


def test_repr_describes_the_remote_module(main: GroupRun) -> None:
    main.check("unsupported/repr")


# ============================================================================ 4. module RRef
@pytest.mark.parametrize(
    "name",
    [
        "get_module_rref",
        "remote_parameters",
        "init_from_module_rref",
        "init_from_module_rref_over_rpc",
        "torchscript_refused",
    ],
)
def test_module_rref(main: GroupRun, name: str) -> None:
    main.check(f"rref/{name}")


def test_remote_parameters_recurse(main: GroupRun) -> None:
    assert main.check("rref/remote_parameters") == [5, 1]


# ============================================================================ 5. train / eval
def test_train_eval(main: GroupRun) -> None:
    main.check("train_eval/modes")


# ============================================================================ 6. pickling
@pytest.mark.parametrize(
    "name",
    [
        "plain_refused",
        "sent_to_third_worker",
        "sent_to_owner",
        "sent_in_remote",
        "training_mode_travels",
        "returned_from_rpc",
        "new_attribute_not_sent",
        "created_on_another_worker",
        "kept_by_third_worker_after_creator_dropped_it",
    ],
)
def test_pickling(main: GroupRun, name: str) -> None:
    main.check(f"pickle/{name}")


# ============================================================================ 7. errors
@pytest.mark.parametrize(
    "name",
    ["constructor_raises", "callable_returns_no_module", "class_not_a_module", "module_cls_not_importable"],
)
def test_errors(main: GroupRun, name: str) -> None:
    main.check(f"errors/{name}")


# ============================================================================ 8. training
@pytest.mark.parametrize(
    "name",
    ["remote_only_equals_local", "hybrid_equals_local", "forward_async_micro_batches_equal_local"],
)
def test_training_equals_local(main: GroupRun, name: str) -> None:
    main.check(f"train/{name}")


# ============================================================================ 9. pipeline
@pytest.mark.parametrize("name", ["torch_wait_all", "chained_then", "collect_all", "errors_reach_wait_all"])
def test_pipeline(main: GroupRun, name: str) -> None:
    main.check(f"pipeline/{name}")


# ============================================================================ 10. no leak, clean exit
@pytest.mark.parametrize("name", ["all_dropped_before_training", "all_dropped"])
def test_no_rref_left_behind(main: GroupRun, name: str) -> None:
    main.check(f"leak/{name}")


def test_clean_exit(main: GroupRun) -> None:
    main.assert_clean_exit()
    for out in main.outcomes:
        for symptom in ("still outstanding", "barrier failed"):
            assert symptom not in out.log, f"{out.label} logged {symptom!r}:\n{out.log_tail()}"
