"""The reward preflight (``miles.rewards.preflight``, ``python -m miles.preflight``): its statistics
against rewards built to pass and to fail, the degradations, and the world prior's table (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.rewards.preflight import blur, colour_shift, preflight, shuffle_frames

ROOT = Path(__file__).resolve().parents[2]


class _Toy:
    """Rewards of a video's mean red level: ``red`` (deterministic), ``flat`` (the same for every
    video: no spread), ``noisy`` (red plus fresh noise each call, 10x its spread)."""

    names = ["red", "flat", "noisy"]

    def __init__(self):
        self.g = torch.Generator().manual_seed(1)

    def __call__(self, videos, prompts, images=None):
        red = videos[:, :, 0].mean(dim=(1, 2, 3))
        noisy = red + 0.5 * torch.randn(red.shape, generator=self.g)
        per = {"red": red, "flat": torch.full_like(red, 0.7), "noisy": noisy}
        return red, per


def test_the_verdicts_separate_a_usable_reward_from_a_flat_and_a_noisy_one():
    g = torch.Generator().manual_seed(0)
    videos = torch.rand(24, 5, 3, 16, 16, generator=g) * torch.rand(24, 1, 1, 1, 1, generator=g)
    report = preflight(_Toy(), videos, ["p"] * 24, group_size=6, rescore=3)
    red, flat, noisy = (report["rewards"][n] for n in ("red", "flat", "noisy"))
    groups = videos[:, :, 0].mean(dim=(1, 2, 3)).double().reshape(4, 6)
    assert red["within_group_std"] == pytest.approx(float(groups.std(dim=1).mean()), rel=1e-9)
    assert red["rescore_std"] == 0.0 and red["zero_spread_fraction"] == 0.0
    assert red["verdict"].startswith("signal")
    assert red["degradations"]["colour_shift"]["lowers"] is False  # mean red moves either way
    assert flat["zero_spread_fraction"] == 1.0 and flat["verdict"].startswith("NO signal: 100% of groups")
    assert noisy["rescore_std"] > 0.3 and noisy["snr"] < 3 and "re-scoring noise" in noisy["verdict"]


def test_the_degradations_do_what_they_say():
    g = torch.Generator().manual_seed(0)
    v = torch.rand(2, 9, 3, 12, 12, generator=g)
    assert torch.equal(colour_shift(v)[:, :, 0], v[:, :, 1]) and torch.equal(
        colour_shift(v)[:, :, 2], v[:, :, 0]
    )
    s = shuffle_frames(v)
    assert not torch.equal(s, v) and torch.equal(s.sort(dim=1).values, v.sort(dim=1).values)
    b = blur(v)
    assert b.shape == v.shape and b.std() < v.std()
    assert torch.allclose(b[0, 0, 0, 6, 6], v[0, 0, 0, 4:9, 4:9].mean())  # a 5x5 box inside the frame


def test_world_prior_gives_world_adherence_a_signal_that_a_colour_shift_lowers(tmp_path):
    from miles.preflight import main

    args = ["--config", str(ROOT / "configs/world_cpu.yaml"), "--num-prompts", "2", "--data.group-size", "4"]
    args += ["--rescore", "1", "--run.no-progress", "--out", str(tmp_path)]
    assert main(args) == 0  # 0: every trained reward has a signal
    report = json.loads((tmp_path / "preflight.json").read_text())
    world = report["rewards"]["world_adherence"]
    assert report["num_groups"] == 2 and report["group_size"] == 4
    assert world["rescore_std"] == 0.0  # a rule: the same video scores the same
    assert world["within_group_std"] > 0.01 and world["zero_spread_fraction"] < 0.5
    assert world["degradations"]["colour_shift"]["change"] < -0.05  # the colour check fails on every ball
    assert "world_adherence" in (tmp_path / "preflight.md").read_text()


def test_train_grpo_preflight_stops_before_training_when_a_trained_reward_has_no_signal(monkeypatch, capsys):
    import miles.preflight
    import train_grpo

    bad = {"rewards": {"reward": {"verdict": "NO signal: 100% of groups have zero spread"}}}
    bad["rewards"]["world_adherence"] = bad["rewards"]["reward"]
    monkeypatch.setattr(miles.preflight, "run_preflight", lambda cfg, say: bad)
    monkeypatch.setattr(
        "miles.train.trainer.Trainer", lambda cfg: pytest.fail("trained after a failed preflight")
    )
    assert train_grpo.main(["--config", str(ROOT / "configs/world_cpu.yaml"), "--preflight"]) == 2
    assert "no signal" in capsys.readouterr().err
