"""``bench/mfu_table.py`` (issue 43) on the committed JSONs: every number of the table recomputed from
the JSON fields the benches wrote when they ran (their own summaries), and the Markdown read back
cell by cell, so a misread or swapped column fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
BENCH = REPO / "docs" / "bench"


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[dict, str]:
    from bench import mfu_table

    out = tmp_path_factory.mktemp("mfu")
    result = mfu_table.main(["--out", str(out)])
    assert json.loads((out / "mfu.json").read_text()) == json.loads(json.dumps(result))
    return result, (out / "mfu.md").read_text()


def _rows(result: dict) -> dict[str, dict]:
    return {r["label"]: r for r in result["rows"]}


def test_step_bench_rows_match_the_summaries_they_wrote(table):
    result, _ = table
    assert result["peak_tflops"] == 782.0 and "H200" in result["peak_source"]
    rows = _rows(result)
    variants = json.loads((BENCH / "step_variants_h200.json").read_text())
    runs = {k: v for k, v in variants.items() if isinstance(v, dict)}
    assert len(runs) == 4
    for key, run in runs.items():
        row, s = rows[f"step_variants_h200.json:{key}"], run["summary"]
        for ph in ("rollout", "decode+reward", "train"):
            assert row["phases"][ph]["s"] == pytest.approx(s["phases"][ph]["wall_s"])
            assert row["phases"][ph]["tflop"] == pytest.approx(s["phases"][ph]["model_tflop"])
            assert row["phases"][ph]["tflops"] == pytest.approx(s["phases"][ph]["tflops"])
            assert row["phases"][ph]["mfu"] == pytest.approx(s["phases"][ph]["mfu"])
        assert row["phases"]["rollout"]["tflop"] == pytest.approx(run["flops"]["rollout"] / 1e12)
        assert row["step"]["s"] == pytest.approx(s["step"]["wall_s"])
        assert row["step"]["tflops"] == pytest.approx(s["step"]["tflops"])
        assert row["step"]["mfu"] == pytest.approx(s["step"]["mfu"])
        assert row["step"]["mfu_datasheet"] == pytest.approx(s["step"]["tflops"] / 989.0)
        assert row["measured_rollouts"] == s["measured_rollouts"] and not row["includes_warmup"]
    assert "VAE bfloat16" in rows["step_variants_h200.json:vae_bf16"]["setting"]
    assert "fp8 rollouts" in rows["step_variants_h200.json:fp8_rollouts"]["setting"]


def test_peer_rows_match_the_peer_benchs_own_rates(table):
    result, _ = table
    peer = json.loads((BENCH / "peer_step_h200.json").read_text())
    row, side = _rows(result)["peer_step_h200.json:flow_grpo"], peer["flow_grpo"]
    assert row["trainer"] == "flow_grpo"
    assert row["phases"]["rollout"]["s"] == side["rollout_s"]
    assert row["phases"]["decode+reward"]["s"] == side["reward_s"]
    assert row["phases"]["train"]["tflops"] == pytest.approx(side["train_tflops"])
    assert row["phases"]["rollout"]["tflops"] == pytest.approx(side["rollout_tflops"])
    assert row["step"]["s"] == pytest.approx(side["step_s"])
    assert row["step"]["tflops"] == pytest.approx(side["step_tflops"])


def test_markdown_cells_read_back_as_the_rows(table):
    result, text = table
    rows = _rows(result)
    lines = [line for line in text.splitlines() if line.startswith("| ") and ".json" in line]
    assert len(lines) == len(rows) >= 6
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = rows[cells[0]]
        assert cells[1] == row["trainer"]
        for cell, ph in ((cells[3], "rollout"), (cells[5], "train")):
            tflop, s, tflops, mfu = (v.strip().rstrip("*%") for v in cell.split("/"))
            p = row["phases"][ph]
            assert (float(tflop), float(s), float(tflops)) == pytest.approx(
                (p["tflop"], p["s"], p["tflops"]), abs=0.51
            )
            assert float(mfu) == pytest.approx(100 * p["mfu"], abs=0.051)
        assert float(cells[4].rstrip("*")) == pytest.approx(row["phases"]["decode+reward"]["s"], abs=0.006)
        tflop, s, tflops = (float(v.strip().rstrip("*")) for v in cells[6].split("/"))
        assert (tflop, s, tflops) == pytest.approx(
            (row["step"]["tflop"], row["step"]["s"], row["step"]["tflops"]), abs=0.51
        )
        assert float(cells[7].rstrip("%")) == pytest.approx(100 * row["step"]["mfu"], abs=0.051)
        assert float(cells[8].rstrip("%")) == pytest.approx(100 * row["step"]["mfu_datasheet"], abs=0.051)


def test_like_for_like_peer_json_gives_both_settings(tmp_path):
    from bench import mfu_table

    variants = json.loads((BENCH / "step_variants_h200.json").read_text())
    miles = variants["vae_bf16"]
    old = json.loads((BENCH / "peer_step_h200.json").read_text())
    side = {**old["flow_grpo"], "steps": [{}, {}]}
    peer = {
        "args": old["args"],
        "flops": old["flops"],
        "lora": {"flow_grpo": side, "miles": miles},
        "full": {"flow_grpo": {**side, "train_s": 2 * side["train_s"]}, "miles": None},
    }
    (tmp_path / "peer_step.json").write_text(json.dumps(peer))
    result = mfu_table.main(
        ["--out", str(tmp_path / "o"), "--json", str(tmp_path / "peer_step.json"), "--peak", "1000"]
    )
    rows = _rows(result)
    assert sorted(rows) == [
        "peer_step.json:full:flow_grpo",
        "peer_step.json:lora:flow_grpo",
        "peer_step.json:lora:miles",
    ]
    assert "LoRA" in rows["peer_step.json:lora:flow_grpo"]["setting"]
    assert "LoRA" not in rows["peer_step.json:full:flow_grpo"]["setting"]
    full = rows["peer_step.json:full:flow_grpo"]["phases"]["train"]
    assert full["tflops"] == pytest.approx(old["flops"]["train"] / 1e12 / (2 * side["train_s"]))
    assert full["mfu"] == pytest.approx(full["tflops"] / 1000.0)  # --peak
    assert rows["peer_step.json:lora:miles"]["step"]["s"] == pytest.approx(miles["summary"]["step"]["wall_s"])
    with pytest.raises(SystemExit, match="no such JSON"):
        mfu_table.main(["--out", str(tmp_path), "--json", str(tmp_path / "absent.json")])


def test_benchmarks_md_holds_the_tables_output(table):
    """BENCHMARKS.md's MFU block is the script's output on the committed JSONs (regenerate it with
    ``python bench/mfu_table.py --out OUT`` when a step JSON is added under docs/bench/)."""
    _, text = table
    doc = (REPO / "BENCHMARKS.md").read_text()
    begin, end = "<!-- mfu_table.py: begin -->\n", "\n<!-- mfu_table.py: end -->"
    block = doc[doc.index(begin) + len(begin) : doc.index(end)]
    assert block == text.rstrip("\n")
