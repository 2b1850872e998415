"""The harness is honest: torch's tests reach rpcdist, and only the reviewed skips are skipped.

``RpcdistSubstitutionProbe`` is made and run exactly like the torch suites (``probe.py``
written as torch writes its suites, + the rpcdist fixture + SpawnHelper): in its workers,
``torch.distributed.rpc`` & co. are rpcdist's, every call goes through rpcdist's agent, and
torch's own agent never starts. The other tests check this (the pytest) process and the
skip list.
"""

from __future__ import annotations

import unittest

import pytest
import torch.distributed.rpc
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

from compat import launcher, probe, skips, substitution, suites
from compat.fixture import RpcdistRpcAgentTestFixture

pytestmark = pytest.mark.timeout(90)

globals().update(
    launcher.generate_tests("Rpcdist", RpcdistRpcAgentTestFixture, [probe.SubstitutionProbe], __name__)
)


def test_pytest_process_keeps_torch_rpc() -> None:
    """Only the workers install the substitution: the tests that share this process see torch."""
    assert not substitution.installed()
    assert torch.distributed.rpc.rpc_sync.__module__ == "torch.distributed.rpc.api"
    assert not isinstance(torch.distributed.rpc, substitution.StandIn)


def test_classes_are_composed_as_torch_composes_them() -> None:
    """suite + agent fixture + MultiProcessTestCase, as torch's TensorPipe classes; named after
    the suite, in the module the workers unpickle them from."""
    generated = launcher.generate_tests("Rpcdist", RpcdistRpcAgentTestFixture, suites.load(), "somewhere")
    assert list(generated) == [f"Rpcdist{suite.__name__}" for suite in suites.load()]
    for suite, cls in zip(suites.load(), generated.values(), strict=True):
        assert cls.__bases__ == (suite, RpcdistRpcAgentTestFixture, launcher.SpawnHelper)
        assert issubclass(cls, RpcAgentTestFixture) and issubclass(cls, MultiProcessTestCase)
        assert cls.__module__ == "somewhere" and cls.torch_suite is suite


def test_skip_list_names_existing_tests_with_an_admitted_category() -> None:
    by_name = {suite.__name__: suite for suite in suites.load()}
    for key, skip in skips.SKIPS.items():
        suite_name, _, method = key.partition(".")
        assert suite_name in by_name, f"{key}: no suite {suite_name} in suites.SUITES"
        assert method.startswith("test") and callable(getattr(by_name[suite_name], method, None)), key
        assert skip.category in skips.CATEGORIES, f"{key}: category {skip.category!r} is not admitted"
        assert skip.reason.strip(), f"{key}: no reason"


def test_known_failures_name_existing_tests_and_are_not_skips() -> None:
    """KNOWN_FAILURES is separate from the reviewed skip list: public behaviours not yet
    implemented, each a real test of a suite, none also skipped."""
    by_name = {suite.__name__: suite for suite in suites.load()}
    for key, (reason, _timeout) in skips.KNOWN_FAILURES.items():
        suite_name, _, method = key.partition(".")
        assert suite_name in by_name, f"{key}: no suite {suite_name} in suites.SUITES"
        assert method.startswith("test") and callable(getattr(by_name[suite_name], method, None)), key
        assert key not in skips.SKIPS, f"{key}: both skipped and a known failure"
        assert reason.startswith(skips.KNOWN_FAILURE_PREFIX), f"{key}: {reason!r}"


def test_only_listed_tests_are_skipped() -> None:
    """Every generated test that does not run as torch wrote it is in the skip list."""
    generated = launcher.generate_tests("Rpcdist", RpcdistRpcAgentTestFixture, suites.load(), __name__)
    for cls in generated.values():
        for name in unittest.TestLoader().getTestCaseNames(cls):
            key = f"{cls.torch_suite.__name__}.{name}"
            changed = getattr(cls, name) is not getattr(cls.torch_suite, name)
            assert changed == (key in skips.SKIPS or key in skips.KNOWN_FAILURES), key
