"""Shared test setup.

The RPC tests' helper modules (``_harness``, ``rpc_functions``, ``rpc_scenarios``) live next to
the tests and are imported by name, both here and in the worker processes.
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import _etcd
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


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_etcd.EtcdCluster]:
    """A real etcd server (one member, ephemeral ports) for a module's tests; skips, saying why,
    when etcd is not installed (Debian's etcd-server; .ci/run installs it)."""
    reason = _etcd.unavailable()
    if reason:
        pytest.skip(reason)
    with _etcd.EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster
