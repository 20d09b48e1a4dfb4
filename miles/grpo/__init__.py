"""GRPO math: group-normalised advantages and the clipped-ratio policy loss."""

from miles.grpo.advantages import group_advantages, summary_stats, zero_std_fraction
from miles.grpo.losses import PolicyLoss, gaussian_mean_kl, grpo_policy_loss

__all__ = [
    "PolicyLoss",
    "gaussian_mean_kl",
    "group_advantages",
    "grpo_policy_loss",
    "summary_stats",
    "zero_std_fraction",
]
