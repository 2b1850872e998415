"""Point-to-point c10d operations (``import rpcdist as dist``): send/recv on every dtype,
isend/irecv, any-source receives that report the sender, tag matching, in-order delivery
between a pair of ranks, batch_isend_irecv with P2POp, sub-groups, and clear errors (wrong
receive shape or dtype, bad peers).

One launch of three ranks (``c10d_scenarios.c10d_p2p``); every check uses tags of its own.
"""

from __future__ import annotations

import pytest
from _harness import GroupRun
from c10d_functions import assert_checks, launch

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return launch(tmp_path_factory.mktemp("c10d_p2p"), "c10d_p2p", 3, "env", timeout=180)


@pytest.mark.parametrize(
    "name",
    [
        "send_recv",
        "isend_irecv",
        "recv_any_source",
        "irecv_any_source_result",
        "tag_matching",
        "tag_matching_any_source",
        "ordered_100_isends",
        "ordered_100_irecvs_posted_first",
        "ordered_per_sender_any_source",
        "batch_isend_irecv_ring",
        "batch_isend_irecv_both_ways",
        "large_tensor",
        "non_contiguous_send",
        "sub_group",
        "recv_wrong_shape",
        "bad_peer",
        "usable_after",
    ],
)
def test_p2p(run: GroupRun, name: str) -> None:
    assert_checks(run, [f"p2p/{name}"], range(3))


def test_clean_exit(run: GroupRun) -> None:
    run.assert_clean_exit()
