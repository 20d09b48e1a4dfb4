"""The learning test: RL on the tiny world raises held-out adherence; its negated control does not.

Two runs of ``configs/world_cpu.yaml`` (one torchrun launch) at dp2 in deterministic mode, DiffusionNFT
(CFG-free, as the recipe: rollouts and evaluation at guidance 1), the benchmark's global batch (8
prompt groups of 8 per rollout, 2 optimizer steps), 5 rollouts, the same seeds: one trained on the
reward, one with the advantages negated. The held-out evaluation (8
prompts the training never sees x 4 fixed seeds, ODE) runs before the first and after the last
optimizer step.

Why the margins cannot be reached by chance. Evaluation is a deterministic function of the
weights (fixed prompts, seeds and noise; deterministic mode), so the question is whether updates
that ignore the reward could produce the result. Such updates have the same expected effect
whichever sign the advantages carry, so the two runs would end apart only by chance. Every
held-out sample is scored in both runs with the same noise, so their separation (trained minus
negated, per (prompt, seed) pair) has a paired standard error SE = std / sqrt(32). The test asks

- the trained run to end more than ``Z`` = 3 paired standard errors above the negated run
  (one-sided p < 0.0015 under a reward-blind null);
- the trained run to rise by at least ``MIN_RISE`` = 0.03 over the pretrained baseline;
- the negated run to fall.

Measured (2-core machine): trained 0.295 -> 0.347 (+0.052; paired SE of the change 0.018),
negated 0.295 -> 0.241 (-0.053), separation 0.106 with SE 0.025 (4.2 SE); the same 0.347 as the
benchmark's dp4 run at step 10 (the same global batch in another layout). ~3 min.
The benchmark (bench/learning.py) runs the long curves, in two layouts, for every algorithm.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.world_launch import NPROC, WORLD

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
REWARD = "world_adherence"
NUM_ROLLOUTS = 5
Z = 3.0
MIN_RISE = 0.03
FLAGS = [
    *("--algorithm.name", "diffusion_nft", "--rollout.guidance-scale", "1.0"),
    *("--data.prompts-per-rank", "4", "--train.num-rollouts", str(NUM_ROLLOUTS)),
    *("--eval.every", "0", "--train.no-export", "--train.checkpoint-every", "0"),
]


# in the session's shared launch (tests/e2e/conftest.py)
SHARED_RUNS = {NPROC: {"trained": [*WORLD, *FLAGS], "negated": [*WORLD, *FLAGS, "--grpo.negate-advantages"]}}


def _scores(run: Path, step: int) -> list[float]:
    """Per-sample held-out scores of the evaluation after ``step`` optimizer steps, in
    (prompt, seed) order."""
    rows = json.loads((run / "eval" / f"step_{step:06d}.json").read_text())["samples"]
    return [r[REWARD] for r in sorted(rows, key=lambda r: (r["prompt"], r["seed"]))]


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def test_heldout_adherence_rises_and_the_negated_control_does_not(shared_runs):
    trained, negated = shared_runs["trained"].run_dir, shared_runs["negated"].run_dir
    base, base_negated = _scores(trained, 0), _scores(negated, 0)
    final, final_negated = _scores(trained, 2 * NUM_ROLLOUTS), _scores(negated, 2 * NUM_ROLLOUTS)
    rise, rise_se = _mean_se([a - b for a, b in zip(final, base)])
    fall, _ = _mean_se([a - b for a, b in zip(final_negated, base)])
    separation, se = _mean_se([a - b for a, b in zip(final, final_negated)])
    report = (
        f"held-out adherence: baseline {sum(base) / len(base):.3f}; trained {rise:+.3f} (paired SE "
        f"{rise_se:.3f}); negated {fall:+.3f}; trained - negated {separation:.3f} = {separation / se:.1f} SE"
    )
    print(report)
    assert base == base_negated and len(base) == 32, report  # the same weights, prompts and seeds
    assert separation > Z * se, report
    assert rise >= MIN_RISE, report
    assert fall < 0, report
