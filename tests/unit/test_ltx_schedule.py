"""LTX-Video's noise schedule is the folder's, as diffusers' ``LTXPipeline`` sets it, bitwise.

- The family's :class:`~miles.rollout.schedule.FlowSchedule` (``ltx_flow_schedule`` of the folder's
  scheduler config) against ``retrieve_timesteps(scheduler, sigmas=linspace(1, 1/T, T),
  mu=calculate_shift(tokens, ...))`` — the lines of ``LTXPipeline.__call__`` — for token counts
  across and beyond the dynamic shift's range and several step counts: sigmas and timesteps
  ``torch.equal``, the last σ before 0 at ``shift_terminal``; a static-shift config too.
- ``LTXPipeline`` itself on the tiny folder runs the timesteps the run's schedule gives
  (``rollout_schedule``: the token count from the family's latent shape).
- The sampler's SDE steps record σ, σ_next and t = 1000·σ of that schedule, the training
  recompute of a step's log-prob equals the rollout's, and DiffusionNFT's noise levels and
  evaluation's schedule are the same one.
- A ``rollout.shift`` set by hand is refused (the plan and the dry run), naming the fix; the dry
  run prints the schedule.
Wan's schedule is untouched: ``FlowSchedule(shift)`` is ``flow_sigmas(T, shift)`` (and
tests/unit/test_sampler.py holds the formula).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models import load_tiny_ltx

TOKENS = (24, 256, 1024, 2500, 4096, 7392, 32760)  # below, inside and above base/max image_seq_len
STEPS = (2, 3, 8, 20, 50)


def _pipeline_schedule(config, tokens: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) as ``LTXPipeline.__call__`` sets them on its scheduler (its step 5);
    ``config``: the scheduler's config, or the scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

    scheduler = (
        config if hasattr(config, "set_timesteps") else FlowMatchEulerDiscreteScheduler.from_config(config)
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(
        tokens,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", None, sigmas=sigmas, mu=mu)
    return scheduler.sigmas, timesteps


def test_the_schedule_is_ltx_pipelines_bitwise():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from miles.models.ltx import ltx_flow_schedule
    from miles.models.tiny_ltx import LTX_SCHEDULER
    from miles.rollout.sampler import NUM_TRAIN_TIMESTEPS

    published = dict(LTX_SCHEDULER)  # config_folders_ltx writes this one for the 2B and 13B folders
    static = {"shift": 3.0, "shift_terminal": None}
    for config in (published, static):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)  # set_timesteps sets it afresh
        for tokens in TOKENS:
            schedule = ltx_flow_schedule(config, tokens)
            for steps in STEPS:
                want_sigmas, want_t = _pipeline_schedule(scheduler, tokens, steps)
                ours = schedule.sigmas(steps)
                assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
                assert torch.equal(ours, want_sigmas), (config, tokens, steps, ours, want_sigmas)
                assert torch.equal(ours[:-1] * NUM_TRAIN_TIMESTEPS, want_t), (tokens, steps)
                if config is published:
                    assert ours[0] == 1.0 and ours[-1] == 0.0
                    assert ours[-2].item() == pytest.approx(0.1, abs=1e-6)  # shift_terminal
    # the dynamic shift does depend on the token count, and the stretch moves the grid
    a, b = ltx_flow_schedule(published, 1024), ltx_flow_schedule(published, 4096)
    assert a.shift == pytest.approx(np.exp(0.95)) and b.shift == pytest.approx(np.exp(2.05))
    assert not torch.equal(a.sigmas(8), b.sigmas(8))


def test_a_one_step_terminal_schedule_is_refused():
    from miles.models.ltx import ltx_flow_schedule
    from miles.models.tiny_ltx import LTX_SCHEDULER

    with pytest.raises(ValueError, match="raise rollout.num_steps"):
        ltx_flow_schedule(dict(LTX_SCHEDULER), 24).sigmas(1)


def test_unsupported_scheduler_options_are_refused():
    from miles.models.ltx import ltx_flow_schedule
    from miles.models.tiny_ltx import LTX_SCHEDULER

    with pytest.raises(ValueError, match="use_karras_sigmas"):
        ltx_flow_schedule({**LTX_SCHEDULER, "use_karras_sigmas": True}, 24)


@pytest.fixture(scope="module")
def ltx():
    return load_tiny_ltx()


def _rollout_cfg(**kw):
    from miles.sections import RolloutConfig

    return RolloutConfig(**{"num_frames": 9, "height": 96, "width": 128, "num_steps": 4, **kw})


def test_ltx_pipeline_runs_the_runs_timesteps(ltx):
    """The tiny ``LTXPipeline`` (its own token count and scheduler) steps through exactly the
    timesteps the run's schedule gives at the recipe's size."""
    from diffusers import LTXPipeline

    from miles.models.family import rollout_schedule

    pipe = LTXPipeline.from_pretrained(ltx.path, local_files_only=True)
    seen = []

    def record(p, i, t, kwargs):
        seen.append(t.clone())
        return {}

    r = _rollout_cfg(num_steps=5)
    pipe(
        prompt="a red ball",
        num_frames=r.num_frames,
        height=r.height,
        width=r.width,
        num_inference_steps=r.num_steps,
        max_sequence_length=16,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=record,
    )
    schedule = rollout_schedule(ltx, r)
    assert torch.equal(torch.stack(seen), schedule.sigmas(r.num_steps)[:-1] * 1000)
    assert torch.equal(pipe.scheduler.sigmas, schedule.sigmas(r.num_steps))
    assert "24 tokens" in schedule.source and schedule.shift_terminal == 0.1


def test_sde_steps_and_the_algorithms_use_the_schedule(ltx):
    from miles.algorithms import build_algorithm
    from miles.config import Config
    from miles.eval.evaluate import eval_settings
    from miles.models.family import rollout_schedule
    from miles.rollout.sampler import compute_log_prob, sample_with_logprob

    r = _rollout_cfg(num_steps=6)
    schedule = rollout_schedule(ltx, r)
    want, _ = _pipeline_schedule(ltx.scheduler_config, ltx.num_tokens(9, 96, 128), 6)
    pos, neg = ltx.encode_prompts(["a red ball", "a blue cube"], "", 16, "cpu")
    ro = sample_with_logprob(
        ltx.transformers,
        pos,
        neg,
        ltx.latent_shape(r.num_frames, r.height, r.width),
        num_steps=r.num_steps,
        shift=schedule,
        guidance_scales=3.0,
        routing=ltx.routing,
        noise_level=0.7,
        generator=torch.Generator().manual_seed(0),
        sde_steps=[0, 2, 4],
    )
    assert torch.equal(ro.schedule, want)
    assert torch.equal(ro.sigmas, want[[0, 2, 4]]) and torch.equal(ro.sigma_next, want[[1, 3, 5]])
    assert torch.equal(ro.timesteps, want[[0, 2, 4]] * 1000)
    for k in range(3):
        log_prob, _, _ = compute_log_prob(ltx.transformers, ro, k, pos, neg, 3.0, ltx.routing, 0.7)
        assert torch.equal(log_prob, ro.log_probs[:, k])

    cfg = Config(rollout=r)
    cfg.algorithm.name = "diffusion_nft"
    assert torch.equal(build_algorithm(cfg, schedule).sigmas, want[:6])
    assert eval_settings(cfg, ltx).shift == schedule


def test_a_hand_set_shift_is_refused_and_the_dry_run_prints_the_schedule(tmp_path, monkeypatch):
    from miles.config import parse_args
    from miles.train.dry_run import dry_run, format_report
    from miles.train.plan import PlanError

    monkeypatch.chdir(Path(__file__).resolve().parents[2])

    def cfg(*flags):
        return parse_args(
            ["--config", "configs/tiny_ltx_cpu.yaml", "--run.output-dir", str(tmp_path), *flags]
        )[0]

    with pytest.raises(
        PlanError, match="rollout.shift 1.81: an LTX-Video folder sets its own noise schedule"
    ):
        dry_run(cfg("--rollout.shift", "1.81"), world_size=2, device_type="cpu", verbose=False)
    report = dry_run(cfg(), world_size=2, device_type="cpu", verbose=False)
    text = format_report(report)
    assert "schedule  mu " in text and "shift_terminal 0.1" in text and "at 24 tokens" in text, text
    assert report["sequence"]["sigmas"][-2] == pytest.approx(0.1, abs=1e-6)
