"""The tiny world: rendering, the prompt grammar and split, the ``world_adherence`` reward, the
committed pretrained pipeline.

The reward is checked on rendered ground truth (it must score ~1 for every combination), on
prompts wrong in every attribute (~0), on each failure a person would call one (no ball, two
balls, a ball that fades or vanishes) and on blurred, noisy ground truth (still high).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from miles.rewards import build_rewards
from miles.rewards.world import world_scores
from miles.world import (
    COLOURS,
    MOTIONS,
    PIPELINE_DIR,
    SIZES,
    Attributes,
    all_attributes,
    heldout_prompts,
    parse_prompt,
    prompt_for,
    read_prompt_file,
    render,
    train_prompts,
)
from miles.world.world import BACKGROUND, SPEED_RANGE, trajectory

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
SIDEWAYS = {"left": "up", "right": "down", "up": "left", "down": "right"}


def other_colour(colour: str) -> str:
    return COLOURS[(COLOURS.index(colour) + 1) % len(COLOURS)]


def other_size(size: str) -> str:
    return SIZES[1 - SIZES.index(size)]


@pytest.fixture(scope="module")
def ground_truth() -> tuple[torch.Tensor, list[Attributes]]:
    """Every combination twice (two seeds each): videos (64, F, 3, H, W) and their attributes."""
    attrs = [a for a in all_attributes() for _ in range(2)]
    return torch.stack([render(a, 100 + i) for i, a in enumerate(attrs)]), attrs


def adherence(videos: torch.Tensor, attrs: list[Attributes]) -> torch.Tensor:
    return world_scores(videos, [prompt_for(a) for a in attrs])["adherence"]


# --- the world -------------------------------------------------------------------------------


def test_render_is_deterministic_and_in_frame():
    a = parse_prompt("a big red ball moving left")
    v = render(a, 7)
    assert v.shape == (9, 3, 64, 64) and v.dtype == torch.float32
    assert torch.equal(v, render(a, 7))
    assert not torch.equal(v, render(a, 8))
    assert v.min() >= 0 and v.max() <= 1
    border = torch.cat([v[..., 0, :], v[..., -1, :], v[..., :, 0], v[..., :, -1]], dim=-1)
    assert torch.all(border == BACKGROUND)  # the ball never touches the frame's edge


@pytest.mark.parametrize("motion", MOTIONS)
def test_trajectory_moves_the_stated_way(motion):
    for seed in range(20):
        centres, radius = trajectory(Attributes("blue", motion, "small"), seed)
        step = centres[1:] - centres[:-1]
        speed = abs(step).sum(axis=1)
        assert SPEED_RANGE[0] <= speed.min() and speed.max() <= SPEED_RANGE[1]
        dx, dy = step[0]
        assert {"left": dx < 0, "right": dx > 0, "up": dy < 0, "down": dy > 0}[motion]
        assert centres.min() >= radius and centres.max() <= 64 - radius


def test_prompt_files_equal_the_split():
    assert read_prompt_file("train") == train_prompts()
    assert read_prompt_file("heldout") == heldout_prompts()


def test_split_is_disjoint_and_training_covers_every_value_and_pair():
    train, heldout = train_prompts(), heldout_prompts()
    assert len(train) == 24 and len(heldout) == 8 and not set(train) & set(heldout)
    assert set(train) | set(heldout) == {prompt_for(a) for a in all_attributes()}
    seen = [parse_prompt(p) for p in train]
    for field, values in (("colour", COLOURS), ("motion", MOTIONS), ("size", SIZES)):
        assert {getattr(a, field) for a in seen} == set(values)
    # the Latin square holds out triples only: every pair of attribute values is trained on
    assert {(a.colour, a.motion) for a in seen} == {(c, m) for c in COLOURS for m in MOTIONS}
    assert {(a.colour, a.size) for a in seen} == {(c, s) for c in COLOURS for s in SIZES}
    assert {(a.motion, a.size) for a in seen} == {(m, s) for m in MOTIONS for s in SIZES}


def test_parse_and_prompt_round_trip():
    for a in all_attributes():
        assert parse_prompt(prompt_for(a)) == a
    assert prompt_for(Attributes("red", "left", "big")) == "a big red ball moving left"


@pytest.mark.parametrize(
    "bad",
    [
        "a big red cube moving left",
        "a red big ball moving left",
        "a big purple ball moving left",
        "a big red ball moving sideways",
        "a big red ball moving  left",
        "A big red ball moving left",
        "a big red ball",
        "",
    ],
)
def test_parse_rejects_prompts_outside_the_grammar(bad):
    with pytest.raises(ValueError, match="is not of the world's grammar") as info:
        parse_prompt(bad)
    assert repr(bad) in str(info.value)


# --- the reward ------------------------------------------------------------------------------


def test_reward_is_registered_and_scores_ground_truth_near_one(ground_truth):
    videos, attrs = ground_truth
    combined, per_reward = build_rewards({"world_adherence": 1.0})(videos, [prompt_for(a) for a in attrs])
    assert combined.shape == (len(attrs),) and combined.dtype == torch.float32
    assert torch.equal(combined, per_reward["world_adherence"])
    assert combined.min() >= 0.9, {prompt_for(a): float(s) for a, s in zip(attrs, combined) if s < 0.9}


def test_reward_of_prompts_wrong_in_every_attribute_is_near_zero(ground_truth):
    videos, attrs = ground_truth
    for motion_of in (OPPOSITE, SIDEWAYS):
        wrong = [Attributes(other_colour(a.colour), motion_of[a.motion], other_size(a.size)) for a in attrs]
        assert adherence(videos, wrong).max() <= 0.15


def test_each_wrong_attribute_costs_about_a_third(ground_truth):
    videos, attrs = ground_truth
    one_wrong = [
        [Attributes(other_colour(a.colour), a.motion, a.size) for a in attrs],
        [Attributes(a.colour, OPPOSITE[a.motion], a.size) for a in attrs],
        [Attributes(a.colour, a.motion, other_size(a.size)) for a in attrs],
    ]
    for wrong in one_wrong:
        score = adherence(videos, wrong)
        assert score.min() >= 0.55 and score.max() <= 0.75
    two_wrong = [Attributes(other_colour(a.colour), SIDEWAYS[a.motion], a.size) for a in attrs]
    score = adherence(videos, two_wrong)
    assert score.min() >= 0.25 and score.max() <= 0.42


def test_empty_frames_score_zero():
    prompts = train_prompts()[:4]
    grey = torch.full((4, 9, 3, 64, 64), BACKGROUND)
    noisy = (grey + 0.03 * torch.randn(grey.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert world_scores(grey, prompts)["adherence"].max() <= 0.05
    assert world_scores(noisy, prompts)["adherence"].max() <= 0.05


def test_two_balls_are_penalised():
    a = Attributes("green", "right", "small")
    one = render(a, 3)
    other = render(Attributes("green", "left", "small"), 11)
    two = torch.where((other - BACKGROUND).abs() > 0, other, one)
    assert adherence(one[None], [a]) >= 0.9
    assert adherence(two[None], [a]) <= 0.3


def test_a_ball_that_fades_or_vanishes_is_penalised():
    a = Attributes("yellow", "down", "big")
    video = render(a, 5)
    fading = BACKGROUND + (video - BACKGROUND) * torch.linspace(1, 0, 9).view(9, 1, 1, 1)
    vanishing = video.clone()
    vanishing[5:] = BACKGROUND
    scores = adherence(torch.stack([video, fading, vanishing]), [a] * 3)
    assert scores[0] >= 0.9 and scores[1] <= 0.5 and scores[2] <= 0.65


def test_blurred_noisy_ground_truth_still_scores_high(ground_truth):
    videos, attrs = ground_truth
    kernel = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :] / kernel.sum() ** 2)[None, None]
    flat = F.pad(videos.flatten(0, 2)[:, None], (2, 2, 2, 2), mode="replicate")
    blurred = F.conv2d(flat, kernel).view_as(videos)
    noise = 0.03 * torch.randn(videos.shape, generator=torch.Generator().manual_seed(0))
    assert adherence((blurred + noise).clamp(0, 1), attrs).min() >= 0.9


def test_scores_change_continuously():
    """Halfway colours and a slow ball give partial, ordered scores: signal within a group."""
    a = Attributes("red", "right", "big")
    video = render(a, 2)
    towards_yellow = []
    for t in (0.0, 0.3, 0.5, 0.7):
        v = video.clone()
        mask = (video - BACKGROUND).abs().amax(dim=1, keepdim=True) > 0  # (F, 1, H, W)
        tint = torch.tensor([0.0, 0.7, -0.05]).view(1, 3, 1, 1) * t * (video[:, :1] - BACKGROUND) / 0.4
        towards_yellow.append(torch.where(mask, v + tint, v))
    colour = world_scores(torch.stack(towards_yellow), [prompt_for(a)] * 4)["colour"]
    assert colour[0] >= 0.99 and colour[-1] <= 0.2
    assert torch.all(colour[1:] <= colour[:-1] + 1e-6) and 0.05 < colour[1:-1].max() < 0.99


def test_reward_rejects_prompts_outside_the_grammar():
    with pytest.raises(ValueError, match="a red cube"):
        world_scores(torch.full((1, 9, 3, 64, 64), 0.5), ["a red cube"])


# --- the committed pretrained pipeline -------------------------------------------------------


def test_committed_pipeline_loads_offline_with_the_expected_configs():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline.from_pretrained(PIPELINE_DIR, local_files_only=True)
    assert pipe.vae.dtype == torch.float32  # stored in fp16 to keep the folder small, loaded as fp32
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    cfg = pipe.transformer.config
    assert cfg.in_channels == cfg.out_channels == 8 and cfg.num_layers == 4 and cfg.num_attention_heads == 4
    assert cfg.text_dim == pipe.text_encoder.config.d_model
    vae = pipe.vae.config
    assert vae.z_dim == 8 and len(vae.latents_mean) == 8 and len(vae.latents_std) == 8
    assert min(vae.latents_std) > 0
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift == 3.0

    # the VAE's round trip of ground truth keeps what the reward checks: colour and motion fully,
    # size mostly (the VAE blurs some small balls into big-looking ones: adherence ~0.86 on all 32)
    attrs = [Attributes(c, m, s) for s in SIZES for c, m in zip(COLOURS, MOTIONS)]
    videos = torch.stack([render(a, 900 + i) for i, a in enumerate(attrs)])
    with torch.no_grad():
        z = pipe.vae.encode(videos.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
        decoded = (pipe.vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    scores = world_scores(decoded, [prompt_for(a) for a in attrs])
    assert scores["colour"].min() >= 0.9 and scores["motion"].min() >= 0.9
    assert scores["quality"].mean() >= 0.85
    assert scores["adherence"].mean() >= 0.8

    report = json.loads((PIPELINE_DIR.parent / "pretrain_report.json").read_text())
    assert 0.3 <= report["heldout"]["adherence"] <= 0.7, "the prior must leave RL headroom"
    assert report["heldout"]["num_samples"] == 64
