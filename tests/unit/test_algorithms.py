"""DiffusionNFT and GRPO-Guard losses against float64 re-derivations of their formulas.

- ``nft_loss`` against the reference's loss written out in float64 on fresh inputs (positive and
  negative implicit policies, x0 predictions with the detached mean-absolute-error weight), its
  gradient against autograd of that float64 formula, and the optimality probability;
- ``old_decay`` against the reference's three ``decay_type`` schedules;
- GRPO-Guard's normalised log-ratio equals mean(z·Δ) (its mean-zero, step-consistent form) and its
  gradient is that of mean(z·Δ), where the plain ratio carries the −b bias.
"""

from __future__ import annotations

import pytest
import torch

from miles.algorithms.diffusion_nft import nft_loss, old_decay, optimality
from miles.grpo.losses import grpo_policy_loss
from miles.rollout.sde import sde_step_with_logprob


def _reference_nft(v, v_old, x_t, x0, sigma, r, beta):
    pos = beta * v + (1 - beta) * v_old
    neg = (1 + beta) * v_old - beta * v
    out = []
    for pred in (x_t - sigma * pos, x_t - sigma * neg):
        w = (pred - x0).abs().mean(dim=(1, 2, 3, 4), keepdim=True).clamp(min=1e-5).detach()
        out.append(((pred - x0) ** 2 / w).mean(dim=(1, 2, 3, 4)))
    return (r * out[0] + (1 - r) * out[1]) / beta


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_matches_float64_formula(beta):
    g = torch.Generator().manual_seed(7)
    shape = (3, 4, 2, 5, 5)
    x0, noise, v_old = (torch.randn(shape, generator=g) for _ in range(3))
    v = (v_old + 0.1 * torch.randn(shape, generator=g)).requires_grad_(True)
    sigma = 0.63
    x_t = (1 - sigma) * x0 + sigma * noise
    r = optimality(torch.tensor([2.0, -7.0, 0.3]), adv_clip_max=5.0)
    assert torch.allclose(r, torch.tensor([0.7, 0.0, 0.53]))
    loss, pos, neg = nft_loss(v, v_old, x_t, x0, sigma, r, beta)
    v64 = v.detach().double().requires_grad_(True)
    ref = _reference_nft(v64, v_old.double(), x_t.double(), x0.double(), sigma, r.double(), beta)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(v.grad.double(), v64.grad, rtol=1e-4, atol=1e-7)
    assert (pos >= 0).all() and (neg >= 0).all()


def test_old_decay_schedules():
    # the reference's decay_type 0, 1, 2 as (flat, rate, max)
    assert [old_decay(s, 0.0, 0.0, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [old_decay(s, 0.001, 0.5, 0) for s in (0, 100, 499, 5000)] == pytest.approx([0.0, 0.1, 0.499, 0.5])
    assert [old_decay(s, 0.0075, 0.999, 75) for s in (0, 74, 75, 175, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.75, 0.999]
    )


def test_guard_ratio_is_mean_z_delta():
    g = torch.Generator().manual_seed(3)
    shape = (4, 2, 3, 4, 4)
    x, v_old = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma, sigma_next, a = 0.7, 0.55, 0.7
    old = sde_step_with_logprob(v_old, x, sigma, sigma_next, a, generator=g)
    v = (v_old + 0.05 * torch.randn(shape, generator=g)).requires_grad_(True)
    new = sde_step_with_logprob(v, x, sigma, sigma_next, a, prev_sample=old.prev_sample)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    guard = grpo_policy_loss(
        new.log_prob, old.log_prob, adv, 1e9, mean=new.mean, std=new.std, old_mean=old.mean
    )
    z = ((old.prev_sample - old.mean) / old.std).double()
    delta = new.mean.double() - old.mean.double()
    expected = (z * delta).mean(dim=(1, 2, 3, 4))
    # with a huge clip range the loss is −mean(A·exp(log_ratio)): recover the log-ratios
    plain = grpo_policy_loss(new.log_prob, old.log_prob, adv, 1e9)
    bias = (delta**2).mean(dim=(1, 2, 3, 4)) / (2 * new.std.double().reshape(4) ** 2)
    raw = new.log_prob.double() - old.log_prob.double()
    torch.testing.assert_close(raw, expected / new.std.double().reshape(4) - bias, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        guard.policy_loss.double(), -(adv.double() * expected.exp()).mean(), rtol=1e-6, atol=1e-9
    )
    assert not torch.allclose(plain.policy_loss, guard.policy_loss)
    (grad,) = torch.autograd.grad(guard.policy_loss, v)
    v64 = v.detach().double().requires_grad_(True)
    mean64 = sde_step_with_logprob(
        v64, x.double(), sigma, sigma_next, a, prev_sample=old.prev_sample.double()
    ).mean
    ref = -(adv.double() * (z * (mean64 - old.mean.double())).mean(dim=(1, 2, 3, 4)).exp()).mean()
    (grad64,) = torch.autograd.grad(ref, v64)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-3, atol=1e-9)
