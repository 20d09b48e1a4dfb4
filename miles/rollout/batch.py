"""The rollout batch, typed: what one rank's rollout hands to scoring and to the algorithm.

:func:`miles.train.collect.collect` fills a :class:`RolloutBatch` (its micro-batches are
:class:`MicroBatch`); :func:`miles.train.score.score` returns its :class:`Scores` and sets
``RolloutBatch.advantages`` and ``RolloutBatch.rewards``; the algorithm (``miles.algorithms``)
reads both to build its loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["MicroBatch", "RolloutBatch", "Scores"]


@dataclass
class MicroBatch:
    """One micro-batch of the rollout: its samples, their text embeddings and what was sampled."""

    slice: slice  # its samples' positions in the rank's batch
    pos: Tensor  # prompt embeddings (B, L, text_dim), compute dtype
    neg: Tensor  # the negative prompt's embedding (1, L, text_dim)
    rollout: Any  # miles.rollout.sampler.Rollout: latents, log-probs and SDE steps it recorded
    condition: Any = None  # image-to-video: the ImageCondition of its samples; None for text-to-video
    video: Any = None  # rollout.overlap_decode: a future of its decoded frames (score waits on it)


@dataclass
class RolloutBatch:
    """One rank's rollout, in step-major order (``Trainer`` docstring): every sample's prompt,
    group and global index, and its micro-batches."""

    prompts: list[str]
    images: list  # each sample's first frame (None entries for text-to-video)
    group_ids: Tensor  # (n,) the prompt group of each sample
    sample_ids: Tensor  # (n,) each sample's global index in the rollout batch
    rollout_index: int
    chunks: list[MicroBatch]
    sde_steps: list[int]  # the denoising steps sampled stochastically and recorded
    advantages: Tensor | None = None  # (n,) this rank's samples' advantages, set by scoring
    rewards: Tensor | None = None  # (n,) this rank's samples' trained (shaped) rewards, set by scoring


@dataclass
class Scores:
    """Every dp rank's rewards and advantages (gathered), and the videos this rank logs."""

    reward_all: Tensor  # (N,) the weighted reward of every sample of every dp rank
    shaped_all: Tensor  # what the advantages see (reward.normalize), else reward_all itself
    per_reward_all: dict[str, Tensor]
    advantages_all: Tensor
    videos: list | None = None  # (F, H, W, 3) uint8 of the micro-batches this rank decoded, if logged
    video_prompts: list[str] = field(default_factory=list)
    video_rewards: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Tensor]:
        """The rollout's reward and advantage statistics over every dp rank's samples."""
        rewards, adv = self.reward_all, self.advantages_all
        return {
            "reward/mean": rewards.mean(),
            "reward/std": rewards.std(),
            "reward/min": rewards.min(),
            "reward/max": rewards.max(),
            "advantage/mean": adv.mean(),
            "advantage/std": adv.std(),
            "advantage/abs_max": adv.abs().max(),
        }

    def breakdown(self) -> dict[str, Tensor]:
        """The shaped reward (``reward.normalize``: what advantages see) and each reward's statistics."""
        out = {}
        if self.shaped_all is not self.reward_all:
            out["reward/shaped/mean"] = self.shaped_all.mean()
            out["reward/shaped/std"] = self.shaped_all.std()
        for name, values in self.per_reward_all.items():
            out[f"reward/{name}/mean"] = values.mean()
            out[f"reward/{name}/std"] = values.std()
        return out
