"""The algorithm seam: what a rollout records, and how the loss of an optimizer step is formed.

The training loop is the same for every algorithm: roll out, decode and score, normalise the
rewards within prompt groups, then take ``train.steps_per_rollout`` optimizer steps, each over
its share of the rollout's micro-batches. An :class:`Algorithm` decides the two things that
differ: which denoising steps the rollout samples stochastically and records (Flow-GRPO: SDE
steps with their log-probabilities; a forward-process method: none, only clean samples), and the
loss it backpropagates over one optimizer step's micro-batches. Algorithms are chosen by
``algorithm.name`` from the registry (``miles.algorithms.build_algorithm``); the trainer never
branches on the name.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Policy:
    """What an algorithm needs of the model being trained (the trainer builds it)."""

    transformers: Sequence[nn.Module]
    guidance_scales: list[float]
    boundary_ratio: float | None
    expand_timesteps: bool
    reference_mean: Callable | None
    """(rollout, k, chunk) -> the reference policy's SDE mean, or None without a KL term."""


class Algorithm(abc.ABC):
    """One RL algorithm behind the loop; subclasses register with ``@register_algorithm``."""

    name: str = ""

    @abc.abstractmethod
    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        """The denoising steps the rollout samples stochastically and records, the same on
        every rank (drawn from ``generator``); [] records none (ODE rollouts)."""

    @abc.abstractmethod
    def accumulate(self, policy: Policy, batch: dict, chunks: list[dict]) -> dict[str, float]:
        """Backpropagate the loss of one optimizer step over ``chunks`` (its micro-batches of the
        rollout ``batch``) into the gradients; return the step's metrics (sample-weighted means),
        with ``loss`` among them and ``log_prob_mean_abs_diff`` where the algorithm has one."""
