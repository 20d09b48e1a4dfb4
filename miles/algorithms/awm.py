"""Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050): RL as the pretraining loss.

Rollouts are ODE samples of the trained policy (any solver: only the clean latents x0 and the
rewards are kept). Training noises x0 along the forward path at ``awm.num_levels`` levels σ drawn
from the rollout's grid and turns each sample's flow-matching error e = mean((v_θ − (ε − x0))²)
into a log-likelihood surrogate lp = −w(σ, e) (``awm.weighting``; ``ghuber``: σ·(e^p − ε^p)/p).
The loss of a level is

    mean_i(−A_i · exp(lp_i − sg(lp_i)))  +  kl_beta·mean((v_θ − v_ref)²)  +  ema_kl_beta·mean((v_θ − v_ema)²)

with A the group advantage clipped to ±grpo.adv_clip_max and rescaled to ±advantage_max: its
gradient is −A·∇lp, the advantage-weighted matching gradient (positive advantages pull the
velocity towards the sample's flow-matching target, negative ones push it away). v_ema is a
lagging copy of the weights, moved after each rollout with decay min(rate·step, max) (the
reference's ``linear`` schedule); the rollouts are sampled by the trained weights.

Departure from the reference: it forms the PPO ratio against log-probs computed with the weights
of the rollout (on-policy, ratio 1 on the first optimizer step and clip range 1 in its recipe).
miles trains each sample in exactly one optimizer step and takes the ratio against that step's own
weights, so the ratio is 1 and the clip never engages; the gradient is the reference's at ratio 1.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
from torch import Tensor

from miles.algorithms.base import Policy, run_schedule
from miles.algorithms.matching import (
    OnPolicyMatching,
    check_num_levels,
    forward_noise,
    level_candidates,
    matching_error,
    noised,
    step_levels,
    trained_part,
    velocity,
    velocity_gap,
)
from miles.algorithms.registry import register_algorithm
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.schedule import FlowSchedule

_METRICS = ("loss", "policy_loss", "matching_loss", "kl", "ema_kl")
_EPS = 1e-10


@dataclasses.dataclass(kw_only=True)
class AWMConfig:
    """``awm``: Advantage Weighted Matching's loss and its lagging copy."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_levels": ("[1, 1000]", ""),
        "timestep_fraction": ("(0, 1]", ""),
        "ghuber_power": ("(0, 10]", "the reference uses 0.25"),
        "advantage_max": ("[0, 1000]", "0 keeps the advantage unscaled"),
        "kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
        "ema_kl_beta": ("[0, 1e6]", "0 turns the EMA term off"),
        "ema_decay_rate": ("[0, 1]", ""),
        "ema_decay_max": ("[0, 1)", ""),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    num_levels: int = 4
    """Noise levels each sample is trained at per optimizer step, drawn without replacement from the
    first floor(timestep_fraction * rollout.num_steps) levels of the rollout's grid (the reference's
    ``train_timesteps``: 6 of 14)."""
    timestep_fraction: float = 0.9
    """The levels are drawn from the first floor(fraction * rollout.num_steps) of the rollout's noise
    levels (the reference: 0.9)."""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """The matching term's weighting w(σ, e) of the per-sample flow-matching error e: ``uniform`` e,
    ``t`` σ·e, ``t2`` σ²·e, ``huber`` σ·(√e − 1e-5), ``ghuber`` σ·(e^p − ε^p)/p with p = ghuber_power
    (the reference's PickScore recipe)."""
    ghuber_power: float = 0.25
    """p of the ``ghuber`` weighting."""
    advantage_max: float = 1.0
    """The clipped advantage is rescaled to [-advantage_max, advantage_max] (A · advantage_max /
    grpo.adv_clip_max, the reference's ``advantage_max``); 0 keeps it unscaled."""
    kl_beta: float = 1e-4
    """β, the weight of mean((v − v_ref)²) to the reference (initial) policy; 0 turns it off."""
    ema_kl_beta: float = 1.0
    """The weight of mean((v − v_ema)²) to a lagging copy of the weights (the reference's ``ema_beta``);
    0 turns it off and keeps no copy."""
    ema_decay_rate: float = 0.001
    """The lagging copy moves towards the trained weights after each rollout with decay
    min(rate · step, ema_decay_max) (the reference's ``linear`` schedule: 0.001, 0.3)."""
    ema_decay_max: float = 0.3
    """The lagging copy's largest decay."""


def awm_log_prob(err: Tensor, sigma: float | Tensor, weighting: str, power: float = 0.25) -> Tensor:
    """lp = −w(σ, e): the weighted matching error as a log-likelihood surrogate, per sample."""
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * sigma
    if weighting == "t2":
        return -err * sigma**2
    if weighting == "huber":
        return -(torch.sqrt(err + _EPS) - 1e-5) * sigma
    if weighting == "ghuber":
        eps = torch.tensor(_EPS, dtype=err.dtype, device=err.device)
        return -(torch.pow(err + eps, power) - torch.pow(eps, power)) * sigma / power
    raise ValueError(f"awm.weighting {weighting!r} is not one of uniform, t, t2, huber, ghuber")


def awm_advantages(advantages: Tensor, adv_clip_max: float, advantage_max: float) -> Tensor:
    """A clipped to ±adv_clip_max, rescaled to ±advantage_max (0: unscaled)."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return a * (advantage_max / adv_clip_max) if advantage_max > 0 else a


def awm_policy_loss(log_prob: Tensor, advantages: Tensor) -> Tensor:
    """mean(−A·exp(lp − sg(lp))): value −mean(A), gradient −A·∇lp / B."""
    return (-advantages * torch.exp(log_prob - log_prob.detach())).mean()


@register_algorithm("awm", options=AWMConfig, section="awm")
class AWM(OnPolicyMatching):
    name = "awm"
    summary = "Advantage Weighted Matching — ODE rollouts, the pretraining flow-matching loss on their clean samples weighted by the group advantage (section ``awm``)."

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.awm, self.grpo = cfg.awm, cfg.grpo
        self.uses_reference = cfg.awm.kl_beta > 0
        self.uses_old_policy = cfg.awm.ema_kl_beta > 0  # the lagging copy of the EMA term
        if not 0.0 <= cfg.awm.ema_decay_max < 1.0:
            raise ValueError(f"awm.ema_decay_max must be in [0, 1), got {cfg.awm.ema_decay_max}")
        self.lagging_decay = ("ema_decay", cfg.awm.ema_decay_rate, cfg.awm.ema_decay_max)
        r = cfg.rollout
        self.candidates = level_candidates(
            r.num_steps, run_schedule(cfg, schedule), cfg.awm.timestep_fraction
        )
        check_num_levels("awm", cfg.awm.num_levels, self.candidates)

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        return self.awm.num_levels * (1 + int(self.uses_reference) + int(self.uses_old_policy))

    def _regulariser(self, transformers, policy, x_t, sigma, chunk, v) -> Tensor:
        with torch.no_grad():
            v_other = velocity(transformers, policy, x_t, sigma, chunk)
        return velocity_gap(*trained_part(chunk, v.float(), v_other.float())).mean()

    def _level_loss(self, policy: Policy, chunk: MicroBatch, x0: Tensor, noise: Tensor, sigma, adv) -> tuple:
        a = self.awm
        x_t = noised(x0, noise, sigma)
        v = velocity(policy.transformers, policy, x_t, sigma, chunk)
        err = matching_error(*trained_part(chunk, v.float(), x0, noise))
        policy_loss = awm_policy_loss(awm_log_prob(err, sigma, a.weighting, a.ghuber_power), adv)
        zero = torch.zeros((), device=x0.device)
        kl = ema_kl = zero
        if self.uses_reference:
            with policy.reference() as reference:
                kl = self._regulariser(reference, policy, x_t, sigma, chunk, v)
        if self.uses_old_policy:
            ema_kl = self._regulariser(policy.old.transformers, policy, x_t, sigma, chunk, v)
        loss = policy_loss + a.kl_beta * kl + a.ema_kl_beta * ema_kl
        return loss, policy_loss, err.mean(), kl, ema_kl

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        a = self.awm
        samples = sum(c.rollout.final_latents.shape[0] for c in chunks)
        sigmas = step_levels(policy, batch, step_in_rollout, 11, self.candidates, a.num_levels)
        sums = dict.fromkeys(_METRICS, 0.0)
        for chunk in chunks:
            x0 = chunk.rollout.final_latents.float()
            ids = batch.sample_ids[chunk.slice].tolist()
            adv = awm_advantages(
                batch.advantages[chunk.slice].float(), self.grpo.adv_clip_max, a.advantage_max
            )
            weight = x0.shape[0] / (samples * a.num_levels)
            for j, sigma in enumerate(sigmas.to(x0.device)):
                noise = forward_noise(policy, ids, x0.shape[1:], 12, batch.rollout_index, j).to(x0.device)
                values = self._level_loss(policy, chunk, x0, noise, sigma, adv.to(x0.device))
                (values[0] * weight).backward()
                for key, value in zip(_METRICS, values):
                    sums[key] += float(value.detach()) * weight
        return sums
