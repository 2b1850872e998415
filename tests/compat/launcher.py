"""The concrete test classes and their worker processes, composed the way torch composes its own.

torch's ``test/distributed/rpc/test_tensorpipe_agent.py`` makes each concrete class as
``class TensorPipe<Suite>(<Suite>, TensorPipeRpcAgentTestFixture, SpawnHelper)`` (with
``rpc_utils.generate_tests`` in some versions): the suite's tests, the agent fixture, and a
``MultiProcessTestCase`` whose ``setUp`` starts one worker process per rank. In the pytest
process each test method only waits for the workers and checks their exit codes; each worker
builds the test object again, runs the method for its rank (``dist_init`` starts and stops RPC),
and exits 0, or non-zero with the traceback sent to the pytest process.

:func:`generate_tests` does the same with :class:`~compat.fixture.RpcdistRpcAgentTestFixture`
and :class:`SpawnHelper`, and applies the skip list (``skips.py``).

The one difference is how workers start. torch spawns a fresh interpreter per worker (seconds
of imports each); here they are forked from a fork server of their own that has already
imported torch, rpcdist and the suites *with the substitution installed* (``compat.worker``).
It is a second ``multiprocessing`` fork server, not the global one: ``tests/_harness.py`` uses
that for workers that must see torch's modules unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
import traceback
import unittest
from collections.abc import Callable, Iterator
from multiprocessing import context, forkserver, popen_forkserver, spawn, util
from pathlib import Path
from typing import Any

import pytest
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiProcessTestCase

import rpcdist.rpc
from compat.fixture import RPCDIST_STORE_SUFFIX
from compat.skips import KNOWN_FAILURES, SKIPS, TORCHSCRIPT, KnownFailure, Skip
from rpcdist.nn.api import remote_module

TESTS_DIR = Path(__file__).resolve().parent.parent  # holds the `compat` package
# Keep every worker to one compute thread: the machine is small and its cores are shared.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# pytest first: a worker started from `python -m pytest`/`pytest` imports it as its main module.
PRELOAD = ["pytest", "compat.worker"]


# ============================================================================ worker processes
_server: forkserver.ForkServer | None = None
_server_lock = threading.Lock()


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fork_server() -> forkserver.ForkServer:
    """This harness's fork server, started on first use (it lives as long as this process)."""
    global _server
    with _server_lock:
        if _server is None:
            server = forkserver.ForkServer()
            server.set_forkserver_preload(PRELOAD)
            # Python 3.11's fork server ignores the sys.path it is sent: PYTHONPATH finds `compat`.
            path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
            with _environ({**THREAD_ENV, "PYTHONPATH": path}):
                server.ensure_running()
            _server = server
        return _server


class _Popen(popen_forkserver.Popen):
    """``multiprocessing.popen_forkserver.Popen`` that asks :func:`fork_server` for the process
    (its ``_launch`` is CPython's, with the server made explicit)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            context.reduction.dump(prep_data, buf)
            context.reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = fork_server().connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of its parent (see CPython's _launch)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class WorkerProcess(context.ForkServerProcess):
    """A ``multiprocessing.Process`` forked from :func:`fork_server`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:  # noqa: N802 - multiprocessing's name
        return _Popen(process_obj)


# ============================================================================ test classes
def listed_skip(test: unittest.TestCase) -> Skip | None:
    """The skip-list entry of a generated test, if it has one."""
    suite = getattr(type(test), "torch_suite", None)
    if suite is None:
        return None
    return SKIPS.get(f"{suite.__name__}.{test._testMethodName}")


class SpawnHelper(MultiProcessTestCase):
    """torch's ``SpawnHelper``: start the workers in ``setUp`` (from this harness's fork server
    instead of a fresh interpreter each)."""

    torch_suite: type | None = None  # the torch class whose tests these are (generate_tests)

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(WorkerProcess)

    def tearDown(self) -> None:
        super().tearDown()
        rpcdist_file = f"{self.file_name}{RPCDIST_STORE_SUFFIX}"  # the file:// rendezvous
        for leftover in (self.file_name, f"{self.file_name}.lock", rpcdist_file, f"{rpcdist_file}.lock"):
            with contextlib.suppress(OSError):  # (FileStore removes both once all workers left)
                os.remove(leftover)

    def _check_return_codes(self, fn: Any, elapsed_time: float) -> None:
        """torch's checks of the workers' exit codes; a worker's skip of a listed TorchScript
        test is reported with its reason from ``skips.py`` (torch's own says only "skipped")."""
        try:
            super()._check_return_codes(fn, elapsed_time)
        except unittest.SkipTest:
            skip = listed_skip(self)
            if skip is None or skip.category != TORCHSCRIPT:
                raise
            raise unittest.SkipTest(_describe(skip)) from None


def _describe(skip: Skip) -> str:
    return f"{skip.category}: {skip.reason} (tests/compat/skips.py)"


def _is_torchscript_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is rpcdist's refusal of a TorchScript RemoteModule (raised in this
    process by ``rpcdist.nn.api.remote_module._refuse_torchscript``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        isinstance(exc, ValueError)
        and bool(frames)
        and frames[-1].name == "_refuse_torchscript"
        and Path(frames[-1].filename).resolve() == Path(remote_module.__file__).resolve()
    )


def _until_torchscript_refused(test: Callable[..., Any], skip: Skip) -> Callable[..., Any]:
    """Run ``test`` (a ``dist_init`` test); if it stops at rpcdist's refusal of a TorchScript
    RemoteModule, end RPC as ``dist_init`` would have and report the test skipped."""

    @functools.wraps(test)
    def run(self: unittest.TestCase, *args: Any, **kwargs: Any) -> Any:
        try:
            return test(self, *args, **kwargs)
        except ValueError as exc:
            if not _is_torchscript_refusal(exc):
                raise
            rpcdist.rpc.shutdown()  # dist_init's shutdown, which the exception skipped
            raise unittest.SkipTest(_describe(skip)) from exc

    return run


def _known_failure(test: Callable[..., Any], known: KnownFailure) -> Callable[..., Any]:
    """``test`` unchanged, reported by pytest as xfail (strict=False) with its reason; a known
    hang gets its shorter timeout (torch's TIMEOUT_OVERRIDE, keyed by method name)."""
    if known.timeout is not None:
        common_distributed.TIMEOUT_OVERRIDE[test.__name__] = known.timeout

    @functools.wraps(test)
    def run(self: unittest.TestCase, *args: Any, **kwargs: Any) -> Any:
        return test(self, *args, **kwargs)

    reason = f"{known.reason} (tests/compat/skips.py KNOWN_FAILURES)"
    return pytest.mark.xfail(reason=reason, strict=False)(run)


def _apply_skips(suite: type) -> dict[str, Any]:
    """The class attributes that apply ``skips.py`` (SKIPS, then KNOWN_FAILURES) to the tests of
    ``suite``."""
    overrides: dict[str, Any] = {}
    for key, skip in SKIPS.items():
        suite_name, _, method = key.partition(".")
        if suite_name != suite.__name__:
            continue
        test = getattr(suite, method, None)
        if test is None:
            continue  # a stale entry: test_substitution.py fails on it
        if skip.category == TORCHSCRIPT:
            overrides[method] = _until_torchscript_refused(test, skip)
        else:
            overrides[method] = unittest.skip(_describe(skip))(test)
    for key, known in KNOWN_FAILURES.items():
        suite_name, _, method = key.partition(".")
        test = getattr(suite, method, None)
        if suite_name == suite.__name__ and test is not None and key not in SKIPS:
            overrides[method] = _known_failure(test, known)
    return overrides


def generate_tests(prefix: str, mixin: type, tests: list[type], module_name: str) -> dict[str, type]:
    """torch's ``rpc_utils.generate_tests``: for each suite in ``tests`` the class
    ``<prefix><Suite>(Suite, mixin, SpawnHelper)``, placed in ``module_name`` (the workers
    unpickle it from there), with the skip list applied. Returns {class name: class}."""
    classes: dict[str, type] = {}
    for suite in tests:
        name = f"{prefix}{suite.__name__}"
        namespace = {"torch_suite": suite, "__module__": module_name, **_apply_skips(suite)}
        classes[name] = type(name, (suite, mixin, SpawnHelper), namespace)
    return classes
