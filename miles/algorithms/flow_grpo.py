"""Flow-GRPO (Liu et al. 2025): SDE rollouts with per-step log-probs, PPO's clipped ratio.

The rollout records the SDE steps ``sde_steps`` picks (the first ⌈fraction·T⌉ steps, or a
window drawn per rollout: flow_grpo's Fast/MixGRPO mode) with their log-probabilities under
the sampling policy. An optimizer step recomputes the log-probability of every stored step of
its micro-batches with the current weights and backpropagates the clipped-ratio loss
(``miles.grpo.losses``), optionally with β·KL to the reference policy, scaled so that the
step's gradient is the mean over its samples and SDE steps.
"""

from __future__ import annotations

import torch

from miles.algorithms import register_algorithm
from miles.algorithms.base import Algorithm, Policy
from miles.grpo.losses import grpo_policy_loss
from miles.rollout.sampler import compute_log_prob, sde_step_indices

_METRICS = ("loss", "policy_loss", "kl", "clipfrac", "approx_kl", "ratio")


@register_algorithm("flow_grpo")
class FlowGRPO(Algorithm):
    name = "flow_grpo"

    def __init__(self, cfg):
        self.rollout, self.grpo = cfg.rollout, cfg.grpo

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        r = self.rollout
        return sde_step_indices(
            num_steps,
            sde_window_size=r.sde_window_size or None,
            sde_window_start_range=tuple(r.sde_window_range) if r.sde_window_size else None,
            timestep_fraction=r.timestep_fraction,
            generator=generator,
        )

    def accumulate(self, policy: Policy, batch: dict, chunks: list[dict]) -> dict[str, float]:
        num_k = chunks[0]["rollout"].log_probs.shape[1]
        samples = sum(c["rollout"].log_probs.shape[0] for c in chunks)
        sums = dict.fromkeys(_METRICS, 0.0)
        canary = 0.0
        for chunk in chunks:
            ro = chunk["rollout"]
            adv = batch["advantages"][chunk["slice"]]
            weight = ro.log_probs.shape[0] / (samples * num_k)
            for k in range(num_k):
                log_prob, mean, std = compute_log_prob(
                    policy.transformers,
                    ro,
                    k,
                    prompt_embeds=chunk["pos"],
                    negative_embeds=chunk["neg"],
                    guidance_scales=policy.guidance_scales,
                    boundary_ratio=policy.boundary_ratio,
                    noise_level=self.rollout.noise_level,
                    expand_timesteps=policy.expand_timesteps,
                    sde_type=self.rollout.sde_type,
                )
                old = ro.log_probs[:, k].to(log_prob.device)
                ref_mean = policy.reference_mean(ro, k, chunk) if self.grpo.kl_beta > 0 else None
                out = grpo_policy_loss(
                    log_prob,
                    old,
                    adv,
                    self.grpo.clip_range,
                    beta=self.grpo.kl_beta,
                    mean=mean,
                    ref_mean=ref_mean,
                    std=std,
                )
                (out.loss * weight).backward()
                canary += (log_prob.detach() - old).abs().mean().item() * weight
                values = (out.loss, out.policy_loss, out.kl, out.clipfrac, out.approx_kl, out.ratio_mean)
                for key, value in zip(_METRICS, values):
                    sums[key] += float(value.detach()) * weight
        return {**sums, "log_prob_mean_abs_diff": canary}
