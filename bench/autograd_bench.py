#!/usr/bin/env python
"""``python bench/autograd_bench.py [flags]`` runs ``python bench/run.py autograd [flags]``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # children get this sys.path too

if __name__ == "__main__":
    import _driver

    _driver.entry("autograd")
