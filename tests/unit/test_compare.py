"""``python -m miles.compare``: the paired statistics against a float64 reference, what a run
argument names, the curves from a run's logs, and, on the world (CPU, one process), the prior
evaluated by the tool reproducing the per-sample baseline a training run logged."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from miles.compare.paired import compare_all, paired, verdict
from miles.compare.report import curves, table
from miles.compare.sources import resolve

ROOT = Path(__file__).resolve().parents[2]
LOGGED = ROOT / "docs/learning/compare/logs/trained/eval/step_000000.json"
"""The baseline evaluation a training run wrote (dp2, deterministic mode, 8 prompts x 4 seeds)."""


def _run(scores: dict[tuple[str, int], float]) -> dict:
    return {"names": ["reward"], "scores": {k: {"reward": v} for k, v in scores.items()}}


def test_paired_difference_and_its_standard_error_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(32, generator=g, dtype=torch.float64).tolist()
    b = [x - 0.05 + 0.02 * float(torch.randn(1, generator=g)) for x in a]
    out = paired(a, b, ("a", "b"), z=3.0)
    diffs = [x - y for x, y in zip(a, b)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    assert out["diff"] == pytest.approx(statistics.fmean(diffs), abs=1e-15)
    assert out["se"] == pytest.approx(se, rel=1e-12)
    assert out["verdict"] == f"a > b by {statistics.fmean(diffs) / se:.1f} SE"
    assert paired(b, a, ("b", "a"), z=3.0)["verdict"] == out["verdict"]  # the greater named first
    assert verdict("a", "b", 0.01, 0.01, 3.0) == "a ≈ b (+1.0 SE, under 3)"
    assert verdict("a", "b", 0.0, 0.0, 3.0) == "a = b (identical scores)"


def test_runs_are_paired_by_prompt_and_seed_and_other_samples_are_refused():
    keys = [("p1", 0), ("p1", 1), ("p2", 0), ("p2", 1)]
    a = _run(dict(zip(keys, [0.1, 0.2, 0.3, 0.4])))
    b = _run(dict(zip(reversed(keys), [0.0, 0.1, 0.2, 0.3])))  # another order: paired by key
    twin = _run(dict(zip(keys, [0.0, 0.0, 0.0, 0.1])))
    out = compare_all({"a": a, "b": b, "a negated": twin}, z=3.0, twins={"a": "a negated"})
    pair, sep = out["rewards"]["reward"]["pairs"], out["rewards"]["reward"]["twins"]
    assert [(p["a"], p["b"]) for p in pair] == [("a", "b")]  # the twin is compared with its run only
    assert pair[0]["diff"] == pytest.approx(statistics.fmean([0.1 - 0.3, 0.2 - 0.2, 0.3 - 0.1, 0.4 - 0.0]))
    assert sep[0]["diff"] == pytest.approx(0.225)
    assert "a − a negated (negated twin)" in table(out)
    other = _run(dict(zip([("p1", 0), ("p1", 1), ("p3", 0), ("p3", 1)], [0.0] * 4)))
    with pytest.raises(ValueError, match="other prompts or seeds"):
        compare_all({"a": a, "c": other}, z=3.0)


def test_a_run_argument_names_its_export_else_its_newest_checkpoint(tmp_path):
    run = tmp_path / "nft"
    for step in (4, 12, 8):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "COMPLETE").write_text("")
    (run / "checkpoints" / "step_000016").mkdir()  # incomplete: never chosen
    src = resolve(str(run))
    assert (src.kind, src.path.name, src.label) == ("checkpoint", "step_000012", "nft")
    (run / "export" / "pipeline").mkdir(parents=True)
    (run / "export" / "pipeline" / "model_index.json").write_text("{}")
    src = resolve(str(run))
    assert (src.kind, src.path, src.run_dir) == ("pipeline", run / "export" / "pipeline", run)
    assert resolve(str(run / "export" / "pipeline")).run_dir == run
    with pytest.raises(ValueError, match="no export"):
        resolve(str(tmp_path))


def test_curves_per_step_and_per_second_come_from_the_run_logs(tmp_path):
    rows = [
        {"step": 1, "time": 110.0, "reward/mean": 0.4, "train/loss": 1.0},
        {"step": 2, "time": 120.0, "train/loss": 0.9},  # the rollout's second step: no reward row
        {"step": 3, "time": 130.0, "reward/mean": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": 0, "time": 100.0, "eval/reward/mean": 0.3, "eval/reward/std": 0.1}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    c = curves(tmp_path)
    assert c["train"] == [{"step": 1, "s": 10.0, "reward": 0.4}, {"step": 3, "s": 30.0, "reward": 0.5}]
    assert c["eval"] == [{"step": 0, "s": 0.0, "reward": 0.3}]


@pytest.mark.skipif(not LOGGED.is_file(), reason="the committed baseline evaluation is missing")
def test_world_prior_reproduces_the_logged_baseline_and_beats_a_degraded_copy(tmp_path):
    """The prior, sampled by the tool on 2 held-out prompts x 2 seeds, scores what the training run's
    baseline evaluation logged for those samples (same noise); a copy whose transformer predicts
    no velocity (its output projection zeroed) loses to it."""
    from safetensors.torch import load_file, save_file

    from miles.compare.__main__ import main
    from miles.data.prompts import load_prompts

    logged = json.loads(LOGGED.read_text())
    # the first prompts of the held-out file: a sample's noise is keyed by its prompt's index in the file
    prompts = [p.text for p in load_prompts(ROOT / "miles/world/prompts_heldout.txt")][:2]
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in prompts))
    subset = [s for s in logged["samples"] if s["prompt"] in prompts and s["seed"] < 2]
    (tmp_path / "logged.json").write_text(json.dumps({"samples": subset}))
    broken = tmp_path / "broken"
    shutil.copytree(ROOT / "miles/world/pipeline", broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state = {k: torch.zeros_like(v) if k.startswith("proj_out") else v for k, v in state.items()}
    save_file(state, weights)
    out = tmp_path / "out"
    args = [str(ROOT / "miles/world/pipeline"), str(tmp_path / "logged.json"), str(broken)]
    args += ["--names", "prior", "logged", "broken", "--config", str(ROOT / "configs/world_cpu.yaml")]
    args += ["--eval.prompt-file", str(tmp_path / "prompts.txt"), "--eval.num-seeds", "2"]
    args += ["--run.no-progress", "--out", str(out), "--z", "1"]
    assert main(args) == 0
    report = json.loads((out / "compare.json").read_text())
    pairs = {(p["a"], p["b"]): p for p in report["rewards"]["world_adherence"]["pairs"]}
    assert report["num_samples"] == 4
    same = pairs[("prior", "logged")]
    assert abs(same["diff"]) < 1e-4 and same["se"] < 1e-4, same  # fp32 rounding: dp2 vs one process
    prior = {
        (s["prompt"], s["seed"]): s["world_adherence"]
        for s in json.loads((out / "prior/eval.json").read_text())["samples"]
    }
    assert max(abs(prior[(s["prompt"], s["seed"])] - s["world_adherence"]) for s in subset) < 1e-4
    assert pairs[("prior", "broken")]["diff"] > 0.05, pairs[("prior", "broken")]
    assert (out / "compare.md").is_file()
