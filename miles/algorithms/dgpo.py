"""Direct Group Preference Optimization (Luo et al. 2025, ICLR 2026): group preferences from ODE
rollouts, no log-probs.

Rollouts are ODE samples of the trained policy; only the clean latents x0 and the rewards are
kept. At each of ``dgpo.num_levels`` levels σ (drawn per optimizer step from the first
``timestep_fraction`` of the rollout's grid, the same for every sample) the samples are noised,
each group's with one shared noise ε (``shared_noise``), and each sample's flow-matching error
e_i = mean((v_θ − (ε − x0_i))²) is compared with the reference's e_ref,i. A group's preference
weight is

    w_g = sigmoid(β_dpo · Σ_{i∈g} A_i (e_i − e_ref,i) / n_g)      (detached; n_g its samples in the step)

and the loss of a level is mean_i(w_g · A_i · e_i) + kl_beta · mean((v_θ − v_ref)²): the gradient
of the group-level Bradley–Terry objective between the group's better and worse halves. The
reference velocity v_ref is the frozen initial policy's, with CFG at ``reference_guidance_scale``
(> 1: the fully CFG-free mode, where rollouts use guidance 1 and the trained conditional branch
learns towards the guided reference); ``ema_reference`` compares the preference against a
lagging copy instead. With ``clip_range`` > 0 a sample whose ratio exp(e_old − e) to the lagging
copy leaves [1 − c, 1 + c] on its advantage's side carries no gradient (the reference's clip).
Training is CFG-free; "rollout with CFG, train without" is rollout.guidance_scale > 1 with
reference_guidance_scale 1.

w_g couples a group's samples, which may sit in different micro-batches: a no-grad pass computes
every error of the step first (``miles.algorithms.matching``). Departure from the reference: n_g
counts the group's samples in this optimizer step (the reference divides by the nominal group size;
the same when a step holds whole groups, ``train.steps_per_rollout: 1``), and the lagging copy moves
once per rollout rather than per optimizer step (the same at one step per rollout).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from miles.algorithms.base import Policy, run_schedule
from miles.algorithms.matching import (
    OnPolicyMatching,
    check_group_per_step,
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

_METRICS = ("loss", "policy_loss", "matching_loss", "kl", "group_weight", "clipfrac")


@dataclasses.dataclass(kw_only=True)
class DGPOConfig:
    """``dgpo``: Direct Group Preference Optimization's loss and its lagging copy."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_levels": ("[1, 1000]", ""),
        "timestep_fraction": ("(0, 1]", ""),
        "beta_dpo": ("(0, 1e6]", "the reference uses 10-100, 2000-5000 with ema_reference"),
        "kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
        "reference_guidance_scale": ("[1, 100]", "1: the reference without CFG"),
        "clip_range": ("[0, 100]", "0 turns the clip off"),
        "old_decay_rate": ("[0, 1]", ""),
        "old_decay_max": ("[0, 1)", ""),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    num_levels: int = 4
    """Noise levels trained per optimizer step, the same for every sample (the reference's
    ``num_train_timesteps``)."""
    timestep_fraction: float = 0.7
    """The levels are drawn without replacement from the first floor(fraction * rollout.num_steps) of
    the rollout's noise levels (the reference's ``trunc_steps`` 6 of 10 steps: 0.7)."""
    beta_dpo: float = 100.0
    """β of the group preference: each group's weight is sigmoid(β · Σ_i A_i (e_i − e_ref,i) / n)
    over its n samples in the step (the reference: 10–100; 2000–5000 with ``ema_reference``)."""
    kl_beta: float = 1e-3
    """The weight of mean((v − v_ref)²) to the reference policy (the reference's ``train.beta``); 0:
    off."""
    reference_guidance_scale: float = 1.0
    """CFG scale of the frozen reference's velocity (the reference's ``kl_cfg``). 1: no CFG (the
    "rollout with CFG, train without" mode, rollout.guidance_scale > 1); > 1 (e.g. 4.5) with
    rollout.guidance_scale 1 is the fully CFG-free mode: the trained conditional branch is pulled to
    the reference's guided velocity."""
    clip_range: float = 1e-3
    """PPO-style clip on the matching term: a sample whose ratio exp(e_old − e) leaves [1 − c, 1 + c]
    on its advantage's side is not trained (the reference's ``clip_dsm``); 0 turns the clip off and
    keeps no lagging copy (unless ``ema_reference``)."""
    ema_reference: bool = False
    """The preference compares against the lagging copy instead of the frozen reference (the
    reference's ``use_ema_ref``, TDM-R1)."""
    shared_noise: bool = True
    """All samples of a group are noised with the same forward-process noise at a level."""
    old_decay_rate: float = 0.001
    """The lagging copy moves towards the trained weights after each rollout with decay
    min(rate · step, old_decay_max) (the reference: 0.001, 0.3)."""
    old_decay_max: float = 0.3
    """The lagging copy's largest decay."""


def group_weights(err: Tensor, err_ref: Tensor, adv: Tensor, group_ids: Tensor, beta: float) -> Tensor:
    """(B,) sigmoid(β · Σ_{j∈g(i)} A_j (e_j − e_ref,j) / n_g) for each sample i, detached."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    term = adv * beta * (err - err_ref).detach() / counts[inverse].to(err.dtype)
    sums = torch.zeros(len(counts), dtype=err.dtype, device=err.device).scatter_add_(0, inverse, term)
    return torch.sigmoid(sums)[inverse]


def clipped(err: Tensor, err_old: Tensor, adv: Tensor, clip_range: float) -> Tensor:
    """(B,) bool: ratio exp(e_old − e) beyond 1 + c for a positive advantage, below 1 − c otherwise."""
    ratio = torch.exp(err_old - err).detach()
    return torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_coefficients(
    err: Tensor,
    err_ref: Tensor,
    adv: Tensor,
    group_ids: Tensor,
    beta: float,
    err_old: Tensor | None = None,
    clip_range: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(c, w, clip): the loss mean_i(w_i·A_i·e_i) has gradient Σ_i c_i·∇e_i; clipped samples get c = 0."""
    w = group_weights(err, err_ref, adv, group_ids, beta)
    clip = torch.zeros_like(adv, dtype=torch.bool)
    if err_old is not None and clip_range > 0:
        clip = clipped(err, err_old, adv, clip_range)
    coef = torch.where(clip, torch.zeros_like(adv), w * adv / len(adv))
    return coef, w, clip


@register_algorithm("dgpo", options=DGPOConfig, section="dgpo")
class DGPO(OnPolicyMatching):
    name = "dgpo"
    summary = "Direct Group Preference Optimization — ODE rollouts, a group-level preference loss on the flow-matching errors (section ``dgpo``)."

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.dgpo, self.grpo = cfg.dgpo, cfg.grpo
        d = cfg.dgpo
        self.uses_old_policy = d.clip_range > 0 or d.ema_reference
        self.uses_reference = d.kl_beta > 0 or not d.ema_reference
        if not 0.0 <= d.old_decay_max < 1.0:
            raise ValueError(f"dgpo.old_decay_max must be in [0, 1), got {d.old_decay_max}")
        self.lagging_decay = ("old_decay", d.old_decay_rate, d.old_decay_max)
        r = cfg.rollout
        self.candidates = level_candidates(r.num_steps, run_schedule(cfg, schedule), d.timestep_fraction)
        check_group_per_step("dgpo", cfg)
        check_num_levels("dgpo", d.num_levels, self.candidates)

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        ref = (2 if self.dgpo.reference_guidance_scale > 1 else 1) if self.uses_reference else 0
        return self.dgpo.num_levels * (2 + ref + int(self.uses_old_policy))

    @torch.no_grad()
    def _errors(self, policy: Policy, chunk: MicroBatch, x0: Tensor, noise: Tensor, sigma) -> dict:
        """The no-grad pass of one micro-batch: e, e_ref, e_old and v_ref (generated parts, fp32)."""
        x_t = noised(x0, noise, sigma)
        out = {}
        x0_g, noise_g = trained_part(chunk, x0, noise)
        v = velocity(policy.transformers, policy, x_t, sigma, chunk)
        out["err"] = matching_error(trained_part(chunk, v.float())[0], x0_g, noise_g)
        if self.uses_reference:
            with policy.reference() as reference:
                v_ref = velocity(reference, policy, x_t, sigma, chunk, self.dgpo.reference_guidance_scale)
            out["v_ref"] = trained_part(chunk, v_ref.float())[0]
            out["err_ref"] = matching_error(out["v_ref"], x0_g, noise_g)
        if self.uses_old_policy:
            v_old = velocity(policy.old.transformers, policy, x_t, sigma, chunk)
            out["err_old"] = matching_error(trained_part(chunk, v_old.float())[0], x0_g, noise_g)
        return out

    def _noise(
        self, policy: Policy, batch: RolloutBatch, chunk: MicroBatch, x0: Tensor, level: int
    ) -> Tensor:
        ids = batch.group_ids if self.dgpo.shared_noise else batch.sample_ids
        keys = ids[chunk.slice].tolist()
        return forward_noise(policy, keys, x0.shape[1:], 13, batch.rollout_index, level).to(x0.device)

    def _level(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], sigma, level: int
    ) -> dict:
        """One level's two passes over the step's micro-batches; returns its metrics."""
        d = self.dgpo
        x0s = [c.rollout.final_latents.float() for c in chunks]
        noises = [self._noise(policy, batch, c, x0, level) for c, x0 in zip(chunks, x0s)]
        passes = [self._errors(policy, c, x0, n, sigma) for c, x0, n in zip(chunks, x0s, noises)]
        cat = {k: torch.cat([p[k] for p in passes]) for k in passes[0] if k != "v_ref"}
        adv = torch.cat([batch.advantages[c.slice] for c in chunks]).float().to(x0s[0].device)
        gids = torch.cat([batch.group_ids[c.slice] for c in chunks]).to(adv.device)
        pref = cat["err_old"] if d.ema_reference else cat["err_ref"]
        coef, w, clip = dgpo_coefficients(
            cat["err"], pref, adv, gids, d.beta_dpo, cat.get("err_old"), d.clip_range
        )
        n, start, kl_sum = len(adv), 0, 0.0
        for chunk, x0, noise, cached in zip(chunks, x0s, noises, passes):
            b = x0.shape[0]
            v = velocity(policy.transformers, policy, noised(x0, noise, sigma), sigma, chunk)
            v_g, x0_g, noise_g = trained_part(chunk, v.float(), x0, noise)
            loss = (coef[start : start + b] * matching_error(v_g, x0_g, noise_g)).sum()
            if d.kl_beta > 0:
                kl = velocity_gap(v_g, cached["v_ref"]).sum() / n
                loss = loss + d.kl_beta * kl
                kl_sum += float(kl.detach())
            (loss / d.num_levels).backward()
            start += b
        policy_loss = float((w * adv * cat["err"]).mean())
        return {
            "loss": policy_loss + d.kl_beta * kl_sum,
            "policy_loss": policy_loss,
            "matching_loss": float(cat["err"].mean()),
            "kl": kl_sum,
            "group_weight": float(w.mean()),
            "clipfrac": float(clip.float().mean()),
        }

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        sigmas = step_levels(policy, batch, step_in_rollout, 14, self.candidates, self.dgpo.num_levels)
        sums = dict.fromkeys(_METRICS, 0.0)
        for level, sigma in enumerate(sigmas):
            for key, value in self._level(policy, batch, chunks, sigma, level).items():
                sums[key] += value / self.dgpo.num_levels
        return sums
