"""Reward shaping: per-reward normalisation before weighting (against a float64 loop written out
here), gold rewards kept out of the trained sum, and the shaping config checks (each reward's own
options: tests/unit/test_reward_options.py)."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import Config, ConfigError, RewardConfig, parse_args
from miles.rewards import build_rewards
from miles.rewards.from_config import build_configured_rewards, check_reward_config
from miles.rewards.pickscore import PickScoreOptions
from miles.rewards.shaping import EvalRewards, normalize_scores, shaped_reward


def ref_normalize(values: list[float], groups: list[int], mode: str) -> list[float]:
    """The normalisation written out with Python floats (float64), one sample at a time."""
    if mode == "none":
        return list(values)
    out = []
    for i, v in enumerate(values):
        peers = [values[j] for j in range(len(values)) if mode == "batch" or groups[j] == groups[i]]
        mean = sum(peers) / len(peers)
        std = math.sqrt(sum((p - mean) ** 2 for p in peers) / len(peers))
        out.append((v - mean) / (std + 1e-4))
    return out


@pytest.mark.parametrize("mode", ["none", "group", "batch"])
def test_normalize_matches_float64_reference(mode):
    torch.manual_seed(0)
    values = torch.randn(12) * 7 + 3
    groups = torch.tensor([3, 3, 3, 0, 0, 0, 5, 5, 5, 1, 1, 1])[torch.randperm(12)]
    got = normalize_scores(values, groups, mode)
    expected = ref_normalize(values.double().tolist(), groups.tolist(), mode)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    if mode == "group":  # each group now has mean 0 and std ~1
        for g in groups.unique():
            assert abs(float(got[groups == g].mean())) < 1e-12


def test_shaped_reward_weights_the_normalised_scores():
    torch.manual_seed(1)
    groups = torch.arange(4).repeat_interleave(4)
    per_reward = {"big": torch.rand(16) * 1000, "small": torch.rand(16) * 0.01, "raw": torch.rand(16)}
    weights = {"big": 0.5, "small": 2.0, "raw": -1.0}
    normalize = {"big": "group", "small": "batch"}  # raw: none (unnamed)
    got = shaped_reward(per_reward, weights, normalize, groups)
    ref = [
        0.5 * b + 2.0 * s - 1.0 * r
        for b, s, r in zip(
            ref_normalize(per_reward["big"].double().tolist(), groups.tolist(), "group"),
            ref_normalize(per_reward["small"].double().tolist(), groups.tolist(), "batch"),
            per_reward["raw"].double().tolist(),
        )
    ]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float32))
    # without normalisation the 1000x reward would dominate: with it, both matter alike
    assert float(torch.corrcoef(torch.stack([got, per_reward["small"]]))[0, 1]) > 0.3


def test_eval_rewards_keep_gold_out_of_the_sum():
    videos = torch.rand(3, 5, 3, 16, 16)
    prompts = ["a", "b", "c"]
    trained = build_rewards({"jpeg_incompressibility": 2.0}, num_frames=2)
    gold = build_rewards({"sharpness": 0.0}, num_frames=2)
    mix = EvalRewards(trained, gold)
    assert mix.names == ["jpeg_incompressibility", "sharpness"]
    combined, per_reward = mix(videos, prompts)
    ref_combined, ref_per = trained(videos, prompts)
    assert torch.equal(combined, ref_combined)  # gold is not in the trained sum
    assert torch.equal(per_reward["sharpness"], gold.rewards["sharpness"](videos, prompts))
    assert torch.equal(per_reward["jpeg_incompressibility"], ref_per["jpeg_incompressibility"])


def test_config_checks_normalize_and_gold():
    with pytest.raises(ConfigError, match="reward.normalize names 'sharpness'"):
        Config(reward=RewardConfig(weights={"jpeg_incompressibility": 1.0}, normalize={"sharpness": "group"}))
    with pytest.raises(ConfigError, match="normalize.jpeg_incompressibility must be one of"):
        Config(reward=RewardConfig(normalize={"jpeg_incompressibility": "zscore"}))
    with pytest.raises(ConfigError, match="never trained on"):
        Config(reward=RewardConfig(gold=["jpeg_incompressibility"]))
    with pytest.raises(ConfigError, match="reward.gold names an unknown reward 'nope'"):
        parse_args(["--reward.gold", "nope"])
    argv = ["--reward.weights.pickscore", "1", "--reward.gold", "sharpness"]
    argv += ["--reward.normalize", "jpeg_incompressibility", "group", "pickscore", "batch"]
    cfg, _ = parse_args(argv)
    assert cfg.reward.normalize == {"jpeg_incompressibility": "group", "pickscore": "batch"}
    assert cfg.reward.gold == ["sharpness"]


def test_help_lists_the_shaping_fields(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--reward.normalize" in out and "--reward.gold" in out


def test_missing_gold_weights_are_refused_before_loading(tmp_path):
    cfg = RewardConfig(gold=["pickscore"], pickscore=PickScoreOptions(model_path=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"reward\.pickscore\.model_path=.*nowhere.* is not a folder"):
        check_reward_config(cfg)
    trained, gold = build_configured_rewards(RewardConfig(gold=["sharpness"]))
    assert trained.names == ["jpeg_incompressibility"] and gold.names == ["sharpness"]
