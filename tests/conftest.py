"""Shared test setup.

The RPC tests' helper modules (``_harness``, ``rpc_functions``, ``rpc_scenarios``) live next to
the tests and are imported by name, both here and in the worker processes.
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture
def two_hosts() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two "hosts": network namespaces joined by a veth pair, ((name, address), ...)."""
    import _netns

    reason = _netns.unavailable()
    if reason:
        pytest.skip(reason)
    with _netns.two_hosts(f"{os.getpid() % 100000}") as hosts:
        yield hosts
