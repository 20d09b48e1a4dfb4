"""What a resume compares with the checkpoint's config, and which checkpoint it picks.

Each key of ``RESUME_MUST_MATCH`` changed alone is named with the checkpoint's value and the flag
that restores it; keys that do not change the checkpoint's meaning (learning rate, layout, number of
rollouts) pass. A checkpoint with a truncated or missing shard, or unreadable metadata, is named by
``checkpoint_problem`` (the fallback to the previous one runs in tests/distributed/test_checkpoint_faults.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles.config import parse_args
from miles.train.resume import RESUME_MUST_MATCH, config_differences

REPO = Path(__file__).resolve().parents[2]


def _cfg(*flags: str):
    return parse_args(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), *flags])[0]


CHANGES = {
    "model.path": ("/models/Wan2.1-T2V-1.3B", "[--model.path /models/Wan2.1-T2V-1.3B]"),
    "model.tiny_variant": ("single_expert", "[--model.tiny-variant single_expert]"),
    "model.lora_rank": (8, "[--model.lora-rank 8]"),
    "model.lora_alpha": (16.0, "[--model.lora-alpha 16.0]"),
    "model.lora_target_modules": (["to_q", "to_v"], "[--model.lora-target-modules to_q to_v]"),
    "data.prompt_file": ("prompts/a.txt", "[--data.prompt-file prompts/a.txt]"),
    "run.seed": (7, "[--run.seed 7]"),
    "algorithm.name": ("diffusion_nft", "[--algorithm.name diffusion_nft]"),
}


@pytest.mark.parametrize("key", list(RESUME_MUST_MATCH))
def test_each_key_that_must_match_is_named_with_its_flag(key):
    cfg = _cfg()
    saved = dataclasses.asdict(cfg)
    value, flag = CHANGES[key]
    section, name = key.split(".")
    saved[section][name] = value
    diffs = config_differences(saved, cfg)
    assert len(diffs) == 1 and diffs[0].startswith(f"{key} (") and diffs[0].endswith(flag), diffs


def test_what_may_change_on_resume_passes():
    saved = dataclasses.asdict(_cfg())
    cfg = _cfg(
        "--train.learning-rate", "3e-5", "--train.num-rollouts", "9", "--sequence-parallel-size", "2",
        "--data.prompts-per-rank", "4", "--run.collective-timeout-s", "60",
    )  # fmt: skip
    assert config_differences(saved, cfg) == []


def test_the_same_model_folder_by_another_path_passes(tmp_path, monkeypatch):
    (tmp_path / "wan").mkdir()
    saved = dataclasses.asdict(_cfg("--model.path", str(tmp_path / "wan")))
    monkeypatch.chdir(tmp_path)
    assert config_differences(saved, _cfg("--model.path", "wan")) == []  # relative to the launch folder
    assert config_differences(saved, _cfg("--model.path", "other"))
