"""Image-to-video GRPO through torchrun on CPU: each tiny I2V variant at dp2 x sp2.

Each prompt of ``miles/data/tiny_i2v`` animates its image (``configs/tiny_i2v_cpu.yaml``). One
rollout and its two optimizer steps: the first step (weights identical to the ones that sampled)
has ratio exactly 1 and a train-vs-rollout canary of exactly 0 (fp32 CPU: the recompute, with the
same condition, repeats the rollout's arithmetic), the gradient is non-zero, and a checkpoint and
an export of the folder's pipeline class are written. TI2V also evaluates held-out image prompts.
(Measured once, not kept for its cost: TI2V at dp4 samples the same rollout as at dp2 x sp2 —
the same min and max reward, mean and std within 1e-6 relative, the fp32 order of the dp gather.
SP parity is held at model level by ``tests/distributed/test_i2v_sp.py``.) The runs share one
torchrun launch with the other modules' (``tests/e2e/conftest.py``).
"""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


VARIANTS = ["i2v", "i2v_two_expert", "ti2v"]


def _flags(variant: str) -> list[str]:
    flags = ["--config", "configs/tiny_i2v_cpu.yaml", "--run.no-progress", "--train.num-rollouts", "1"]
    flags += ["--run.wandb-mode", "disabled"]
    flags += ["--model.tiny-variant", variant, "--sequence-parallel-size", "2", "--ulysses-degree", "2"]
    if variant == "ti2v":
        flags += ["--eval.prompt-file", "miles/data/tiny_i2v/prompts.jsonl", "--eval.num-seeds", "1"]
    return flags


SHARED_RUNS = {4: {v: _flags(v) for v in VARIANTS}}  # tests/e2e/conftest.py


@pytest.fixture(scope="module")
def runs(shared_runs) -> dict[str, Path]:
    return {v: shared_runs[v].run_dir for v in VARIANTS}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_i2v_grpo_trains_at_dp2_sp2(runs, variant):
    run = runs[variant]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    assert first["train/ratio"] == 1.0 and first["train/log_prob_mean_abs_diff"] == 0.0
    assert first["train/grad_norm"] > 0 and first["reward/std"] > 0
    assert (run / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    index = json.loads((run / "export" / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == ("WanPipeline" if variant == "ti2v" else "WanImageToVideoPipeline")
    assert (run / "export" / "pipeline" / "image_encoder").is_dir() == (variant == "i2v")  # kept, not dropped
    if variant == "ti2v":
        assert (run / "eval" / "step_000000.json").is_file() and (run / "eval" / "step_000002.json").is_file()
