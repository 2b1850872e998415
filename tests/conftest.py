"""Shared test setup.

The RPC tests' helper modules (``_harness``, ``rpc_functions``, ``rpc_scenarios``) live next to
the tests and are imported by name, both here and in the worker processes.
"""

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
