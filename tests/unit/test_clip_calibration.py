"""``grpo.clip_range: auto`` (``miles.algorithms.clip_calibration``): the clip range set before the
first step with moved weights is the (1 − target) quantile of that step's |ratio − 1|, the step
then clips the target fraction, and a resumed algorithm keeps the value without measuring again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles.algorithms import build_algorithm
from miles.algorithms.clip_calibration import calibrated_clip
from miles.config import ConfigError, parse_args
from tests.unit.test_rollout_precision import _log_prob, _move, _setup


def test_the_calibrated_clip_is_the_quantile_that_leaves_the_target_fraction_outside():
    devs = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.5, 0.0, 0.7, 0.6, 0.9, 0.8])
    clip = calibrated_clip(devs, 0.2)
    assert clip == pytest.approx(0.72)  # numpy's linear quantile at 0.8 of 0.0 .. 0.9
    assert float((devs > clip).double().mean()) == 0.2
    with pytest.raises(ValueError, match="give a fixed grpo.clip_range"):
        calibrated_clip(torch.zeros(8), 0.2)


def test_flow_grpo_calibrates_before_its_first_moved_step_and_a_resume_keeps_the_value(monkeypatch):
    cfg, model, policy, batch = _setup("bf16", 0.0, perturb=0.0)
    grpo = dataclasses.replace(cfg.grpo, clip_range="auto", target_clipfrac=0.25, calibration_rollouts=1)
    cfg = dataclasses.replace(cfg, grpo=grpo)
    algorithm = build_algorithm(cfg)
    first = algorithm.accumulate(policy, batch, [batch.chunks[0]], step_in_rollout=0)
    assert algorithm.clip_range is None and "clip_range" not in first and first["clipfrac"] == 0.0
    model.zero_grad(set_to_none=True)
    _move(model)
    chunk = batch.chunks[1]
    with torch.no_grad():  # by hand: the ratios of the second step's samples and SDE steps
        devs = torch.cat(
            [
                (_log_prob(model, chunk, k) - chunk.rollout.log_probs[:, k]).exp().sub(1).abs()
                for k in range(2)
            ]
        )
    second = algorithm.accumulate(policy, batch, [chunk], step_in_rollout=1)
    want = float(torch.quantile(devs.double(), 0.75))
    assert (
        algorithm.clip_range == pytest.approx(want, rel=1e-6) and second["clip_range"] == algorithm.clip_range
    )
    assert second["clipfrac"] == pytest.approx(0.25)  # 1 of the 4 ratios outside 1 ± clip

    resumed = build_algorithm(cfg)
    resumed.load_state_dict(algorithm.state_dict())
    monkeypatch.setattr(type(resumed), "_calibrate", lambda *a: pytest.fail("measured again after a resume"))
    batch.rollout_index = 1  # a checkpoint ends a rollout: the resumed run starts at the next
    again = resumed.accumulate(policy, batch, [chunk], step_in_rollout=1)
    assert again["clip_range"] == algorithm.clip_range and again["clipfrac"] == second["clipfrac"]


def test_auto_measures_again_on_the_first_calibration_rollouts_only(monkeypatch):
    cfg, model, policy, batch = _setup("bf16", 0.0, perturb=0.0)
    grpo = dataclasses.replace(cfg.grpo, clip_range="auto", calibration_rollouts=2)
    algorithm = build_algorithm(dataclasses.replace(cfg, grpo=grpo))
    measured = []

    def calibrate(self, policy, chunks):
        measured.append(batch.rollout_index)
        self.clip_range = 0.01 * (len(measured))

    monkeypatch.setattr(type(algorithm), "_calibrate", calibrate)
    for index in range(4):
        batch.rollout_index = index
        for m in range(2):
            algorithm.accumulate(policy, batch, [batch.chunks[m]], step_in_rollout=m)
    assert measured == [0, 1] and algorithm.clip_range == 0.02  # the last measurement holds


def test_auto_needs_a_second_step_per_rollout():
    with pytest.raises(ConfigError, match="steps_per_rollout >= 2"):
        parse_args(["--grpo.clip-range", "auto", "--train.steps-per-rollout", "1"])
    cfg, _ = parse_args(["--grpo.clip-range", "auto", "--grpo.target-clipfrac", "0.3"])
    assert cfg.grpo.clip_range == "auto" and cfg.grpo.target_clipfrac == 0.3
