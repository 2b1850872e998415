"""torch's test classes (``suites.SUITES``) against rpcdist, one pytest test per torch test.

The classes are made as torch makes its TensorPipe ones: suite + agent fixture + SpawnHelper
(see ``launcher.py``). In this (the pytest) process they only start the workers and read their
exit codes; the workers run torch's test bodies with rpcdist in place of torch's RPC.
"""

from __future__ import annotations

import pytest

from compat import suites
from compat.fixture import RpcdistRpcAgentTestFixture
from compat.launcher import generate_tests

pytestmark = pytest.mark.timeout(90)

globals().update(generate_tests("Rpcdist", RpcdistRpcAgentTestFixture, suites.load(), __name__))
