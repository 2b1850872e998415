"""What the c10d tests (``test_collectives``, ``test_p2p``) and their worker scenarios
(``c10d_scenarios``) share: the tables of cases (dtypes, reduce ops, collectives) that name
the recorded checks, and the launcher of the workers.

Standard library only: the test process imports it and never needs torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from _harness import GroupRun, ProcSpec, run_processes

# ============================================================================ case tables
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPES = ("int32", "int64")
DTYPES = (*FLOAT_DTYPES, *INT_DTYPES, "bool")
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
BITWISE_OPS = ("BAND", "BOR", "BXOR")

# Reductions, each run for every (dtype, op) that applies: check "<collective>/<dtype>/<op>".
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
# Data movement, each run for every dtype: check "<collective>/<dtype>".
DATA_MOVEMENT = (
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single/even",
    "all_to_all_single/split_sizes",
)
# One-element (and 0-dim where torch allows it) tensors: check "tiny/<collective>".
TINY = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)
# all_reduce above the ring threshold (256 KiB), uneven segments: check "ring/<dtype>/<op>".
RING_CASES = (
    ("float32", "SUM"),
    ("float32", "AVG"),
    ("float64", "MAX"),
    ("float16", "SUM"),
    ("bfloat16", "AVG"),
    ("int64", "PRODUCT"),
    ("int32", "BXOR"),
    ("bool", "BAND"),
)
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


def ops_for(dtype: str) -> tuple[str, ...]:
    """The reduce ops that apply to ``dtype``: bitwise ones on integers and bool only; AVG on
    floating point only (torch's gloo has no AVG at all; integer averages are not defined)."""
    if dtype in FLOAT_DTYPES:
        return ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
    return ("SUM", "PRODUCT", "MIN", "MAX", *BITWISE_OPS)


def reduction_checks(collective: str, dtype: str) -> list[str]:
    return [f"{collective}/{dtype}/{op}" for op in ops_for(dtype)]


# ============================================================================ launching
class ImportInWorker:
    """A parameter that, unpickled in the worker before its scenario starts, imports a module.

    ``_harness`` looks scenarios up on ``rpc_scenarios``; ``c10d_scenarios`` registers its own
    there when imported. Passing one of these in the params makes every worker import it (the
    scenario receives the module object and ignores it).
    """

    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> Any:
        return importlib.import_module, (self.module,)


def launch(
    workdir: Path,
    scenario: str,
    world_size: int,
    init: str = "env",
    *,
    params: dict[str, Any] | None = None,
    timeout: float = 150.0,
) -> GroupRun:
    """Run ``c10d_scenarios.<scenario>`` on ranks ``0..world_size-1`` and wait for them."""
    base = {"scenarios_module": ImportInWorker("c10d_scenarios"), **(params or {})}
    specs = [ProcSpec(scenario, rank, world_size, dict(base)) for rank in range(world_size)]
    return run_processes(workdir, specs, init, timeout=timeout)


def assert_checks(run: GroupRun, names: list[str] | tuple[str, ...], ranks: range | list[int]) -> None:
    """Every check in ``names`` passed on every rank in ``ranks``; one error lists all failures."""
    failures = []
    for rank in ranks:
        for name in names:
            try:
                run.check(name, rank=rank)
            except AssertionError as exc:
                text = str(exc)
                failures.append(f"[rank {rank}] {name}: {text[:4000]}{' [...]' if len(text) > 4000 else ''}")
    if failures:
        raise AssertionError(f"{len(failures)} failing check(s):\n\n" + "\n\n".join(failures))
