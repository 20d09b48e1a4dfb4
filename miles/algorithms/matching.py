"""Shared pieces of the flow-matching algorithms (AWM, DGPO, online DPO): noise levels, forward
noise, velocities and the per-sample flow-matching error on a rollout's clean samples.

These algorithms roll out with the ODE (``sde_steps`` returns []: the rollout records only the
clean latents x0, so any solver would do) and train on the forward process
x_σ = (1 − σ)·x0 + σ·ε, whose flow-matching target is the velocity ε − x0. The per-sample error

    e(v) = mean((v − (ε − x0))²)        over the generated part of the latents

is the pretraining loss; each algorithm weighs it differently.

Layout independence, as in DiffusionNFT: the levels of an optimizer step are drawn from a
generator keyed by the rollout and the step's index in it (the same on every rank, so with two
experts every rank runs the same expert at each pass), and a sample's forward noise from one keyed
by its global sample index (or its group's, where a group shares noise) and the level.

Where a loss couples samples (DGPO's group weight, DPO's pairs), its gradient with respect to each
sample's error is a coefficient known once every error of the step is: a no-grad pass computes
the errors, the coefficients follow, and a gradient pass backpropagates Σ_i c_i·e_i (plus any
per-sample term). With the same weights and inputs the two passes compute the same errors, so the
gradient is that of the coupled loss, one extra forward per sample and level.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.algorithms.base import Algorithm, Policy
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.condition import generated
from miles.rollout.sampler import NUM_TRAIN_TIMESTEPS, flow_sigmas, predict_velocity
from miles.rollout.schedule import FlowSchedule


def level_candidates(num_steps: int, shift: float | FlowSchedule, fraction: float) -> Tensor:
    """The first max(1, floor(fraction·T)) noise levels of the rollout's T-step grid (from σ = 1 down)."""
    sigmas = flow_sigmas(num_steps, shift)[:num_steps]
    return sigmas[: max(1, int(fraction * num_steps))]


def check_num_levels(section: str, num_levels: int, candidates: Tensor) -> None:
    if not 1 <= num_levels <= len(candidates):
        raise ValueError(
            f"{section}.num_levels = {num_levels} must be in [1, {len(candidates)}]: the levels are drawn "
            f"without replacement from the first {len(candidates)} of the rollout's noise levels "
            f"(raise {section}.timestep_fraction or rollout.num_steps, or lower {section}.num_levels)"
        )


def check_group_per_step(name: str, cfg) -> None:
    """Group-coupled losses (DGPO, DPO) need at least two of a group's samples in each optimizer step."""
    G, steps = cfg.data.group_size, cfg.train.steps_per_rollout
    if G % steps == 0 and G // steps < 2:
        raise ValueError(
            f"algorithm.name {name} compares samples within a group, but train.steps_per_rollout = {steps} "
            f"splits each group of data.group_size = {G} into steps of {G // steps} sample: lower "
            f"train.steps_per_rollout (1 keeps whole groups) or raise data.group_size"
        )


def draw_levels(candidates: Tensor, num_levels: int, generator: torch.Generator) -> Tensor:
    """``num_levels`` of ``candidates`` without replacement, in the generator's order."""
    return candidates[torch.randperm(len(candidates), generator=generator)[:num_levels]]


def step_levels(
    policy: Policy, batch: RolloutBatch, step_in_rollout: int, salt: int, candidates: Tensor, num_levels: int
) -> Tensor:
    """The optimizer step's noise levels, the same on every rank."""
    g = policy.generator(salt, batch.rollout_index, step_in_rollout)
    return draw_levels(candidates, num_levels, g)


def forward_noise(policy: Policy, keys: list[int], shape, salt: int, rollout: int, level: int) -> Tensor:
    """(len(keys), *shape) fp32 noise, one draw per key (a global sample or group index) and level."""
    return torch.stack(
        [torch.randn(shape, generator=policy.generator(salt, rollout, k, level)) for k in keys]
    )


def velocity(
    transformers, policy: Policy, x: Tensor, sigma: Tensor, chunk: MicroBatch, guidance: float = 1.0
) -> Tensor:
    """The velocity at x_σ: the conditional branch (CFG-free) unless ``guidance`` > 1, then CFG with
    the rollout's negative prompt at that scale for every expert."""
    cfg = guidance > 1.0
    return predict_velocity(
        transformers,
        x,
        sigma * NUM_TRAIN_TIMESTEPS,
        chunk.pos,
        chunk.neg if cfg else None,
        [guidance] * len(transformers) if cfg else policy.guidance_scales,
        policy.routing,
        chunk.condition,
    )


def matching_error(v: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
    """(B,) e = mean((v − (ε − x0))²) per sample, in the inputs' dtype."""
    d = v - (noise - x0)
    return (d * d).mean(dim=tuple(range(1, d.ndim)))


def velocity_gap(v: Tensor, v_other: Tensor) -> Tensor:
    """(B,) mean((v − v_other)²) per sample: the velocity-space KL surrogate of the references."""
    d = v - v_other
    return (d * d).mean(dim=tuple(range(1, d.ndim)))


def noised(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    return (1.0 - sigma) * x0 + sigma * noise


def trained_part(chunk: MicroBatch, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor's generated part: a first-frame image condition's frame is clean, no loss on it."""
    return generated(chunk.condition, *tensors)


def linear_decay(step: int, rate: float, max_decay: float) -> float:
    """A lagging copy's decay after ``step`` optimizer steps: min(rate·step, max_decay)."""
    return min(rate * step, max_decay)


class OnPolicyMatching(Algorithm):
    """The frame AWM and DGPO share: ODE rollouts of the trained weights, and, where the algorithm
    keeps one (``uses_old_policy``), a lagging copy (``policy.old``) that only regularises, moved
    towards the trained weights after each rollout with decay min(rate·step, max)."""

    lagging_decay: tuple[str, float, float] = ("decay", 0.0, 0.0)
    """(metric name, rate, max) of the lagging copy's decay; the subclass sets it from its config."""

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        return []  # ODE rollouts: only the clean samples are recorded

    def rollout_transformers(self, policy: Policy):
        return policy.transformers  # on-policy: the lagging copy only regularises

    def after_rollout(self, policy: Policy, step: int) -> dict[str, float]:
        if not self.uses_old_policy:
            return {}
        name, rate, max_decay = self.lagging_decay
        decay = linear_decay(step, rate, max_decay)
        policy.old.soft_update(decay)
        return {name: decay}
