#!/usr/bin/env python
"""The benchmark driver: ``python bench/run.py <scenario> [--quick] [--repeats N] [--json PATH] ...``.

``python bench/run.py --list`` names the scenarios; ``python bench/run.py <scenario> --help``
shows a scenario's flags. See ``_driver.py`` for what the driver does and ``scenarios/`` for
the workloads.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # children get this sys.path too

import _driver  # noqa: E402
import _harness as H  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nscenarios: {', '.join(_driver.SCENARIOS)}")
        return 0 if argv else 2
    if argv[0] == "--list":
        for name in _driver.SCENARIOS:
            print(f"{name:10s} {_driver.load(name).doc.splitlines()[0]}")
        return 0
    name = argv[0]
    if name not in _driver.SCENARIOS:
        print(
            f"run.py: unknown scenario {name!r}; choose one of: {', '.join(_driver.SCENARIOS)}",
            file=sys.stderr,
        )
        return 2
    return _driver.main(name, argv[1:], prog=f"run.py {name}")


if __name__ == "__main__":
    H.run_main(lambda: main(sys.argv[1:]))
