"""Hypothesis settings of the fuzz tests (``test_fuzz.py``).

``RPCDIST_FUZZ_PROFILE=ci`` (the default) runs a bounded number of examples per target;
``RPCDIST_FUZZ_PROFILE=long`` runs many more (``RPCDIST_FUZZ_EXAMPLES`` overrides the count of
either). No example database is written: CI starts from a clean checkout anyway.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_EXAMPLES = {"ci": 2_000, "long": 200_000}

settings.register_profile(
    "rpcdist-fuzz",
    max_examples=int(
        os.environ.get("RPCDIST_FUZZ_EXAMPLES")
        or PROFILE_EXAMPLES[os.environ.get("RPCDIST_FUZZ_PROFILE", "ci")]
    ),
    deadline=None,  # a loaded 2-core CI machine is slow; hangs are caught by pytest-timeout
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FUZZ = settings.get_profile("rpcdist-fuzz")
