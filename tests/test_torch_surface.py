"""rpcdist mirrors torch's public distributed surface, and the names added for it work.

Parity: the public names of ``torch.distributed``, ``torch.distributed.rpc``,
``torch.distributed.autograd``, and the public methods of ``DistributedOptimizer`` and
``RemoteModule`` must each exist in rpcdist's counterpart (``rpcdist``, ``rpcdist.rpc``,
``rpcdist.autograd``, ``rpcdist.optim.DistributedOptimizer``, ``rpcdist.nn.RemoteModule``), be
excluded with a reason in ``surface_exclusions.EXCLUDED``, or be listed in
``surface_exclusions.PENDING`` (reported as xfail until they land). "Public" is ``__all__``
where the module defines it, else ``dir()`` without ``_`` names and submodules; for classes,
the public methods. A torch callable must be callable in rpcdist too. When torch gains a public
name, or an exclusion names something torch dropped or rpcdist now has, a test here fails.

Behaviour: the c10d names added for torch parity (sub-groups, object send/recv, coalesced and
``*_single`` collectives, group introspection, backend queries, ``record_comm``,
``breakpoint``, rendezvous handlers) run on real process groups (4 ranks over file://, and 2
ranks joined through a registered handler returning torch's own TCPStore).
"""

from __future__ import annotations

import importlib
import inspect
import types
import uuid
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import rpc_scenarios
import torch
import torch.distributed as tdist
from _harness import check, run_group
from c10d_functions import ImportInWorker
from surface_exclusions import CATEGORIES, EXCLUDED, PENDING

import rpcdist as dist
from rpcdist.errors import RpcError

# (torch's object, rpcdist's object, what is compared)
SURFACES = [
    ("torch.distributed", "rpcdist", "module"),
    ("torch.distributed.rpc", "rpcdist.rpc", "module"),
    ("torch.distributed.autograd", "rpcdist.autograd", "module"),
    ("torch.distributed.optim.DistributedOptimizer", "rpcdist.optim.DistributedOptimizer", "methods"),
    ("torch.distributed.nn.RemoteModule", "rpcdist.nn.RemoteModule", "methods"),
]


def resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def public_names(obj: Any, kind: str) -> set[str]:
    if kind == "module":
        if hasattr(obj, "__all__"):
            return set(obj.__all__)
        return {
            n for n in dir(obj) if not n.startswith("_") and not isinstance(getattr(obj, n), types.ModuleType)
        }
    return {n for n in dir(obj) if not n.startswith("_") and inspect.isroutine(getattr(obj, n, None))}


def _torch_surface(torch_path: str, kind: str) -> set[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns on some deprecated names when touched
        return public_names(resolve(torch_path), kind)


def _mirror_problem(torch_obj: Any, ours: Any, name: str, kind: str) -> str | None:
    """Why rpcdist's ``name`` does not stand in for torch's, or None."""
    if not hasattr(ours, name):
        return "missing"
    mine = getattr(ours, name)
    if kind == "methods":
        return None if callable(mine) else "not a method"
    theirs = getattr(torch_obj, name, None)  # torch's __all__ may name what it does not define
    if theirs is None:
        return None
    if callable(theirs) and not callable(mine):
        return f"torch's is callable, rpcdist's is a {type(mine).__name__}"
    if (
        not callable(theirs)
        and isinstance(mine, types.ModuleType)
        and not isinstance(theirs, types.ModuleType)
    ):
        return f"torch's is a {type(theirs).__name__}, rpcdist's a module"
    return None


@pytest.mark.parametrize(("torch_path", "ours_path", "kind"), SURFACES, ids=[s[0] for s in SURFACES])
def test_every_public_torch_name_is_mirrored_or_excluded(torch_path: str, ours_path: str, kind: str) -> None:
    theirs = _torch_surface(torch_path, kind)
    try:
        ours = resolve(ours_path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{ours_path} does not exist ({exc}); it has to mirror {torch_path}: {sorted(theirs)}")
    torch_obj = resolve(torch_path)
    problems = {}
    for name in sorted(theirs):
        full = f"{torch_path}.{name}"
        if full in EXCLUDED or full in PENDING:
            continue
        problem = _mirror_problem(torch_obj, ours, name, kind)
        if problem:
            problems[full] = problem
    assert not problems, (
        f"{len(problems)} public torch name(s) {ours_path} neither mirrors nor excludes "
        f"(implement them, or add them to tests/surface_exclusions.py with a reason):\n"
        + "\n".join(f"  {name}: {why}" for name, why in problems.items())
    )


def _surface_of(full: str) -> tuple[str, str, str, str]:
    for torch_path, ours_path, kind in sorted(SURFACES, key=lambda s: -len(s[0])):
        if full.startswith(torch_path + "."):
            return torch_path, ours_path, kind, full[len(torch_path) + 1 :]
    raise AssertionError(f"{full} is not under any compared torch surface")


@pytest.mark.parametrize("full", sorted({**EXCLUDED, **PENDING}))
def test_exclusions_and_pending_names_are_current(full: str) -> None:
    """Each listed name is still public in torch; an excluded one is still absent here."""
    torch_path, ours_path, kind, name = _surface_of(full)
    assert name in _torch_surface(torch_path, kind), f"torch no longer has {full}: drop it from the list"
    if full in EXCLUDED:
        try:
            ours = resolve(ours_path)
        except (ImportError, AttributeError):
            return
        assert not hasattr(ours, name), f"{ours_path}.{name} exists now: remove {full} from EXCLUDED"


@pytest.mark.parametrize("full", sorted(EXCLUDED))
def test_every_exclusion_gives_a_reason_in_a_category(full: str) -> None:
    category, _, why = EXCLUDED[full].partition(":")
    assert category in CATEGORIES, f"{full}: reason must start with one of {CATEGORIES}"
    assert len(why.strip()) > 15, f"{full}: say why"


@pytest.mark.parametrize(
    "full",
    [pytest.param(f, marks=pytest.mark.xfail(reason=PENDING[f], strict=True)) for f in sorted(PENDING)],
)
def test_pending_name_has_landed(full: str) -> None:
    torch_path, ours_path, kind, name = _surface_of(full)
    assert _mirror_problem(resolve(torch_path), resolve(ours_path), name, kind) is None


# ============================================================================ without a group
def test_constants_are_torchs() -> None:
    import torch.distributed.constants as torch_constants

    assert dist.constants.default_pg_timeout == torch_constants.default_pg_timeout
    assert dist.default_pg_timeout == torch_constants.default_pg_timeout
    assert dist.constants.default_pg_nccl_timeout == torch_constants.default_pg_nccl_timeout
    assert set(dist.constants.__all__) == set(torch_constants.__all__)


def test_backend_queries() -> None:
    assert dist.is_available() and dist.is_gloo_available()
    for name in ("nccl", "mpi", "ucc", "xccl"):
        assert getattr(dist, f"is_{name}_available")() is False
        assert not dist.is_backend_available(name)
    assert dist.is_backend_available("gloo") and dist.is_backend_available("grpc")
    assert dist.is_backend_available("cpu:gloo") and not dist.is_backend_available("cpu:gloo,cuda:nccl")
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError):
        dist.get_default_backend_for_device("meta")
    config = dist.BackendConfig("cpu:gloo,cuda:nccl")
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert str(config) == "cpu:gloo,cuda:nccl"
    assert str(dist.BackendConfig("gloo")) == "cpu:gloo"
    with pytest.raises(ValueError):
        dist.BackendConfig("cpu:gloo,cpu:grpc")
    with pytest.raises(ValueError):
        dist.BackendConfig("cpu:gloo:x")


def test_environment_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.get_node_local_rank(fallback_rank=3) == 2
    assert dist.is_torchelastic_launched()
    assert dist.get_pg_count() == 0  # no group in this process


def test_supports_complex_as_torch() -> None:
    for op in dist.ReduceOp:
        assert dist.supports_complex(op) == tdist.supports_complex(getattr(tdist.ReduceOp, op.name))


def test_debug_level(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    logger = logging.getLogger("rpcdist")
    before, level = dist.get_debug_level(), logger.level
    try:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL == tdist.DebugLevel.DETAIL
        assert logger.level == logging.DEBUG
        assert tdist.get_debug_level() == tdist.DebugLevel.DETAIL  # torch code in this process follows
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() == dist.DebugLevel.INFO and logger.level == logging.INFO
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "loud")
        with pytest.raises(ValueError):
            dist.set_debug_level_from_env()
        dist.set_debug_level(dist.DebugLevel.OFF)
        assert logger.level == level  # put back as it was
    finally:
        dist.set_debug_level(before)
        tdist.set_debug_level(tdist.DebugLevel.OFF)


def test_rpc_and_autograd_names() -> None:
    import rpcdist.autograd as dist_autograd
    import rpcdist.rpc as rpc

    assert rpc.is_available() and dist_autograd.is_available()
    assert rpc.backend_registered("TENSORPIPE") and not rpc.backend_registered("NO_SUCH_BACKEND")
    options = rpc.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, rpc_timeout=7, init_method="tcp://127.0.0.1:1", num_worker_threads=3
    )
    assert (options.rpc_timeout, options.init_method, options.num_worker_threads) == (
        7,
        "tcp://127.0.0.1:1",
        3,
    )
    with pytest.raises(RpcError):
        rpc.get_rpc_timeout()  # RPC is not initialized here
    assert dist_autograd.DistAutogradContext.__name__ == "DistAutogradContext"


def test_rendezvous_handlers_and_callable_module() -> None:
    scheme = f"mem{uuid.uuid4().hex[:8]}"
    seen: list[str] = []

    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        seen.append(url)
        query = parse_qs(urlparse(url).query)
        yield tdist.HashStore(), int(query["rank"][0]), int(query["world_size"][0])

    dist.register_rendezvous_handler(scheme, handler)
    with pytest.raises(RuntimeError, match="already registered"):
        dist.register_rendezvous_handler(scheme, handler)
    with pytest.raises(RuntimeError, match="already registered"):
        dist.register_rendezvous_handler("tcp", handler)
    store, rank, world_size = next(dist.rendezvous(f"{scheme}://somewhere", rank=1, world_size=3))
    assert (rank, world_size) == (1, 3) and isinstance(store, tdist.HashStore)
    assert "rank=1" in seen[0] and "world_size=3" in seen[0]
    with pytest.raises(RuntimeError, match="No rendezvous handler"):
        dist.rendezvous("nosuchscheme://x")
    # ``rpcdist.rendezvous`` is the module and torch's function at once
    assert callable(dist.rendezvous) and dist.rendezvous.Rendezvous is not None


def test_builtin_rendezvous_file(tmp_path: Path) -> None:
    store, rank, world_size = next(dist.rendezvous(f"file://{tmp_path / 'rdv'}", rank=0, world_size=1))
    assert (rank, world_size) == (0, 1)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()


# ============================================================================ on real groups
GROUP_TIMEOUT = timedelta(seconds=90)


def _init(rank: int, world_size: int, init_method: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )


def surface_c10d(rank: int, world_size: int, init_method: str, **_: Any) -> None:  # noqa: C901
    assert world_size == 4
    _init(rank, world_size, init_method)
    try:
        with check("introspection"):
            assert dist.get_process_group_ranks(None) == [0, 1, 2, 3]
            assert dist.get_process_group_ranks(dist.group.WORLD) == [0, 1, 2, 3]
            assert dist.get_pg_count() == 1
            assert dist.get_backend_config() == "cpu:gloo"

        with check("new_subgroups") as c:
            mine, subgroups = dist.new_subgroups(group_size=2)
            expected = [0, 1] if rank < 2 else [2, 3]
            assert len(subgroups) == 2 and dist.get_pg_count() == 3
            assert dist.get_process_group_ranks(mine) == expected
            assert dist.get_group_rank(mine, rank) == rank % 2
            assert dist.get_global_rank(mine, 1) == expected[1]
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mine)
            assert t.item() == sum(expected)
            c.value = t.item()

        with check("new_subgroups_by_enumeration"):
            mine2, groups2 = dist.new_subgroups_by_enumeration([[0, 3], [1]])
            assert dist.get_pg_count() == 5
            if rank == 2:
                assert mine2 is None
                assert all(g is dist.GroupMember.NON_GROUP_MEMBER for g in groups2)
            else:
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=mine2)
                assert t.item() == (3.0 if rank in (0, 3) else 1.0)

        with check("new_subgroups_errors"):
            with pytest.raises(ValueError, match="appeared in both"):
                dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])
            with pytest.raises(ValueError, match="divisible"):
                dist.new_subgroups(group_size=3)
            with pytest.raises(ValueError):
                dist.new_subgroups()  # the CUDA default has no meaning here
            assert dist.get_pg_count() == 5  # no group was made by the failed calls

        with check("send_recv_object_list"):
            peer = rank ^ 1
            payload = [f"from {rank}", {"t": torch.arange(3) * rank}, None]
            if rank % 2 == 0:
                dist.send_object_list(payload, dst=peer)
                box: list[Any] = [0, 0, 0]
                assert dist.recv_object_list(box) == peer  # any source
                assert box[0] == f"from {peer}"
            else:
                box = [0, 0, 0]
                assert dist.recv_object_list(box, src=peer) == peer
                assert box[0] == f"from {peer}" and box[2] is None
                assert torch.equal(box[1]["t"], torch.arange(3) * peer)
                dist.send_object_list(payload, dst=peer)

        with check("object_list_group_ranks"):
            if dist.get_group_rank(mine, rank) == 0:
                dist.send_object_list([rank, "x"], group=mine, group_dst=1)
            else:
                box = [None, None]
                assert dist.recv_object_list(box, group=mine, group_src=0) == expected[0]
                assert box == [expected[0], "x"]

        with check("object_list_errors"):
            with pytest.raises(ValueError):
                dist.send_object_list([1], dst=rank)
            with pytest.raises(ValueError):
                dist.send_object_list([1], dst=rank ^ 1, group_dst=0)
            with pytest.raises(ValueError):
                dist.send_object_list([1])

        with check("coalesced"):
            a = torch.full((2, 3), float(rank))
            b = torch.arange(4.0) + rank
            dist.all_reduce_coalesced([a, b])
            assert torch.equal(a, torch.full((2, 3), 6.0))
            assert torch.equal(b, torch.arange(4.0) * 4 + 6)
            work = dist.all_reduce_coalesced([a], op=dist.ReduceOp.MAX, async_op=True)
            work.wait()
            inputs = [torch.full((2,), rank), torch.full((1, 3), 10 * rank)]
            outputs = [
                [torch.empty(2, dtype=torch.int64), torch.empty(1, 3, dtype=torch.int64)] for _ in range(4)
            ]
            dist.all_gather_coalesced(outputs, inputs)
            for r in range(4):
                assert torch.equal(outputs[r][0], torch.full((2,), r))
                assert torch.equal(outputs[r][1], torch.full((1, 3), 10 * r))
            with pytest.raises(ValueError):
                dist.all_reduce_coalesced([torch.ones(1), torch.ones(1, dtype=torch.int64)])

        with check("single"):
            out = torch.empty(4, 2)
            dist.all_gather_single(out, torch.full((2,), float(rank)))
            assert torch.equal(out, torch.arange(4.0).repeat_interleave(2).view(4, 2))
            full = torch.arange(8.0).view(4, 2) + rank
            part = torch.empty(2)
            dist.reduce_scatter_single(part, full)
            assert torch.equal(part, torch.arange(8.0).view(4, 2)[rank] * 4 + 6)

        with check("record_comm"):
            with dist.record_comm("my_phase"):
                work = dist.all_reduce(torch.ones(1), async_op=True)
                assert "my_phase" in repr(work)
                work.wait()
            work = dist.all_reduce(torch.ones(1), async_op=True)
            assert "my_phase" not in repr(work)
            work.wait()

        with check("breakpoint"):
            for _ in range(2):
                dist.breakpoint(rank=0, skip=2)  # both skipped, on every rank: nobody stops
            dist.breakpoint(rank=world_size, timeout_s=120)  # no such rank stops: just the barrier
            assert dist.group.WORLD.timeout == 120
    finally:
        dist.destroy_process_group()


def _torch_tcp_handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """A rendezvous handler as torch users write them: torch's own TCPStore."""
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    rank, world_size = int(query["rank"][0]), int(query["world_size"][0])
    timeout = kwargs.get("timeout", GROUP_TIMEOUT)
    yield tdist.TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, timeout), rank, world_size


def surface_custom_rendezvous(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> None:
    dist.register_rendezvous_handler("torchtcp", _torch_tcp_handler)
    url = init_method.replace("tcp://", "torchtcp://")
    with check("init_through_handler"):
        _init(rank, world_size, url)
    side_store = None
    try:
        with check("collectives_over_torch_store"):
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3.0
            dist.barrier()
            from rpcdist.collectives import group as group_module

            store = group_module.current_state().store
            assert isinstance(store, dist.TorchStore) and isinstance(store.torch_store, tdist.TCPStore)

        with check("builtin_rendezvous"):
            side_store, r, n = next(
                dist.rendezvous(f"file://{Path(workdir) / 'side.store'}", rank, world_size)
            )
            assert (r, n) == (rank, world_size)
            side_store.set(f"hello/{rank}", str(rank))
            assert side_store.get(f"hello/{1 - rank}", timeout=60) == str(1 - rank).encode()
    finally:
        dist.destroy_process_group()
        if side_store is not None:  # the rank serving the TCPStore leaves last
            side_store.set(f"left/{rank}", b"1")
            side_store.wait([f"left/{r}" for r in range(world_size)], timeout=60)
            side_store.close()


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for fn in (surface_c10d, surface_custom_rendezvous):
        setattr(rpc_scenarios, fn.__name__, fn)


_register()
SCENARIO_PARAMS = {"scenarios_module": ImportInWorker("test_torch_surface")}
C10D_CHECKS = [
    "introspection",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "new_subgroups_errors",
    "send_recv_object_list",
    "object_list_group_ranks",
    "object_list_errors",
    "coalesced",
    "single",
    "record_comm",
    "breakpoint",
]


@pytest.fixture(scope="module")
def c10d_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_group(
        tmp_path_factory.mktemp("surface_c10d"),
        "surface_c10d",
        4,
        "file",
        params=SCENARIO_PARAMS,
        timeout=240,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", C10D_CHECKS)
def test_added_c10d_names_on_four_ranks(c10d_run: Any, name: str) -> None:
    for rank in range(4):
        c10d_run.check(name, rank=rank)


@pytest.mark.timeout(300)
def test_four_rank_run_exits_cleanly(c10d_run: Any) -> None:
    c10d_run.assert_clean_exit()


@pytest.mark.timeout(240)
def test_init_process_group_through_a_registered_handler(tmp_path: Path) -> None:
    run = run_group(tmp_path, "surface_custom_rendezvous", 2, "tcp", params=SCENARIO_PARAMS, timeout=200)
    for rank in range(2):
        for name in ("init_through_handler", "collectives_over_torch_store", "builtin_rendezvous"):
            run.check(name, rank=rank)
    run.assert_clean_exit()
