"""SFT end to end through torchrun: the world recipe with ``algorithm.name sft`` (as
``configs/world_sft_cpu.yaml``) at dp2 on renders of the world's training prompts (``miles.world.sft_data``), 2 optimizer steps with held-out evaluation and a
checkpoint, then a resume from it for 2 more.

The resume continues rather than restarts: no second baseline evaluation, the first launch's rows
kept as they were, the prompt sampler's epoch continued (new videos encoded, the first batch's read
back from the latent cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.world.sft_data import write_world_sft
from tests.e2e.multi_run import launch_runs
from tests.world_launch import NPROC, WORLD

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[2] / ".cache" / "world_sft_e2e"  # rewritten only if incomplete


def _flags(rollouts: int) -> list[str]:
    jsonl = write_world_sft(DATA, videos_per_prompt=1)
    flags = [*WORLD, "--algorithm.name", "sft", "--data.prompt-file", str(jsonl)]
    flags += ["--data.group-size", "2", "--data.prompts-per-rank", "4", "--eval.num-seeds", "1"]
    return [*flags, "--eval.num-steps", "4", "--train.no-export", "--train.num-rollouts", str(rollouts)]


def SHARED_RUNS() -> dict[int, dict[str, list[str]]]:  # noqa: N802 (tests/e2e/conftest.py)
    """The first launch goes into the session's shared 2-process launch; the resume is launched by
    the test."""
    return {NPROC: {"sft_world": _flags(1)}}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_trains_and_resumes(shared_runs, shared_root):
    run = shared_runs["sft_world"].run_dir
    # SFT has no reward: its rollout lines state the loss, never "reward mean=0.0000 std=0.0000"
    lines = [x for x in shared_runs["sft_world"].stdout.splitlines() if x.startswith("[rollout ")]
    assert lines and all(" loss=" in x and "reward" not in x for x in lines), lines
    first = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2]
    assert all(0.0 < r["train/sigma_mean"] < 1.0 and r["train/loss"] > 0 for r in first)
    assert (run / "checkpoints" / "step_000002").is_dir()
    cached = set((run / "sft_latents").iterdir())
    assert len(cached) == 8  # dp2 x 4 videos, each encoded once

    launch_runs(shared_root, {"sft_world": _flags(2)}, nproc=NPROC, env={"WANDB_MODE": "disabled"})
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == first
    assert [e["step"] for e in _rows(run / "eval.jsonl")] == [0, 2, 4]
    assert cached < set((run / "sft_latents").iterdir())  # the next 8 videos of the epoch
