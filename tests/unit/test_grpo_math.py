"""GRPO advantages and the clipped-ratio loss against hand-written float64 references."""

import numpy as np
import pytest
import torch

from miles.grpo.advantages import group_advantages, summary_stats, zero_std_fraction
from miles.grpo.losses import gaussian_mean_kl, grpo_policy_loss


def _reference_advantages(rewards, groups, global_std, eps, clip):
    r = np.asarray(rewards, dtype=np.float64)
    out = np.empty_like(r)
    for g in set(groups):
        idx = [i for i, gi in enumerate(groups) if gi == g]
        std = r.std() if global_std else r[idx].std()
        out[idx] = (r[idx] - r[idx].mean()) / (std + eps)
    return np.clip(out, -clip, clip)


@pytest.mark.parametrize("global_std", [False, True])
def test_group_advantages_match_reference(global_std):
    g = torch.Generator().manual_seed(0)
    groups = [3, 3, 3, 3, 7, 7, 7, 7, 1, 1, 1, 1]  # ids need not be contiguous or sorted
    perm = torch.randperm(12, generator=g).tolist()
    groups = [groups[i] for i in perm]
    rewards = torch.randn(12, generator=g) * torch.tensor([0.1, 2.0, 5.0] * 4)
    adv = group_advantages(rewards, torch.tensor(groups), global_std=global_std, adv_clip_max=100.0)
    ref = _reference_advantages(rewards.double().numpy(), groups, global_std, 1e-4, 100.0)
    assert adv.dtype == torch.float32
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-6, atol=1e-6)


def test_group_advantages_per_group_are_standardised_and_clipped():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 50.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, ids, adv_clip_max=None)
    assert adv[:4].mean().abs() < 1e-6 and (adv[:4].double().std(unbiased=False) - 1).abs() < 1e-3
    assert adv[7] > 1.5  # the outlier of group 1 (sqrt(3) before eps)
    clipped = group_advantages(rewards, ids, adv_clip_max=1.0)
    assert clipped.max().item() == 1.0 and clipped.min().item() == -1.0
    ref = _reference_advantages(rewards.numpy(), ids.tolist(), False, 1e-4, 1.0)
    np.testing.assert_allclose(clipped.numpy(), ref, rtol=1e-6)
    # Equal rewards in a group give zero advantage, not NaN.
    flat = group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]))
    assert flat[0].item() == 0.0 and flat[1].item() == 0.0 and flat[3] > 0
    assert zero_std_fraction(torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1])) == 0.5


def test_global_std_differs_from_per_group():
    rewards = torch.tensor([0.0, 0.01, 5.0, 15.0])
    ids = torch.tensor([0, 0, 1, 1])
    per_group = group_advantages(rewards, ids)
    global_ = group_advantages(rewards, ids, global_std=True)
    assert per_group[1] > 0.95 and global_[1].abs() < 0.01  # a tiny group spread stays tiny


def test_summary_stats():
    s = summary_stats(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert s == pytest.approx({"mean": 3.0, "std": np.std([1, 2, 3, 6]), "min": 1.0, "max": 6.0})


def _reference_loss(logp, old, adv, eps):
    logp, old, adv = logp.double(), old.double(), adv.double()
    total, clipped_count = 0.0, 0
    for i in range(len(logp)):
        r = float(torch.exp(logp[i] - old[i]))
        a = float(adv[i])
        total += max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
        clipped_count += abs(r - 1) > eps
    n = len(logp)
    return total / n, clipped_count / n, 0.5 * float(((logp - old) ** 2).mean())


def test_clipped_loss_matches_reference():
    g = torch.Generator().manual_seed(1)
    eps = 0.05
    old = torch.randn(64, generator=g)
    logp = (old + 0.08 * torch.randn(64, generator=g)).requires_grad_()
    adv = torch.randn(64, generator=g)
    out = grpo_policy_loss(logp, old, adv, eps)
    loss, clipfrac, approx_kl = _reference_loss(logp.detach(), old, adv, eps)
    assert out.policy_loss.item() == pytest.approx(loss, rel=1e-5)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    assert 0.1 < clipfrac < 0.9 and out.clipfrac.item() == pytest.approx(clipfrac)
    assert out.approx_kl.item() == pytest.approx(approx_kl, rel=1e-5)
    assert out.ratio_mean.item() == pytest.approx(torch.exp(logp - old).mean().item(), rel=1e-6)
    assert out.kl.item() == 0.0

    # Gradient: only unclipped samples contribute, each with -A * ratio / n.
    out.loss.backward()
    ratio = torch.exp(logp.detach() - old)
    active = ~(((ratio > 1 + eps) & (adv > 0)) | ((ratio < 1 - eps) & (adv < 0)))
    torch.testing.assert_close(logp.grad, torch.where(active, -adv * ratio / 64, torch.zeros(64)))


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.randn(16, generator=torch.Generator().manual_seed(2))
    logp = torch.randn(16)
    out = grpo_policy_loss(logp, logp.clone(), adv, 1e-4)
    assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-7)
    assert out.clipfrac.item() == 0.0 and out.approx_kl.item() == 0.0 and out.ratio_mean.item() == 1.0


def test_kl_term():
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(4, 3, 2, 5, 5, generator=g, requires_grad=True)
    ref = mean.detach() + 0.1 * torch.randn(4, 3, 2, 5, 5, generator=g)
    std = torch.tensor([0.5, 0.3, 0.2, 0.1]).view(4, 1, 1, 1, 1)
    kl = gaussian_mean_kl(mean, ref, std)
    expected = torch.stack(
        [
            ((mean[i].double() - ref[i].double()) ** 2).mean() / (2 * std[i].double().item() ** 2)
            for i in range(4)
        ]
    )
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=0)
    # Per-dimension KL of two equal-std Gaussians, checked against torch.distributions.
    d = torch.distributions
    full = d.kl_divergence(d.Normal(mean[0].detach(), 0.5), d.Normal(ref[0], 0.5)).mean()
    assert kl[0].item() == pytest.approx(full.item(), rel=1e-5)

    logp = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    out = grpo_policy_loss(logp, logp, adv, 1e-4, beta=0.04, mean=mean, ref_mean=ref, std=std)
    assert out.loss.item() == pytest.approx(-adv.mean().item() + 0.04 * kl.mean().item(), rel=1e-5)
    assert out.kl.item() == pytest.approx(kl.mean().item(), rel=1e-6)
    out.loss.backward()
    assert mean.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="KL"):
        grpo_policy_loss(logp, logp, adv, 1e-4, beta=0.1)


def test_step_loss_weight_sigma_over_sqrt_dt_on_sde_and_cps_noise():
    """``grpo.step_loss_weight: sigma_over_sqrt_dt`` with ``sde`` (the SD3 noise a·√(σ/(1−σ))) and
    ``cps`` noise against the formula in float64: the Wan script's form σ_t/√|dt| put on noises
    no flow_grpo script weights this way (flow_grpo_wan's exact weight, against flow_grpo's own
    numbers: tests/unit/test_sde_flow_grpo_wan.py). The weight scales the policy term's gradient
    and nothing else."""
    import math
    from types import SimpleNamespace

    from miles.algorithms.flow_grpo import FlowGRPO
    from miles.config import Config, GRPOConfig, RolloutConfig

    ro = SimpleNamespace(sigmas=torch.tensor([1.0, 0.8]), sigma_next=torch.tensor([0.9, 0.7]))
    for sde_type, a in (("sde", 0.7), ("cps", 0.5)):
        cfg = Config(
            rollout=RolloutConfig(sde_type=sde_type, noise_level=a),
            grpo=GRPOConfig(step_loss_weight="sigma_over_sqrt_dt"),
        )
        algo = FlowGRPO(cfg)
        for k, (s, sn) in enumerate(((1.0, 0.9), (0.8, 0.7))):
            if sde_type == "sde":  # at σ = 1 flow_grpo's σ_t uses the next sigma in 1 − σ
                sigma_t = a * math.sqrt(s / (1 - (sn if s == 1.0 else s)))
            else:
                sigma_t = sn * math.sin(a * math.pi / 2)
            assert algo._step_weight(ro, k) == pytest.approx(sigma_t / math.sqrt(s - sn), rel=1e-6)
        assert (
            FlowGRPO(Config(rollout=RolloutConfig(sde_type=sde_type, noise_level=a)))._step_weight(ro, 1)
            == 1.0
        )

    lp = torch.randn(4, requires_grad=True)
    old, adv = lp.detach() + 1e-5, torch.randn(4)
    grads = []
    for w in (1.0, 3.0):
        lp.grad = None
        grpo_policy_loss(lp, old, adv, 0.2, policy_weight=w).loss.backward()
        grads.append(lp.grad.clone())
    torch.testing.assert_close(grads[1], 3.0 * grads[0])
