"""SFT (``miles.algorithms.sft``): the flow-matching loss, its noise-level density and one optimizer
step's gradient, each against the formula written out in float64."""

from __future__ import annotations

import math
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.algorithms.base import Policy
from miles.algorithms.sft import (
    SFT,
    conditional_velocity,
    flow_matching_loss,
    quantile_of_sigma,
    sigma_of_quantile,
)
from miles.config import Config
from miles.models.wan import WanRouting
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.train.collect import run_generator
from miles.train.sources import CleanLatents


def test_loss_matches_float64_formula():
    g = torch.Generator().manual_seed(11)
    v = torch.randn(3, 4, 2, 3, 5, generator=g, requires_grad=True)
    x0, noise = torch.randn(3, 4, 2, 3, 5, generator=g), torch.randn(3, 4, 2, 3, 5, generator=g)
    out = flow_matching_loss(v, x0, noise)
    out.sum().backward()
    v64, x64, n64 = v.detach().double(), x0.double(), noise.double()
    n = v[0].numel()
    ref = torch.tensor(
        [sum(float(e) ** 2 for e in (v64[b] - (n64[b] - x64[b])).flatten()) / n for b in range(3)],
        dtype=torch.float64,
    )
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=0)
    assert torch.allclose(v.grad.double(), 2.0 * (v64 - (n64 - x64)) / n, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_sigma_density(sampling):
    shift, mean, std = 3.0, 0.3, 0.8
    for q in (0.05, 0.37, 0.5, 0.93):
        u = q if sampling == "uniform" else 1.0 / (1.0 + math.exp(-(mean + std * NormalDist().inv_cdf(q))))
        ref = shift * u / (1.0 + (shift - 1.0) * u)
        got = sigma_of_quantile(torch.tensor(q, dtype=torch.float64), sampling, shift, mean, std)
        assert float(got) == pytest.approx(ref, rel=1e-12)
        assert quantile_of_sigma(ref, sampling, shift, mean, std) == pytest.approx(q, rel=1e-9)


class Linear3D(nn.Module):
    """A stand-in transformer: v = W·x (channels) + a·t/1000 + b·mean(context); records its inputs."""

    def __init__(self, channels: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(channels, channels, generator=g) * 0.3)
        self.a = nn.Parameter(torch.tensor(0.7))
        self.b = nn.Parameter(torch.tensor(-0.4))
        self.config = SimpleNamespace(patch_size=(1, 2, 2))
        self.seen = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        self.seen.append((timestep.detach().clone(), encoder_hidden_states.detach().clone()))
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        out = torch.einsum("oc,bcfhw->bofhw", self.w, hidden_states)
        ctx = encoder_hidden_states.mean(dim=(1, 2))
        return (out + (self.a * t / 1000 + self.b * ctx).view(-1, 1, 1, 1, 1),)


def _setup(num_experts=1, dropout=0.0, sampling="logit_normal"):
    cfg = Config()
    cfg.sft.timestep_sampling, cfg.sft.caption_dropout = sampling, dropout
    models = [Linear3D(4, seed=e) for e in range(num_experts)]
    policy = Policy(
        transformers=models,
        guidance_scales=[1.0] * num_experts,
        routing=WanRouting(0.875 if num_experts == 2 else None),
        reference=None,
        generator=lambda *parts: run_generator(5, *parts),
    )
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 4, 2, 4, 4, generator=g)
    pos, neg = torch.randn(4, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    chunks = [
        MicroBatch(slice=sl, pos=pos[sl], neg=neg, rollout=CleanLatents(x0[sl]))
        for sl in (slice(0, 2), slice(2, 4))
    ]
    batch = RolloutBatch(
        prompts=["p"] * 4,
        images=[None] * 4,
        group_ids=torch.tensor([0, 0, 1, 1]),
        sample_ids=torch.tensor([9, 4, 7, 2]),
        rollout_index=3,
        chunks=chunks,
        sde_steps=[],
    )
    return SFT(cfg), policy, batch, x0, pos, neg


def test_step_gradient_matches_float64_formula():
    algo, policy, batch, x0, pos, neg = _setup(dropout=0.5)
    sums = algo.accumulate(policy, batch, batch.chunks, step_in_rollout=1)
    model = policy.transformers[0]
    sigma, noise, drop = algo.draws(policy, 3, [9, 4, 7, 2], x0.shape[1:], (0.0, 1.0))
    assert drop.any() and not drop.all()  # both branches are exercised
    # the float64 loss of the same draws, through a float64 copy of the model's formula
    w, a, b = (p.detach().double().requires_grad_() for p in (model.w, model.a, model.b))
    s = sigma.double().view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0.double() + s * noise.double()
    ctx = torch.where(drop.view(-1, 1, 1), neg.double().expand_as(pos), pos.double()).mean(dim=(1, 2))
    v = torch.einsum("oc,bcfhw->bofhw", w, x_t) + (a * sigma.double() + b * ctx).view(-1, 1, 1, 1, 1)
    ref = ((v - (noise.double() - x0.double())) ** 2).mean(dim=(1, 2, 3, 4)).mean()
    ref.backward()
    assert sums["loss"] == pytest.approx(float(ref.detach()), rel=1e-5)
    assert sums["sigma_mean"] == pytest.approx(float(sigma.double().mean()), rel=1e-6)
    for p, p64 in ((model.w, w), (model.a, a), (model.b, b)):
        assert torch.allclose(p.grad.double(), p64.grad, rtol=1e-4, atol=1e-7)
    # the model saw one fp32 timestep per sample, 1000·σ, and the negative prompt where dropped
    timesteps = torch.cat([t for t, _ in model.seen])
    assert torch.equal(timesteps, sigma * 1000)
    contexts = torch.cat([c for _, c in model.seen])
    assert torch.equal(contexts[drop], neg.expand(int(drop.sum()), -1, -1))


def test_draws_are_keyed_by_sample_not_position():
    algo, policy, *_ = _setup()
    one = algo.draws(policy, 3, [9, 4], (4, 2, 4, 4), (0.0, 1.0))
    two = algo.draws(policy, 3, [4], (4, 2, 4, 4), (0.0, 1.0))
    assert torch.equal(one[0][1:], two[0]) and torch.equal(one[1][1:], two[1])
    other_rollout = algo.draws(policy, 4, [4], (4, 2, 4, 4), (0.0, 1.0))
    assert not torch.equal(other_rollout[1], two[1])


def test_two_experts_one_per_step_within_its_range():
    algo, policy, batch, *_ = _setup(num_experts=2, sampling="uniform")
    q_b = quantile_of_sigma(0.875, "uniform", 3.0)
    assert q_b == pytest.approx(0.875 / (3.0 - 2.0 * 0.875))  # the shift's inverse at the boundary
    experts = set()
    for step in range(12):
        for m in policy.transformers:
            m.seen.clear()
            m.zero_grad(set_to_none=True)
        algo.accumulate(policy, batch, batch.chunks, step_in_rollout=step)
        used = [i for i, m in enumerate(policy.transformers) if m.seen]
        assert len(used) == 1  # every pass of the step runs the one expert drawn for it
        t = torch.cat([t for t, _ in policy.transformers[used[0]].seen]) / 1000
        assert bool((t >= 0.875 - 1e-6).all()) if used[0] == 0 else bool((t <= 0.875 + 1e-6).all())
        experts.add(used[0])
    assert experts == {0, 1}


def test_per_token_timesteps():
    model = Linear3D(4, seed=0)
    x = torch.randn(2, 4, 3, 4, 4)
    sigma = torch.tensor([0.25, 0.8])
    conditional_velocity(model, x, sigma, torch.randn(2, 6, 8), routing=WanRouting(expand_timesteps=True))
    t = model.seen[0][0]
    assert t.shape == (2, 3 * 2 * 2) and torch.equal(t, (sigma * 1000)[:, None].expand(2, 12))


def test_first_frame_condition_is_clean_and_carries_no_loss():
    """Wan2.2 TI2V's image mode: the condition's latent frame replaces frame 0 of the input, its tokens
    get timestep 0, and the loss covers the generated frames 1..F-1 only."""
    from miles.rollout.condition import ImageCondition

    algo, policy, batch, x0, pos, neg = _setup()
    g = torch.Generator().manual_seed(8)
    image = torch.randn(4, 4, 1, 4, 4, generator=g)
    for chunk in batch.chunks:
        chunk.condition = ImageCondition(mode="first_frame", latents=image[chunk.slice])
    sums = algo.accumulate(policy, batch, batch.chunks)
    model = policy.transformers[0]
    sigma, noise, _ = algo.draws(policy, 3, [9, 4, 7, 2], x0.shape[1:], (0.0, 1.0))
    t = torch.cat([t for t, _ in model.seen])  # (B, S): 2 latent frames x 2 x 2 patches
    assert torch.equal(t[:, :4], torch.zeros(4, 4))
    assert torch.equal(t[:, 4:], (sigma * 1000)[:, None].expand(4, 4))
    w, a, b = (p.detach().double() for p in (model.w, model.a, model.b))
    s = sigma.double().view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0.double() + s * noise.double()
    x_in = torch.cat([image.double(), x_t[:, :, 1:]], dim=2)
    # the stand-in reads the first token's timestep (0 here): no time term
    v = torch.einsum("oc,bcfhw->bofhw", w, x_in) + (a * 0 + b * pos.double().mean(dim=(1, 2))).view(
        -1, 1, 1, 1, 1
    )
    target = noise.double() - x0.double()
    ref = ((v - target)[:, :, 1:] ** 2).mean(dim=(1, 2, 3, 4)).mean()
    assert sums["loss"] == pytest.approx(float(ref), rel=1e-5)
