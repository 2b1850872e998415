#!/usr/bin/env python
"""``python bench/rpc_bench.py [flags]`` = ``python bench/run.py rpc [flags]`` (see scenarios/rpc.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # children get this sys.path too

if __name__ == "__main__":
    import _driver

    _driver.entry("rpc")
