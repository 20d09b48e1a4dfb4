"""The Flow-GRPO policy loss: PPO's clipped ratio on per-step SDE log-probs, plus optional KL.

For one SDE step of a batch, with A the (already normalised, clipped) advantages:

    ratio    = exp(logp_new − logp_old)
    loss_pg  = mean( max(−A·ratio, −A·clamp(ratio, 1 − ε, 1 + ε)) )
    kl       = mean_dims((mean_new − mean_ref)²) / (2·std²)      (per sample)
    loss     = loss_pg + β · mean(kl)

The KL is the exact closed form between the two Gaussian steps N(mean_new, std²) and
N(mean_ref, std²) of equal std, averaged over latent dims like the log-probs are, with std the
full step std σ_t·√|dt|: kl = mean_dims(Δμ²) / (2·σ_t²·|dt|). flow_grpo's Wan script
(scripts/train_wan2_1.py) computes exactly this, dividing by 2·(σ_t·√|dt|)² with its Wan σ_t.
Its SD3 training script divides by 2·σ_t² instead (σ_t without the √|dt|), so this exact step KL
is 1/|dt| times that value: a β of b there corresponds to b·|dt| here (with T = 10 steps,
|dt| ≈ 0.1). ``policy_weight`` carries a per-step weight of the policy term only, as the Wan
script's σ_t/√|dt| scales its policy loss and not its KL (``miles.algorithms.flow_grpo``).
Diagnostics (clipfrac, approx_kl, ratio_mean) are detached.

GRPO-Guard's ratio normalisation (``old_mean`` given; Wang et al. 2025, arXiv 2510.22319): with
Δ = mean_new − mean_old and s = std, the per-step log-ratio of two Gaussians of equal std is
mean_dims(z·Δ)/s − b with b = mean_dims(Δ²)/(2s²) ≥ 0, z the rollout's noise: its mean is
shifted left by b and its spread scales as 1/s, so it differs by orders of magnitude across
steps. The normalised log-ratio

    log_ratio_guard = (logp_new − logp_old + b) · s   ( = mean_dims(z·Δ) )

has mean 0 and the same scale at every step; b carries gradient, so the gradient is that of
mean_dims(z·Δ). This is the formula of verl-omni's GRPOGuardLoss (and of Flow-Factory's
GRPO-Guard trainer, which computes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PolicyLoss:
    """Scalar tensors; ``loss`` and ``policy_loss`` carry gradient."""

    loss: Tensor
    """policy_loss + β·kl: what to backpropagate."""
    policy_loss: Tensor
    kl: Tensor
    """Mean KL to the reference policy (0 without one); detached, the gradient is in ``loss``."""
    clipfrac: Tensor
    """Fraction of samples with |ratio − 1| > ε."""
    approx_kl: Tensor
    """0.5·mean((logp_new − logp_old)²): how far the policy moved since the rollout."""
    ratio_mean: Tensor


def gaussian_mean_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample KL (B,) between N(mean, std²) and N(ref_mean, std²), averaged over non-batch dims.

    ``std`` is (B, 1, ..., 1) or broadcastable; it must be the same for both Gaussians.
    """
    dims = tuple(range(1, mean.ndim))
    sq = ((mean.float() - ref_mean.float()) ** 2).mean(dim=dims)
    return sq / (2 * std.float().reshape(mean.shape[0], -1)[:, 0] ** 2)


def policy_log_ratio(
    log_prob: Tensor,
    old_log_prob: Tensor,
    *,
    mean: Tensor | None = None,
    std: Tensor | None = None,
    old_mean: Tensor | None = None,
) -> Tensor:
    """log r, (B,): the plain ratio's, or with ``old_mean`` GRPO-Guard's normalised one."""
    log_ratio = log_prob.float() - old_log_prob.float()
    if old_mean is not None:
        if mean is None or std is None:
            raise ValueError("the normalised (GRPO-Guard) ratio needs mean, old_mean and std")
        s = std.float().reshape(mean.shape[0], -1)[:, 0]
        bias = ((mean.float() - old_mean.float()) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * s**2)
        log_ratio = (log_ratio + bias) * s
    return log_ratio


def grpo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    *,
    beta: float = 0.0,
    mean: Tensor | None = None,
    ref_mean: Tensor | None = None,
    std: Tensor | None = None,
    policy_weight: float = 1.0,
    old_mean: Tensor | None = None,
    sample_weight: Tensor | None = None,
) -> PolicyLoss:
    """Clipped-ratio loss for one step of B samples: log-probs and advantages are (B,).

    With ``beta > 0``, ``mean`` (current policy's SDE mean, with gradient), ``ref_mean``
    (reference policy's) and ``std`` are required. ``policy_weight`` scales the policy term of
    ``loss`` (a per-step weight; ``policy_loss`` is reported unweighted). With ``old_mean`` (the
    rollout's SDE mean of this step), the ratio is GRPO-Guard's normalised one (module docstring);
    it needs ``mean`` and ``std`` too. ``sample_weight`` (B,), detached: each sample's clipped term
    is multiplied by it before the mean (truncated importance weights, ``miles.grpo.tis``).
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape) or log_prob.ndim != 1:
        raise ValueError(
            "log_prob, old_log_prob and advantages must all be (B,), got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )
    log_ratio = policy_log_ratio(log_prob, old_log_prob, mean=mean, std=std, old_mean=old_mean)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    if sample_weight is not None:
        if sample_weight.shape != per_sample.shape:
            raise ValueError(
                f"sample_weight must be (B,) = {tuple(per_sample.shape)}, got {tuple(sample_weight.shape)}"
            )
        per_sample = per_sample * sample_weight.detach().float()
    policy_loss = per_sample.mean()

    if beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std for the KL term")
        kl = gaussian_mean_kl(mean, ref_mean, std).mean()
        loss = policy_weight * policy_loss + beta * kl
    else:
        kl = torch.zeros((), device=policy_loss.device)
        loss = policy_weight * policy_loss

    with torch.no_grad():
        clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
        approx_kl = 0.5 * (log_ratio**2).mean()
        ratio_mean = ratio.mean()
    return PolicyLoss(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl.detach(),
        clipfrac=clipfrac,
        approx_kl=approx_kl,
        ratio_mean=ratio_mean,
    )
