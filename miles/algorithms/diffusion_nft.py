"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): online RL on the forward process.

Rollouts are plain samples of the *old* policy (ODE by default: no SDE steps, no log-probs,
any solver); only their clean latents x0 and rewards are kept. Each reward becomes an
optimality probability r = clip(A/(2·A_max) + 1/2, 0, 1) from its group-normalised advantage
A (clipped at A_max = ``grpo.adv_clip_max``). Training noises x0 along the forward path,
x_σ = (1 − σ)·x0 + σ·ε, at ⌊fraction·T⌋ of the rollout's T denoising levels, and fits the
conditional velocity (CFG-free) with the implicit positive and negative policies

    v⁺ = β·v_θ + (1 − β)·v_old,        v⁻ = (1 + β)·v_old − β·v_θ
    x̂0± = x_σ − σ·v±,                  ℓ± = mean((x̂0± − x0)²) / sg(mean|x̂0± − x0|)
    loss = A_max · mean_samples( (r·ℓ⁺ + (1 − r)·ℓ⁻) / β )  [+ κ·mean((v_θ − v_ref)²)]

(the x0-space loss with its adaptive weight, as the reference implementation forms it). After a
rollout's optimizer steps the old policy moves towards the trained weights,
θ_old ← d·θ_old + (1 − d)·θ, with d = min(rate·max(step − flat, 0), d_max) (0 before ``flat``):
the reference's ``decay_type`` schedules are (flat, rate, d_max) = (0, 0, 0), (0, 0.001, 0.5),
(75, 0.0075, 0.999). The old policy samples the rollouts.

Layout independence: the forward-process noise of a sample is drawn from a generator keyed by
its global index. The noise levels are drawn once per optimizer step (keyed by the rollout and
the step's index in it) and shared by every micro-batch of the step on every rank: with two
experts the level decides which expert runs a pass, so every rank must run the same expert at
the same pass for FSDP's collectives to pair up (levels drawn per micro-batch let ranks all-gather
different experts' shards into one another: a silent, dp-dependent error).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from miles.algorithms.base import Algorithm, Policy, run_schedule
from miles.algorithms.registry import register_algorithm
from miles.config_load import MAX_STEPS
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.condition import generated
from miles.rollout.sampler import NUM_TRAIN_TIMESTEPS, flow_sigmas, predict_velocity
from miles.rollout.schedule import FlowSchedule

_METRICS = ("loss", "policy_loss", "positive_loss", "negative_loss", "old_deviation", "kl")


@dataclasses.dataclass(kw_only=True)
class NFTConfig:
    """``nft``: DiffusionNFT's loss and its old policy."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "beta": ("(0, 100]", "the reference uses 1.0"),
        "timestep_fraction": ("(0, 1]", ""),
        "old_decay_rate": ("[0, 1]", ""),
        "old_decay_max": ("[0, 1)", ""),
        "old_decay_flat": (f"[0, {MAX_STEPS}]", ""),
        "kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    beta: float = 1.0
    """DiffusionNFT's beta: the implicit policies are v+ = beta*v + (1-beta)*v_old and
    v- = (1+beta)*v_old - beta*v (the reference uses 1.0, and 0.1 for OCR)."""
    timestep_fraction: float = 0.99
    """Train on floor(fraction * rollout.num_steps) of the rollout's noise levels per micro-batch,
    drawn without replacement (the reference: 0.99, i.e. 9 of 10)."""
    old_decay_rate: float = 0.001
    """Old-policy soft update: decay = min(rate * (step - flat), max) after each rollout, 0 before
    ``old_decay_flat`` steps (the reference's decay_type 1: 0.001, 0.5, 0; type 2: 0.0075, 0.999, 75)."""
    old_decay_max: float = 0.5
    """Old-policy soft update: the largest decay (``old_decay_rate``'s cap)."""
    old_decay_flat: int = 0
    """Old-policy soft update: steps before the decay starts (until then the decay is 0: the old
    policy is set to the trained one after each rollout)."""
    kl_beta: float = 0.0
    """β, the weight of the penalty β·mean((v − v_ref)²) on the velocity's distance to the reference
    (initial) policy's; 0 turns it off (the DiffusionNFT reference uses 1e-4 with LoRA)."""


def optimality(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """r = clip(clip(A, ±A_max)/(2·A_max) + 1/2, 0, 1): the group advantage as a probability."""
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _x0_loss(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """Per-sample mean squared x0 error over its detached mean absolute error (≥ 1e-5)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        scale = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return ((x0_pred - x0) ** 2 / scale).mean(dim=dims)


def nft_loss(
    v: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, sigma: float | Tensor, r: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, ℓ⁺, ℓ⁻), each (B,): the per-sample DiffusionNFT loss (r·ℓ⁺ + (1 − r)·ℓ⁻)/β
    before the A_max scale. ``v`` carries the gradient; ``v_old`` is detached here."""
    v, v_old = v.float(), v_old.detach().float()
    positive = beta * v + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v
    pos = _x0_loss(x_t - sigma * positive, x0)
    neg = _x0_loss(x_t - sigma * negative, x0)
    return (r * pos + (1.0 - r) * neg) / beta, pos, neg


def old_decay(step: int, rate: float, max_decay: float, flat: int) -> float:
    """The old policy's soft-update decay after ``step`` optimizer steps (module docstring)."""
    return 0.0 if step < flat else min((step - flat) * rate, max_decay)


@register_algorithm("diffusion_nft", options=NFTConfig, section="nft")
class DiffusionNFT(Algorithm):
    name = "diffusion_nft"
    summary = "ODE rollouts of an old policy and the forward-process loss on their clean samples, CFG-free (section ``nft``; advantages from ``grpo``)."
    uses_old_policy = True

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.nft, self.rollout, self.grpo = cfg.nft, cfg.rollout, cfg.grpo
        self.uses_reference = cfg.nft.kl_beta > 0
        T = cfg.rollout.num_steps
        self.sigmas = flow_sigmas(T, run_schedule(cfg, schedule))[:T]  # the T noise levels of the rollout
        self.num_levels = max(1, int(self.nft.timestep_fraction * T))

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        return []  # ODE rollouts: nothing but the clean samples is recorded

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        return self.num_levels * (3 if self.nft.kl_beta > 0 else 2)

    def after_rollout(self, policy: Policy, step: int) -> dict[str, float]:
        n = self.nft
        decay = old_decay(step, n.old_decay_rate, n.old_decay_max, n.old_decay_flat)
        policy.old.soft_update(decay)
        return {"old_decay": decay}

    def _velocity(self, transformers, policy: Policy, x: Tensor, sigma: Tensor, chunk: MicroBatch) -> Tensor:
        return predict_velocity(
            transformers,
            x,
            sigma * NUM_TRAIN_TIMESTEPS,
            chunk.pos,
            None,  # CFG-free: the conditional velocity is the policy
            policy.guidance_scales,
            policy.routing,
            chunk.condition,
        )

    def _draws(
        self, policy: Policy, batch: RolloutBatch, chunk: MicroBatch, x0: Tensor, step_in_rollout: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        """The step's noise levels (the same on every rank) and, per level, the micro-batch's
        forward-process noise (fp32)."""
        ids = batch.sample_ids[chunk.slice].tolist()
        rollout = batch.rollout_index
        pick = torch.randperm(len(self.sigmas), generator=policy.generator(5, rollout, step_in_rollout))
        gens = [policy.generator(6, rollout, i) for i in ids]
        noise = [
            torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]).to(x0.device)
            for _ in range(self.num_levels)
        ]
        return self.sigmas[pick[: self.num_levels]].to(x0.device), noise

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        n, a_max = self.nft, self.grpo.adv_clip_max
        samples = sum(c.rollout.final_latents.shape[0] for c in chunks)
        sums = dict.fromkeys(_METRICS, 0.0)
        for chunk in chunks:
            x0 = chunk.rollout.final_latents.float()
            r = optimality(batch.advantages[chunk.slice], a_max).to(x0.device)
            weight = x0.shape[0] / (samples * self.num_levels)
            sigmas, noises = self._draws(policy, batch, chunk, x0, step_in_rollout)
            for sigma, noise in zip(sigmas, noises):
                x_t = (1.0 - sigma) * x0 + sigma * noise
                with torch.no_grad():
                    v_old = self._velocity(policy.old.transformers, policy, x_t, sigma, chunk)
                v = self._velocity(policy.transformers, policy, x_t, sigma, chunk)
                # a first-frame image condition's frame is clean: no loss on it
                trained = generated(chunk.condition, v, v_old, x_t, x0)
                per_sample, pos, neg = nft_loss(*trained, sigma, r, n.beta)
                policy_loss = a_max * per_sample.mean()
                kl = torch.zeros((), device=x0.device)
                if n.kl_beta > 0:
                    with torch.no_grad(), policy.reference() as reference:
                        v_ref = self._velocity(reference, policy, x_t, sigma, chunk)
                    v_gen, v_ref = generated(chunk.condition, v, v_ref)
                    kl = ((v_gen.float() - v_ref.float()) ** 2).mean()
                loss = policy_loss + n.kl_beta * kl
                (loss * weight).backward()
                values = (
                    loss,
                    policy_loss,
                    pos.mean(),
                    neg.mean(),
                    ((trained[0] - trained[1]) ** 2).mean(),
                    kl,
                )
                for key, value in zip(_METRICS, values):
                    sums[key] += float(value.detach()) * weight
        return sums
