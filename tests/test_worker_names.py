"""Worker names follow torch's rule, with torch's error wording (torch's test_invalid_names)."""

from __future__ import annotations

import pytest

from rpcdist.errors import MembershipError
from rpcdist.rpc import WorkerInfo


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("abc*", "Worker name must match"),
        (" ", "Worker name must match"),
        ("", "must be non-empty"),
        ("a" * 500, "shorter than 128"),
        ("has/slash", "Worker name must match"),
    ],
)
def test_invalid_worker_names_are_refused_with_torchs_words(name: str, match: str) -> None:
    with pytest.raises(RuntimeError, match=match) as raised:
        WorkerInfo(name, 0)
    assert isinstance(raised.value, MembershipError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("name", ["worker0", "ps", "trainer_1", "c10d-rank3", "job:7"])
def test_valid_worker_names(name: str) -> None:
    assert WorkerInfo(name, 3).name == name
