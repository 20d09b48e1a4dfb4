"""Image-to-video GRPO through torchrun on CPU: each tiny I2V variant at dp2 x sp2.

Each prompt of ``miles/data/tiny_i2v`` animates its image (``configs/tiny_i2v_cpu.yaml``). One
rollout and its two optimizer steps: the first step (weights identical to the ones that sampled)
has ratio exactly 1 and a train-vs-rollout canary of exactly 0 (fp32 CPU: the recompute, with the
same condition, repeats the rollout's arithmetic), the gradient is non-zero, and a checkpoint and
an export of the folder's pipeline class are written. TI2V also evaluates held-out image prompts.
(Measured once, not kept for its cost: TI2V at dp4 samples the same rollout as at dp2 x sp2 —
the same min and max reward, mean and std within 1e-6 relative, the fp32 order of the dp gather.
SP parity is held at model level by ``tests/distributed/test_i2v_sp.py``.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _launch(tmp_path: Path, name: str, *flags: str) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "4",
        "train_grpo.py",
        "--config",
        "configs/tiny_i2v_cpu.yaml",
    ]
    cmd += [
        "--run.output-dir",
        str(tmp_path),
        "--run.name",
        name,
        "--run.no-progress",
        "--train.num-rollouts",
        "1",
    ]
    proc = subprocess.run([*cmd, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("variant", ["i2v", "i2v_two_expert", "ti2v"])
def test_i2v_grpo_trains_at_dp2_sp2(tmp_path, variant):
    flags = ["--model.tiny-variant", variant, "--sequence-parallel-size", "2", "--ulysses-degree", "2"]
    if variant == "ti2v":
        flags += ["--eval.prompt-file", "miles/data/tiny_i2v/prompts.jsonl", "--eval.num-seeds", "1"]
    run = _launch(tmp_path, "dp2sp2", *flags)
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
