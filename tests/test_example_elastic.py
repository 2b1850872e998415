"""examples/elastic_parameter_server.py, run the normal way: under rpcdist-run, with --quick.

``rpcdist-run --standalone --nproc-per-node 4`` starts a server and three trainers that join a
dynamic group (``init_rpc(name, world_size=None)``) at different times: trainer1 from the start,
trainer2 later (it trains two epochs and leaves), trainer3 once trainer2 has left. The run must
exit 0, the server must have heard every join and leave, in order, through
``rpc.on_membership_change``; the trainers that stayed must have gone on training after a
trainer left; and the server's parameters must classify the test digits far better than chance.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import _examples
import _harness
import pytest

pytest.importorskip("sklearn")

TIMEOUT = 150  # seconds for the whole run; it takes 20-50 s on 2 busy cores, mostly starting up
EXAMPLE = _examples.EXAMPLES_DIR / "elastic_parameter_server.py"
EXPECTED_CHANGES = "+trainer1 +trainer2 -trainer2 +trainer3 -trainer3 -trainer1"
ACCURACY = re.compile(r"^result: test accuracy ([\d.]+)", re.MULTILINE)
STEPS_AFTER = re.compile(r"^ps: steps after (\w+) left: (.*)$", re.MULTILINE)
EPOCH = re.compile(r"^(trainer\d): epoch +(\d+) .* members: ([\w,]+)$", re.MULTILINE)


def run_launched(*args: str, cwd: Path) -> tuple[str, str]:
    """Run the example under ``python -m rpcdist.run`` (rpcdist-run) on a free port; returns
    its stdout and the report to fail with. Fails the test unless it exits 0 within TIMEOUT."""
    command = [
        sys.executable,
        "-m",
        "rpcdist.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--master-port",
        str(_harness.free_port()),
        str(EXAMPLE),
        *args,
    ]
    proc = subprocess.Popen(
        command,
        cwd=cwd,  # the example must not depend on the current directory
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Its own process group, killed on timeout. The launcher puts each worker in a group of
        # its own, but every worker gets SIGKILL from the kernel when the launcher dies.
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"no result in {TIMEOUT} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    report = f"{' '.join(command)} exited {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert proc.returncode == 0, report
    return stdout, report


def parse_counts(text: str) -> dict[str, int]:
    """``"trainer1 190, trainer3 86"`` -> ``{"trainer1": 190, "trainer3": 86}``."""
    return {name: int(n) for name, n in (item.split() for item in text.split(", "))}


@pytest.mark.timeout(TIMEOUT + 30)
def test_trainers_join_and_leave_while_training_goes_on(tmp_path: Path) -> None:
    stdout, report = run_launched("--quick", "--timeout", str(TIMEOUT - 30), cwd=tmp_path)
    lines = stdout.splitlines()

    # The server heard every join and every leave, in the order of the schedule.
    assert f"ps: membership changes heard: {EXPECTED_CHANGES}" in lines, report
    for trainer in ("trainer1", "trainer2", "trainer3"):
        assert re.search(rf"^ps: {trainer} joined \(rank \d+\)", stdout, re.MULTILINE), report
        assert re.search(rf"^ps: {trainer} left \(rank \d+\) after \d+ steps", stdout, re.MULTILINE), report
        assert re.search(rf"^{trainer}: left the group after \d+ epochs$", stdout, re.MULTILINE), report
    trainer2_left = re.compile(r"^ps: trainer2 left \(rank \d+\) after 86 steps; members: ps, trainer1$")
    assert any(trainer2_left.match(line) for line in lines), report  # its two epochs, then it left

    # A trainer that left stopped nobody: after trainer2 left, trainer1 went on and trainer3 joined
    # and trained its two epochs.
    after = {name: parse_counts(text) for name, text in STEPS_AFTER.findall(stdout)}
    assert set(after) == {"trainer2", "trainer3"}, report
    assert after["trainer2"]["trainer1"] > 0, report
    assert after["trainer2"]["trainer3"] == 2 * 43, report  # two epochs of 1347 digits, batches of 32
    assert set(after["trainer3"]) == {"trainer1"}, report  # then trainer1 was told to finish
    epochs = EPOCH.findall(stdout)
    assert [int(e) for t, e, _ in epochs if t == "trainer3"] == [1, 2], report
    trainer1 = [(int(e), members) for t, e, members in epochs if t == "trainer1"]
    assert [e for e, _ in trainer1] == list(range(1, len(trainer1) + 1)) and len(trainer1) >= 3, report
    seen = [members for _, members in trainer1]  # trainer1's own view of the group changed too
    assert {"ps,trainer1,trainer2", "ps,trainer1,trainer3"} <= set(seen), report
    left = next(i for i, line in enumerate(lines) if trainer2_left.match(line))
    assert any(line.startswith("trainer1: epoch") for line in lines[left:]), report

    match = ACCURACY.search(stdout)
    assert match is not None, f"no result line\n{report}"
    accuracy = float(match.group(1))
    assert accuracy > 0.8, f"test accuracy {accuracy} (chance is 0.1)\n{report}"
    assert "Traceback" not in report and "listener raised" not in report, report
