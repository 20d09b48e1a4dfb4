"""Online Diffusion-DPO (Wallace et al. 2023 on pairs of each group's rollouts, as flow_grpo's
``train_sd3_dpo.py`` and verl-omni train it): preference pairs from ODE rollouts, no log-probs.

Rollouts are ODE samples of the trained policy; only the clean latents x0 and the rewards are
kept. Within each group's samples of an optimizer step, pairs (winner w, loser l) are chosen by
advantage (``dpo.pairs``): ``best_worst`` the highest against the lowest, ``margin`` every
ordered pair; either keeps a pair only if its rewards differ by more than ``dpo.reward_margin``
(negated advantages, the negative control, swap winner and loser). At each of ``dpo.num_levels``
levels σ both members are noised with the same noise ε (a group shares it) and, with
e = mean((v − (ε − x0))²) under the trained and the reference policy,

    z = −β/2 · ((e_w − e_ref,w) − (e_l − e_ref,l)),      loss_pair = −log σ(z)

averaged over a group's pairs, then over the step's groups (a group without a pair adds 0), then
over the levels. The reference is the initial policy (``dpo.ref_update_every: 0``) or the trained
weights copied every N rollouts (online DPO, flow_grpo's ``ref_update_step``). Training is
CFG-free.

A pair's members may sit in different micro-batches: a no-grad pass computes every error of the
step, then the gradient pass backpropagates Σ_i c_i·e_i with c = ∂loss/∂e
(``miles.algorithms.matching``). Departures from flow_grpo: the levels come from the rollout's
grid (the same for every sample, needed to route experts) instead of a logit-normal draw per
pair; pairs stay within a rank's optimizer step (the whole group at ``train.steps_per_rollout: 1``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.algorithms.base import Algorithm, Policy, run_schedule
from miles.algorithms.matching import (
    check_group_per_step,
    check_num_levels,
    forward_noise,
    level_candidates,
    matching_error,
    noised,
    step_levels,
    trained_part,
    velocity,
)
from miles.algorithms.registry import register_algorithm
from miles.config_load import MAX_STEPS
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.schedule import FlowSchedule

_METRICS = ("loss", "implicit_accuracy", "pairs_per_group", "matching_loss", "reference_matching_loss")


@dataclasses.dataclass(kw_only=True)
class DPOConfig:
    """``dpo``: online Diffusion-DPO's pairs, loss and reference."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "beta": ("(0, 1e6]", "flow_grpo's SD3 recipe uses 100"),
        "reward_margin": ("[0, 1e6]", ""),
        "num_levels": ("[1, 1000]", ""),
        "timestep_fraction": ("(0, 1]", ""),
        "ref_update_every": (f"[0, {MAX_STEPS}]", "0 keeps the initial weights as the reference"),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    beta: float = 100.0
    """β of Diffusion-DPO: loss −log σ(−β/2 · ((e_w − e_w,ref) − (e_l − e_l,ref))) per pair and level
    (flow_grpo's SD3 recipe: 100)."""
    pairs: Literal["best_worst", "margin"] = "best_worst"
    """Pair selection within each group's samples of an optimizer step: ``best_worst`` (the highest
    against the lowest advantage, flow_grpo's online DPO), or ``margin``: every pair whose rewards
    differ by more than ``reward_margin``."""
    reward_margin: float = 0.0
    """A pair is trained only if its two rewards differ by more than this (both pair modes)."""
    num_levels: int = 4
    """Noise levels trained per optimizer step, the same for every sample; both members of a pair are
    noised with the same noise."""
    timestep_fraction: float = 0.9
    """The levels are drawn without replacement from the first floor(fraction * rollout.num_steps) of
    the rollout's noise levels."""
    ref_update_every: int = 0
    """The reference policy: 0 keeps the initial weights (offline-style DPO); N > 0 sets it to the
    trained weights every N rollouts (flow_grpo's ``ref_update_step``: online DPO)."""


def select_pairs(adv: Tensor, rewards: Tensor, group_ids: Tensor, mode: str, margin: float) -> list[list]:
    """Per group (in order of first appearance), its (winner, loser) index pairs into the step's samples."""
    out = []
    for g in dict.fromkeys(group_ids.tolist()):
        idx = (group_ids == g).nonzero().flatten().tolist()
        if mode == "best_worst":
            candidates = [(max(idx, key=lambda i: adv[i]), min(idx, key=lambda i: adv[i]))]
        elif mode == "margin":
            candidates = [(i, j) for i in idx for j in idx if i != j]
        else:
            raise ValueError(f"dpo.pairs {mode!r} is not one of best_worst, margin")
        out.append(
            [(i, j) for i, j in candidates if adv[i] > adv[j] and abs(rewards[i] - rewards[j]) > margin]
        )
    return out


def dpo_coefficients(
    err: Tensor, err_ref: Tensor, pairs: list[list], beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(c, loss, z): loss = mean_groups mean_pairs −log σ(z), its gradient Σ_i c_i·∇e_i; z per pair."""
    delta = (err - err_ref).detach()
    coef = torch.zeros_like(delta)
    loss = torch.zeros((), dtype=delta.dtype, device=delta.device)
    zs = []
    for group in pairs:
        if not group:
            continue
        win = torch.tensor([p[0] for p in group], device=delta.device)
        lose = torch.tensor([p[1] for p in group], device=delta.device)
        z = -0.5 * beta * (delta[win] - delta[lose])
        scale = 1.0 / (len(pairs) * len(group))
        loss = loss + F.softplus(-z).sum() * scale  # −log σ(z)
        grad = 0.5 * beta * torch.sigmoid(-z) * scale  # ∂loss/∂e_w; ∂loss/∂e_l is its negative
        coef.index_add_(0, win, grad).index_add_(0, lose, -grad)
        zs.append(z)
    return coef, loss, torch.cat(zs) if zs else delta.new_zeros(0)


@register_algorithm("online_dpo", options=DPOConfig, section="dpo")
class OnlineDPO(Algorithm):
    name = "online_dpo"
    summary = "Diffusion-DPO on pairs drawn from each group of ODE rollouts (section ``dpo``)."

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.dpo, self.steps_per_rollout = cfg.dpo, cfg.train.steps_per_rollout
        self.uses_old_policy = cfg.dpo.ref_update_every > 0  # the periodically copied reference
        self.uses_reference = not self.uses_old_policy
        r = cfg.rollout
        self.candidates = level_candidates(
            r.num_steps, run_schedule(cfg, schedule), cfg.dpo.timestep_fraction
        )
        check_group_per_step("online_dpo", cfg)
        check_num_levels("dpo", cfg.dpo.num_levels, self.candidates)

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        return []  # ODE rollouts: only the clean samples are recorded

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        return self.dpo.num_levels * 3  # policy (no grad, then with grad) and reference

    def rollout_transformers(self, policy: Policy):
        return policy.transformers  # on-policy: the copy is the reference

    def after_rollout(self, policy: Policy, step: int) -> dict[str, float]:
        if not self.uses_old_policy:
            return {}
        update = (step // self.steps_per_rollout) % self.dpo.ref_update_every == 0
        if update:
            policy.old.soft_update(0.0)
        return {"reference_updated": float(update)}

    @torch.no_grad()
    def _errors(
        self, policy: Policy, chunk: MicroBatch, x0: Tensor, noise: Tensor, sigma
    ) -> tuple[Tensor, Tensor]:
        x_t = noised(x0, noise, sigma)
        x0_g, noise_g = trained_part(chunk, x0, noise)
        v = velocity(policy.transformers, policy, x_t, sigma, chunk)
        if self.uses_old_policy:
            v_ref = velocity(policy.old.transformers, policy, x_t, sigma, chunk)
        else:
            with policy.reference() as reference:
                v_ref = velocity(reference, policy, x_t, sigma, chunk)
        v, v_ref = trained_part(chunk, v.float(), v_ref.float())
        return matching_error(v, x0_g, noise_g), matching_error(v_ref, x0_g, noise_g)

    def _pairs(self, batch: RolloutBatch, chunks: list[MicroBatch]) -> list[list]:
        """The step's pairs; the margin is on the trained rewards scoring sets on the batch
        (``batch.rewards``; without them only the advantages' order counts, and a margin is refused)."""
        d = self.dpo
        cat = lambda values: torch.cat([values[c.slice].cpu() for c in chunks])  # noqa: E731
        if batch.rewards is None and d.reward_margin > 0:
            raise ValueError(
                "dpo.reward_margin needs the rollout's rewards (RolloutBatch.rewards, set by scoring)"
            )
        adv = cat(batch.advantages).float()
        rewards = cat(batch.rewards).float() if batch.rewards is not None else adv
        return select_pairs(adv, rewards, cat(batch.group_ids), d.pairs, d.reward_margin)

    def _noise(
        self, policy: Policy, batch: RolloutBatch, chunk: MicroBatch, x0: Tensor, level: int
    ) -> Tensor:
        """A group's samples share the level's noise, so a pair's members see the same ε."""
        keys = batch.group_ids[chunk.slice].tolist()
        return forward_noise(policy, keys, x0.shape[1:], 16, batch.rollout_index, level).to(x0.device)

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        d = self.dpo
        pairs = self._pairs(batch, chunks)
        sigmas = step_levels(policy, batch, step_in_rollout, 15, self.candidates, d.num_levels)
        sums = dict.fromkeys(_METRICS, 0.0)
        sums["pairs_per_group"] = sum(len(p) for p in pairs) / len(pairs)
        x0s = [c.rollout.final_latents.float() for c in chunks]
        for level, sigma in enumerate(sigmas):
            noises = [self._noise(policy, batch, c, x0, level) for c, x0 in zip(chunks, x0s)]
            errs = [self._errors(policy, c, x0, n, sigma) for c, x0, n in zip(chunks, x0s, noises)]
            err, err_ref = (torch.cat([e[k] for e in errs]) for k in (0, 1))
            coef, loss, z = dpo_coefficients(err, err_ref, pairs, d.beta)
            start = 0
            for chunk, x0, noise in zip(chunks, x0s, noises):
                b = x0.shape[0]
                v = velocity(policy.transformers, policy, noised(x0, noise, sigma), sigma, chunk)
                e = matching_error(*trained_part(chunk, v.float(), x0, noise))
                ((coef[start : start + b] * e).sum() / d.num_levels).backward()
                start += b
            sums["loss"] += float(loss) / d.num_levels
            sums["implicit_accuracy"] += float((z > 0).float().mean()) / d.num_levels if len(z) else 0.0
            sums["matching_loss"] += float(err.mean()) / d.num_levels
            sums["reference_matching_loss"] += float(err_ref.mean()) / d.num_levels
        return sums
