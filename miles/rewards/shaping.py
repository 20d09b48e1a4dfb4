"""Reward shaping: per-reward normalisation before weighting, and eval-only (gold) rewards.

    trained reward  R_j = sum_i w_i * norm_i(r_ij)

where ``norm_i`` is reward i's ``reward.normalize`` mode over the whole rollout batch (every dp
rank's samples):

- ``none``: the raw score;
- ``group``: ``(r - mean_g) / (std_g + eps)`` within each prompt's group g (the GRPO group);
- ``batch``: ``(r - mean) / (std + eps)`` over the batch.

Stds are population stds (ddof 0) and eps = 1e-4, as in ``miles.grpo.advantages``; the
arithmetic is float64. Normalising each reward first keeps one reward with a large scale (JPEG
kB, an aesthetic score on 1..10) from drowning another (a CLIP cosine near 0.3) whatever the
weights, the per-reward normalisation of multi-reward GRPO trainers. Advantages are then
computed from ``R`` as usual. The logged ``reward/<name>`` stay the raw scores.

Gold rewards (``reward.gold``) are built before the first rollout like the trained ones but
scored only in held-out evaluation, never trained on: :class:`EvalRewards` appends them to the
trained mix's per-reward scores, so they are logged as ``eval/<name>/mean`` beside the others
while ``eval/reward/mean`` stays the trained mix. A trained reward rising while its gold
counterpart falls is over-optimisation (reward hacking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from miles.rewards.registry import MultiReward

NORMALIZE_MODES = ("none", "group", "batch")
EPS = 1e-4


def check_normalize(normalize: Mapping[str, str], weights: Mapping[str, float]) -> dict[str, str]:
    """``normalize`` checked against the trained rewards; returns one mode per trained reward."""
    for name, mode in normalize.items():
        if name not in weights:
            raise ValueError(
                f"reward.normalize names {name!r}, which is not a trained reward; "
                f"reward.weights has {sorted(weights)}"
            )
        if mode not in NORMALIZE_MODES:
            raise ValueError(f"reward.normalize.{name} must be one of {list(NORMALIZE_MODES)}; got {mode!r}")
    return {name: normalize.get(name, "none") for name in weights}


def check_gold(gold: Sequence[str], weights: Mapping[str, float]) -> list[str]:
    """Gold rewards must differ from the trained ones (a reward trained on is no referee)."""
    trained = sorted(set(gold) & set(weights))
    if trained:
        raise ValueError(
            f"reward.gold {trained} also appear in reward.weights: a gold reward is never trained on "
            "(drop it from one of the two)"
        )
    if len(set(gold)) != len(gold):
        raise ValueError(f"reward.gold names a reward twice: {list(gold)}")
    return list(gold)


def normalize_scores(values: torch.Tensor, group_ids: torch.Tensor, mode: str) -> torch.Tensor:
    """One reward's scores (N,) normalised as ``mode`` with groups ``group_ids`` (N,): (N,) float64."""
    r = values.double()
    if mode == "none":
        return r
    if mode == "batch":
        return (r - r.mean()) / (r.std(unbiased=False) + EPS)
    if mode != "group":
        raise ValueError(f"unknown normalisation {mode!r}; one of {list(NORMALIZE_MODES)}")
    _, inverse, counts = torch.unique(group_ids.to(r.device), return_inverse=True, return_counts=True)
    counts = counts.double()
    mean = (
        torch.zeros(counts.numel(), dtype=torch.float64, device=r.device).index_add_(0, inverse, r) / counts
    )
    centred = r - mean[inverse]
    var = torch.zeros_like(mean).index_add_(0, inverse, centred**2) / counts
    return centred / (var.sqrt()[inverse] + EPS)


def shaped_reward(
    per_reward: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    normalize: Mapping[str, str],
    group_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_i w_i * norm_i(r_i)`` over the trained rewards, (N,) float32 (float64 arithmetic)."""
    total = None
    for name, weight in weights.items():
        term = weight * normalize_scores(per_reward[name], group_ids, normalize.get(name, "none"))
        total = term if total is None else total + term
    assert total is not None, "no trained reward"
    return total.float()


class EvalRewards:
    """The trained mix plus gold rewards: scored together in evaluation, gold kept out of the sum.

    Quacks like :class:`MultiReward` for ``miles.eval.evaluate``: ``names`` lists the trained
    rewards then the gold ones, and a call returns ``(combined, per_reward)`` with ``combined``
    the trained mix's weighted sum.
    """

    def __init__(self, trained: MultiReward, gold: MultiReward | None) -> None:
        self.trained, self.gold = trained, gold

    @property
    def names(self) -> list[str]:
        return self.trained.names + (self.gold.names if self.gold is not None else [])

    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], images: Sequence | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        combined, per_reward = self.trained(videos, prompts, images)
        if self.gold is not None:
            _, gold = self.gold(videos, prompts, images)
            per_reward = {**per_reward, **gold}
        return combined, per_reward
