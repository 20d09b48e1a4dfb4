"""Truncated importance sampling (TIS) for rollouts sampled by a policy other than the trained one.

When the rollout runs in a cheaper arithmetic (FP8, ``rollout.precision``) its policy π_roll
differs slightly from the bf16 policy π_old the optimizer starts the rollout's updates from.
As LLM RL does for FP8 or vLLM rollouts (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"), the clipped-ratio loss is formed against π_old, and each
sample-step's term is reweighted by the truncated importance weight of π_old against π_roll:

    w      = min(exp(logp_old − logp_roll), C)          (detached, per sample and SDE step)
    loss   = mean_i( w_i · max(−A_i·r_i, −A_i·clip(r_i, 1 − ε, 1 + ε)) ),   r_i = exp(logp_new − logp_old)

so that, up to the truncation at C, the gradient is the on-policy one of π_old in expectation
over π_roll's samples. With π_roll = π_old (logp_old = logp_roll) every w is exactly 1 and the
loss is bit for bit the uncorrected one. Here a log-prob is the per-step Gaussian log-density
averaged over latent dims (``miles.rollout.sde``), as the ratio uses it, so w is the importance
weight of that per-dim average (as flow_grpo's ratio is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DriftStats", "tis_weights"]


def tis_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, cap: float) -> Tensor:
    """w = min(exp(old − rollout), cap), fp32, detached; (B,) like its inputs."""
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old and rollout log-probs must have one shape, got {tuple(old_log_prob.shape)} "
            f"and {tuple(rollout_log_prob.shape)}"
        )
    if cap < 1:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    log_w = old_log_prob.detach().float() - rollout_log_prob.detach().float()
    return torch.exp(log_w).clamp(max=cap)


@dataclass
class DriftStats:
    """Sample-weighted sums of the rollout policy's drift from the bf16 one over one optimizer step:
    ``add`` one SDE step of a micro-batch at a time, ``metrics()`` at the end."""

    gap: float = 0.0
    weight: float = 0.0
    capped: float = 0.0
    weight_max: float = 0.0

    def add(self, old_log_prob: Tensor, rollout_log_prob: Tensor, cap: float, share: float) -> Tensor:
        """Record one SDE step of a micro-batch (``share``: its weight in the step's mean) and return
        its TIS weights (cap 0: no correction, the weights still recorded uncapped)."""
        w = tis_weights(old_log_prob, rollout_log_prob, cap if cap > 0 else float("inf"))
        gap = (old_log_prob.detach().float() - rollout_log_prob.detach().float()).abs()
        self.gap += float(gap.mean()) * share
        self.weight += float(w.mean()) * share
        self.capped += float((w >= cap).float().mean()) * share if cap > 0 else 0.0
        self.weight_max = max(self.weight_max, float(w.max()))
        return w

    def metrics(self) -> dict[str, float]:
        """``tis_logp_gap``: mean |logp_bf16 − logp_rollout|; ``tis_weight_mean``, ``tis_weight_max``
        (this rank's max), ``tis_capped_frac``: the fraction of weights at the cap."""
        return {
            "tis_logp_gap": self.gap,
            "tis_weight_mean": self.weight,
            "tis_weight_max": self.weight_max,
            "tis_capped_frac": self.capped,
        }
