"""GRPO on the tiny world through torchrun with held-out evaluation; standalone eval = the trainer's.

One launch of ``configs/world_cpu.yaml`` (the pretrained world pipeline, the ``world_adherence``
reward) at dp2 in deterministic mode: the held-out evaluation (8 prompts x 4 fixed seeds, ODE) runs
at the start and at the end; ``python -m miles.eval`` on the run's export and on its last checkpoint
must reproduce the trainer's final evaluation sample for sample. (to fp32 rounding). The learning claim itself (a
rising held-out curve and a falling negative control) is held by tests/e2e/test_learning.py and
the learning benchmark (docs/learning.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.world_launch import NPROC, WORLD

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
REWARD = "eval/world_adherence/mean"
NUM_ROLLOUTS = 2
FLAGS = [
    "--data.prompts-per-rank",
    "2",
    "--train.num-rollouts",
    str(NUM_ROLLOUTS),
    "--eval.every",
    "0",
    # reward shaping through torchrun: a gold reward scored in evaluation only, and the trained
    # reward group-normalised before weighting
    "--reward.gold",
    "sharpness",
    "--reward.normalize",
    "world_adherence",
    "group",
]


SHARED_RUNS = {NPROC: {"grpo": [*WORLD, *FLAGS]}}  # in the session's shared launch (tests/e2e/conftest.py)


def _evals(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(shared_runs) -> dict[str, Path]:
    return {"grpo": shared_runs["grpo"].run_dir}


def test_heldout_evaluation_at_start_and_end(runs):
    evals = _evals(runs["grpo"])
    assert [e["step"] for e in evals] == [0, 2 * NUM_ROLLOUTS]  # baseline and end
    for e in evals:
        assert 0.0 < e[REWARD] < 1.0 and e["eval/world_adherence/std"] > 0  # objects, not noise
        assert e["eval/reward/mean"] == e[REWARD]  # the gold reward is not in the trained sum
        assert e["eval/sharpness/mean"] > 0 and e["eval/sharpness/mean"] != e[REWARD]
    rows = [json.loads(line) for line in (runs["grpo"] / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in rows if "reward/mean" in r]
    assert first and all("reward/sharpness/mean" not in r for r in rows)  # never scored in training
    assert all(abs(r["reward/shaped/mean"]) < 1e-6 for r in first)  # group-normalised: mean 0
    grid = runs["grpo"] / "eval" / "step_000000_grid.json"
    assert len(json.loads(grid.read_text())) == 16  # dp2: rank 0 samples every other micro-batch of 32


# Both standalone evaluations in one process (``miles.eval``'s main, as its command line calls it),
# so the test pays one start-up of Python, torch and diffusers instead of two.
_EVAL_BOTH = (
    "import json, sys\n"
    "from miles.eval.__main__ import main\n"
    "for argv in json.loads(sys.argv[1]):\n"
    "    if code := main(argv):\n"
    "        sys.exit(code)\n"
)


@pytest.fixture(scope="module")
def standalone(runs, tmp_path_factory) -> dict[str, Path]:
    """``python -m miles.eval`` on the run's export and on its last checkpoint: each one's output folder."""
    run = runs["grpo"]
    sources = {
        "export": ["--model.path", str(run / "export" / "pipeline")],
        "checkpoint": ["--checkpoint", str(sorted((run / "checkpoints").iterdir())[-1])],
    }
    outs = {source: tmp_path_factory.mktemp(f"eval_{source}") for source in sources}
    config, quiet = ["--config", "configs/world_cpu.yaml"], ["--run.wandb-mode", "disabled"]
    argvs = [[*config, *where, "--out", str(outs[source]), *quiet] for source, where in sources.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _EVAL_BOTH, json.dumps(argvs)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return outs


@pytest.mark.parametrize("source", ["export", "checkpoint"])
def test_standalone_eval_equals_the_trainers_final_eval(runs, standalone, source):
    run, tmp_path = runs["grpo"], standalone[source]
    got = json.loads((tmp_path / "eval.json").read_text())["samples"]
    want = json.loads((run / "eval" / f"step_{2 * NUM_ROLLOUTS:06d}.json").read_text())["samples"]
    # Same prompts, seeds and weights; the scores agree to fp32 rounding (one process vs the
    # trainer's dp2 FSDP model: kernels may sum in another order; measured ~1 ulp).
    assert [(g["prompt"], g["seed"]) for g in got] == [(w["prompt"], w["seed"]) for w in want]
    for g, w in zip(got, want):
        assert g["world_adherence"] == pytest.approx(w["world_adherence"], abs=1e-5), (g, w)
    assert (tmp_path / "eval.mp4").is_file()
