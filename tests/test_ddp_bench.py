"""bench/run.py ddp --quick: DDP over rpcdist and over gloo both train, and the table reports them.

Only the shape of the output is checked, never a time (the machines are far too noisy): one
world size and one model keep it short; the full run is ``python bench/run.py ddp``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_c10d_bench import table_row

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"
NUMBER = r"[\d,]+(?:\.\d+)?"

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo"
)


@pytest.mark.timeout(300)
def test_quick_ddp_bench_measures_both_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import test_c10d_bench

    monkeypatch.setattr(test_c10d_bench, "BENCH", RUN)  # its runner, on the one driver
    out_json = tmp_path / "ddp.json"
    stdout, _ = test_c10d_bench.run_bench(
        ["ddp", "--quick", "--worlds", "2", "--models", "cnn", "--json", str(out_json)], timeout=280
    )
    lines = stdout.splitlines()
    assert lines[0].startswith("DDP over rpcdist vs gloo"), stdout
    assert lines[1] == "target: a training step within 1x gloo's time", stdout
    cells = table_row(lines, "CNN 2 conv + 2 dense (1.1 M params), batch 32, 2 ranks")
    assert cells[0] == "ms", cells
    # both backends trained (a number, not ERR/HANG) and the ratio and verdict follow from them
    assert re.fullmatch(NUMBER, cells[1]) and re.fullmatch(NUMBER, cells[2]), stdout
    assert re.fullmatch(r"[\d.]+x", cells[3]), cells
    assert cells[4:7] in (["<=", "1x", "yes"], ["<=", "1x", "NO"]), cells
    assert not any(ln.startswith("MLP") for ln in lines), "--models cnn ran the MLP too"

    doc = json.loads(out_json.read_text())
    assert {(r["system"], r["world"]) for r in doc["rounds"]} == {("gloo", 2), ("rpcdist", 2)}
    assert set(doc["summary"]) == {"cnn_w2"}
    assert doc["failures"] == [], doc["failures"]
    for rnd in doc["rounds"]:
        assert len(rnd["results"]["cnn"]["rank_median_us"]) == 2, rnd["results"]
