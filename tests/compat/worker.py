"""What every worker process has loaded before it is forked (the harness's fork server preload).

Order matters: torch's framework modules first, so that torch's own internals keep the real
``torch.distributed.rpc`` & co.; then the substitution; then torch's suites and the generated
test classes, which therefore import rpcdist under torch's names. A worker only has to unpickle
its test class (already imported here) and run its test.

Never imported by the pytest process.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch  # noqa: F401 - loaded once, in the fork server
import torch.testing._internal.common_distributed  # noqa: F401 - torch's framework, torch's own RPC

from compat import substitution

substitution.install()

from compat import suites  # noqa: E402 - after install(), by design

suites.load()
for _test_module in sorted(Path(__file__).parent.glob("test_*.py")):  # the generated classes
    importlib.import_module(f"compat.{_test_module.stem}")
