"""GRPO advantages: rewards normalised within each prompt's group of samples.

    A_i = (r_i − mean_{g(i)}) / (std_{g(i)} + eps),   clipped to [−adv_clip_max, adv_clip_max]

where g(i) is sample i's group (the G samples of one prompt in one rollout step). With
``global_std`` the denominator is the std over all samples instead (flow_grpo's
``global_std`` option: groups whose rewards barely differ are not blown up to ±1). Stds are
population stds (ddof = 0) as in flow_grpo's ``PerPromptStatTracker`` (np.std); eps = 1e-4
likewise. Unlike flow_grpo, groups are identified by an integer id tensor rather than by
prompt string, and the arithmetic is done in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    adv_clip_max: float | None = 5.0,
) -> Tensor:
    """Per-group normalised, clipped advantages (N,) float32 for rewards (N,) with group ids (N,).

    Pass every sample of every group (after gathering across data-parallel ranks if groups or
    ``global_std`` span ranks); a group of one sample gets advantage 0.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    r = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    counts = counts.double()
    group_sum = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    group_mean = group_sum / counts
    centred = r - group_mean[inverse]
    if global_std:
        std = r.std(unbiased=False).expand_as(r)
    else:
        group_var = torch.zeros_like(group_mean).index_add_(0, inverse, centred**2) / counts
        std = group_var.sqrt()[inverse]
    adv = centred / (std + eps)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv.float()


def summary_stats(values: Tensor) -> dict[str, float]:
    """mean, std (population), min and max of a tensor, as Python floats for logging."""
    v = values.detach().double().flatten()
    if v.numel() == 0:
        raise ValueError("summary_stats of an empty tensor")
    return {
        "mean": v.mean().item(),
        "std": v.std(unbiased=False).item(),
        "min": v.min().item(),
        "max": v.max().item(),
    }


def zero_std_fraction(rewards: Tensor, group_ids: Tensor) -> float:
    """Fraction of groups whose rewards are all equal (they carry no learning signal)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1
    r = rewards.double()
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=r.device)
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=r.device)
    lo = lo.scatter_reduce(0, inverse, r, reduce="amin")
    hi = hi.scatter_reduce(0, inverse, r, reduce="amax")
    return (lo == hi).double().mean().item()
