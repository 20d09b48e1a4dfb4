"""The world at Wan2.1's shape (81 x 480 x 832): its geometry, the reward at a reduced shape through
the same code, the prior's size and cost, its committed configs, and every pretraining stage on CPU
at a reduced size (``miles.pretrain_world_81``)."""

from __future__ import annotations

import json

import pytest
import torch

from miles.rewards.world import world_scores
from miles.world.world import (
    MOTIONS,
    SHAPE_9,
    SHAPE_81,
    SIZES,
    Attributes,
    Shape,
    all_attributes,
    prompt_for,
    render,
    trajectory,
)

REDUCED = Shape(21, 96, 160)
"""A quarter-size cousin of SHAPE_81 (scale 1.5, 21 frames): cheap on CPU, scaled as 81 frames are."""


def test_shape_81_is_wan21s_latent_grid_and_keeps_the_ball_inside():
    f, h, w = SHAPE_81.num_frames, SHAPE_81.height, SHAPE_81.width
    latent = ((f - 1) // 4 + 1, h // 8, w // 8)  # Wan's 4x temporal / 8x spatial VAE
    assert latent == (21, 60, 104) and latent[0] * (latent[1] // 2) * (latent[2] // 2) == 32760
    assert SHAPE_81.scale == 7.5 and SHAPE_9.scale == SHAPE_9.speed_scale == 1.0
    for attrs in all_attributes():
        for seed in range(3):
            centres, radius = trajectory(attrs, seed, SHAPE_81)
            small, _ = trajectory(attrs, seed, SHAPE_9)[0], None
            assert centres.shape == (81, 2)
            margin = 2.0 * SHAPE_81.scale
            assert (centres[:, 0] - radius >= margin - 1e-9).all() and (
                centres[:, 0] + radius <= w - margin + 1e-9
            ).all()
            assert (centres[:, 1] - radius >= margin - 1e-9).all() and (
                centres[:, 1] + radius <= h - margin + 1e-9
            ).all()
            # the ball crosses the same distance, in units of the short side, as in the 9-frame world
            travel = abs(centres[-1] - centres[0]).max() / SHAPE_81.scale
            assert travel == pytest.approx(abs(small[-1] - small[0]).max(), rel=1e-9)
            assert radius / SHAPE_81.scale == pytest.approx(trajectory(attrs, seed, SHAPE_9)[1], rel=1e-9)


def test_the_reward_reads_the_shape_and_scores_renders_at_a_reduced_shape():
    """Renders at REDUCED score as 9-frame renders do; a wrong direction costs the motion third and
    a wrong size the size third (the thresholds scale with the frame: unscaled, a small ball of
    radius 7.5 px would read big, and 1.5-2.1 px/frame would fall short of the motion ramp)."""
    picks = [
        Attributes("red", "left", "big"),
        Attributes("blue", "down", "small"),
        Attributes("yellow", "up", "small"),
    ]
    videos = torch.stack([render(a, 3, REDUCED) for a in picks])
    assert videos.shape == (3, 21, 3, 96, 160)
    truth = world_scores(videos, [prompt_for(a) for a in picks])
    small9 = world_scores(torch.stack([render(a, 3) for a in picks]), [prompt_for(a) for a in picks])
    assert truth["adherence"].min() >= 0.9
    for check in truth:  # every check as in the 9-frame world (measured: within 0.004)
        assert (truth[check] - small9[check]).abs().max() < 0.01, check
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    wrong_motion = [prompt_for(Attributes(a.colour, opposite[a.motion], a.size)) for a in picks]
    wrong_size = [prompt_for(Attributes(a.colour, a.motion, SIZES[1 - SIZES.index(a.size)])) for a in picks]
    assert world_scores(videos, wrong_motion)["motion"].max() < 0.05
    assert world_scores(videos, wrong_size)["size"].max() < 0.1  # = 1 - the right size's score
    assert set(MOTIONS) == set(opposite)


@pytest.mark.parametrize("blocks", [1, 2])
def test_prior_size_and_cost_estimate(blocks):
    """The FLOPs formula against torch's own count of a forward on meta tensors (the estimate the
    device plan rests on), at the committed 2 blocks and the 1-block option."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    from miles.pretrain_world_81 import PRIOR, Pretrain81Config, estimate

    prior = dict(PRIOR, num_layers=blocks)
    est = estimate(Pretrain81Config(prior=prior))
    assert PRIOR["attention_head_dim"] == 128 and est["tokens_per_sample"] == 32760
    assert est["prior_weights_mb"] <= 60  # committed weights
    assert est["attention_share"] > 0.9  # at 32,760 tokens attention dominates
    with torch.device("meta"):
        model = WanTransformer3DModel(**prior)
        x, text = torch.empty(1, 16, 21, 60, 104), torch.empty(1, 64, 32)
        with FlopCounterMode(display=False) as counter:
            model(hidden_states=x, timestep=torch.empty(1), encoder_hidden_states=text, return_dict=False)
    assert est["forward_flops_per_sample"] == pytest.approx(counter.get_total_flops(), rel=0.005)
    assert est["prior_train_s"] <= 15 * 60


def test_committed_configs_are_the_prior_and_a_16_channel_world_vae(tmp_path):
    from miles.pretrain_world_81 import PRIOR, VAE_16, write_configs
    from miles.world import PIPELINE_81_DIR

    write_configs(tmp_path / "p")
    for sub in (
        "model_index.json",
        "transformer/config.json",
        "vae/config.json",
        "scheduler/scheduler_config.json",
    ):
        assert json.loads((PIPELINE_81_DIR / sub).read_text()) == json.loads(
            (tmp_path / "p" / sub).read_text()
        ), sub
    t = json.loads((PIPELINE_81_DIR / "transformer/config.json").read_text())
    v = json.loads((PIPELINE_81_DIR / "vae/config.json").read_text())
    assert (
        all(t[k] == val for k, val in PRIOR.items() if k != "patch_size")
        and t["in_channels"] == v["z_dim"] == 16
    )
    assert VAE_16["temperal_downsample"] == [False, True, True] and len(VAE_16["dim_mult"]) == 4  # 4x, 8x
    assert v["scale_factor_temporal"] == 4 and v["scale_factor_spatial"] == 8


def test_pretraining_runs_every_stage_on_cpu_at_a_reduced_size(tmp_path):
    """VAE crops, encoding, the prior's loop, the save, the reload and the evaluation, at 5 x 32 x 48
    with a one-block prior: the same functions ``make world-model-81`` runs on a GPU."""
    from miles.pretrain_world_81 import PRIOR, Pretrain81Config, pretrain

    cfg = Pretrain81Config(
        shape=(5, 32, 48), device="cpu", compile=False, prior=dict(PRIOR, num_layers=1, num_attention_heads=1),
        vae_short_steps=2, vae_long_steps=1, vae_batch=2, videos_per_prompt=1, dit_steps=2, dit_batch=4,
        eval_seeds_heldout=1, eval_seeds_train=0, eval_steps=2, eval_micro_batch=8,
    )  # fmt: skip
    report = pretrain(tmp_path / "pipeline", cfg)
    assert report["latent_shape"] == [16, 2, 4, 6]  # 16 channels, 4x temporal, 8x spatial
    assert report["heldout"]["num_samples"] == 8 and "train" not in report
    assert 0.0 <= report["heldout"]["adherence"] <= 1.0
    assert (tmp_path / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    vae = json.loads((tmp_path / "pipeline" / "vae" / "config.json").read_text())
    assert vae["z_dim"] == 16 and vae["latents_std"] != [1.0] * 16  # the measured statistics written
