"""The torch test classes this harness runs: one line each, ``"<module>:<class>"``.

Each is one of the generic suites torch runs against every agent (``GENERIC_TESTS`` in
``torch/testing/_internal/distributed/rpc_utils.py``), from torch's wheel. Adding a suite is
adding its line (and, if some of its tests need torch internals, their entries in
``skips.py``); ``test_torch_suites.py`` makes the test classes from this list.
"""

from __future__ import annotations

import importlib

SUITES: list[str] = [
    "torch.testing._internal.distributed.nn.api.remote_module_test:RemoteModuleTest",
    "torch.testing._internal.distributed.nn.api.remote_module_test:ThreeWorkersRemoteModuleTest",
]


def load() -> list[type]:
    """The suite classes of :data:`SUITES` (importing their modules)."""
    classes = []
    for entry in SUITES:
        module_name, _, class_name = entry.partition(":")
        classes.append(getattr(importlib.import_module(module_name), class_name))
    return classes
