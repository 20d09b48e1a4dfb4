"""SFT end to end through torchrun: the world recipe with ``algorithm.name sft`` (as
``configs/world_sft_cpu.yaml``) at dp2 on renders of the world's training prompts (``miles.world.sft_data``), 2 optimizer steps with held-out evaluation and a
checkpoint, then a resume from it for 2 more.

The resume continues rather than restarts: no second baseline evaluation, the first launch's rows
kept as they were, the prompt sampler's epoch continued (new videos encoded, the first batch's read
back from the latent cache).
"""

from __future__ import annotations

import json

import pytest

from miles.world.sft_data import write_world_sft
from tests.world_launch import launch_world

pytestmark = pytest.mark.e2e


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_trains_and_resumes(tmp_path):
    jsonl = write_world_sft(tmp_path / "data", videos_per_prompt=1)
    flags = ["--algorithm.name", "sft", "--data.prompt-file", str(jsonl), "--data.group-size", "2"]
    flags += [
        "--data.prompts-per-rank",
        "4",
        "--eval.num-seeds",
        "1",
        "--eval.num-steps",
        "4",
        "--train.no-export",
    ]
    run = launch_world(tmp_path, "sft", *flags, "--train.num-rollouts", "1", timeout_s=600)
    first = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2]
    assert all(0.0 < r["train/sigma_mean"] < 1.0 and r["train/loss"] > 0 for r in first)
    assert (run / "checkpoints" / "step_000002").is_dir()
    cached = set((run / "sft_latents").iterdir())
    assert len(cached) == 8  # dp2 x 4 videos, each encoded once

    launch_world(tmp_path, "sft", *flags, "--train.num-rollouts", "2", timeout_s=600)
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == first
    assert [e["step"] for e in _rows(run / "eval.jsonl")] == [0, 2, 4]
    assert cached < set((run / "sft_latents").iterdir())  # the next 8 videos of the epoch
