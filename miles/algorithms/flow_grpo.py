"""Flow-GRPO (Liu et al. 2025): SDE rollouts with per-step log-probs, PPO's clipped ratio.

The rollout records the SDE steps ``sde_steps`` picks (the first ⌈fraction·T⌉ steps, ⌊fraction·T⌋
with ``rollout.sde_type: flow_grpo_wan``, or a window drawn per rollout: flow_grpo's Fast/MixGRPO
mode) with their log-probabilities under
the sampling policy. An optimizer step recomputes the log-probability of every stored step of
its micro-batches with the current weights and backpropagates the clipped-ratio loss
(``miles.grpo.losses``), optionally with β·KL to the reference policy, scaled so that the
step's gradient is the mean over its samples and SDE steps. ``grpo.step_loss_weight:
sigma_over_sqrt_dt`` weights each SDE step's policy term by σ_t/√|dt|, σ_t the chosen SDE's noise
scale; with ``rollout.sde_type: flow_grpo_wan`` that is exactly flow_grpo's Wan-script weight
(σ_t = sigmas[1]·σ: 4.5 … 0.5 over 8 steps at shift 3), with ``sde`` it is that weight put on the
SD3 noise a·√(σ/(1−σ)) (15.4 … 0.8 at a = 0.7), which no flow_grpo script uses. Default ``none``:
every step weighs the same, as in flow_grpo's SD3 script and the paper.
``grpo.train_cfg: false`` trains the conditional branch alone (flow_grpo's ``train.cfg``): the
recomputed log-probs, and the reference's, use no CFG whatever the rollout used.

``grpo_guard`` (GRPO-Guard, Wang et al. 2025, arXiv 2510.22319) is Flow-GRPO with its two
changes: the normalised ratio (``miles.grpo.losses``; the rollout records each step's mean for
it) and the per-step gradient reweighting 1/|dt| of its paper and of verl-omni's
``GRPOGuardLoss``. Sampling is unchanged.

FP8 rollouts (``rollout.precision: fp8``): the ratio's old log-probs are the bf16 policy's, and each
sample-step is weighted by the truncated importance weight against the FP8 rollout's
(``miles.algorithms.rollout_correction``, ``miles.grpo.tis``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import torch

from miles.algorithms.base import Algorithm, Policy
from miles.algorithms.clip_calibration import calibrated_clip
from miles.algorithms.registry import register_algorithm
from miles.algorithms.rollout_correction import RolloutCorrection
from miles.console import rank
from miles.grpo.losses import grpo_policy_loss, policy_log_ratio
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.sampler import compute_log_prob, sde_step_indices
from miles.rollout.schedule import FlowSchedule
from miles.rollout.sde import sde_std_dev, wan_sde_std_dev

_METRICS = ("loss", "policy_loss", "kl", "clipfrac", "approx_kl", "ratio")


@dataclasses.dataclass(kw_only=True)
class GRPOConfig:
    """``grpo``: Flow-GRPO's loss, and the group advantages that every algorithm trained on rewards reads."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "clip_range": ("(0, 100]", "Flow-GRPO uses 1e-4; or auto"),
        "target_clipfrac": ("(0, 1)", "the clipped fraction clip_range auto aims at"),
        "calibration_rollouts": ("[1, 1000]", "rollouts whose second step clip_range auto is measured on"),
        "adv_clip_max": ("(0, 1000]", ""),
        "kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    clip_range: float | Literal["auto"] = 1e-4
    """PPO ratio clip epsilon (Flow-GRPO uses 1e-4: per-step log-probs are averaged over many dims).
    ``auto``: measured before the second optimizer step of the first ``calibration_rollouts`` rollouts
    (the policy has moved once since the rollout), as the clip that ``target_clipfrac`` of them exceed;
    logged as ``train/clip_range`` and saved with the checkpoint (miles/algorithms/clip_calibration.py)."""
    target_clipfrac: float = 0.2
    """With ``clip_range: auto``: the fraction of ratios the calibrated clip range leaves outside 1 ± clip."""
    calibration_rollouts: int = 3
    """With ``clip_range: auto``: measured again before the second step of each of the first N rollouts,
    the last measurement kept (the first update after the initial weights is the largest: on the world
    its ratio spread is ~3x the later ones')."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]."""
    global_std: bool = False
    """Normalise advantages by the std over all samples instead of per group."""
    kl_beta: float = 0.0
    """β, the weight of the KL penalty to the reference (initial) policy: loss = policy loss +
    β·KL, KL the exact KL between the current and the reference policy's Gaussian SDE steps,
    mean((μ − μ_ref)²) / (2σ_t²|dt|) per latent element, averaged over the trained steps (as
    flow_grpo's Wan script computes it). flow_grpo's SD3 script divides by 2σ_t² (no |dt|): its β
    is this β / |dt|. 0 turns it off."""
    step_loss_weight: Literal["none", "sigma_over_sqrt_dt"] = "none"
    """Per-SDE-step weight of the policy loss: ``none`` (every step alike, the paper's and flow_grpo's
    SD3 script), or ``sigma_over_sqrt_dt``: sigma_t / sqrt(|dt|) with sigma_t the chosen SDE's noise
    scale. With rollout.sde_type flow_grpo_wan this is flow_grpo's Wan-script weight exactly; with
    ``sde`` it puts that form on the SD3 noise (no flow_grpo script does). ``grpo_guard`` weights by
    1/|dt| itself (leave this ``none``)."""
    train_cfg: bool = True
    """Recompute the log-probs with the rollout's CFG (true), or from the conditional branch alone
    (false: no-CFG training, flow_grpo's ``train.cfg``; roll out with guidance_scale 1 to stay on-policy)."""
    negate_advantages: bool = False
    """Negative control for learning benchmarks: train on the negated advantages (a run that must
    not improve its reward)."""


@register_algorithm("flow_grpo", options=GRPOConfig, section="grpo")
class FlowGRPO(Algorithm):
    name = "flow_grpo"
    summary = "SDE rollouts with per-step log-probs and the clipped-ratio loss (section ``grpo``)."
    ratio_norm = False
    trains_clipped_ratio = True

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.rollout, self.grpo = cfg.rollout, cfg.grpo
        self.uses_reference = cfg.grpo.kl_beta > 0
        self.kl_beta = cfg.grpo.kl_beta  # train.guard kl raises it (scale_kl)
        # grpo.clip_range auto: None until measured before the first rollout's second step
        self.clip_range = None if cfg.grpo.clip_range == "auto" else float(cfg.grpo.clip_range)
        # rollout.precision fp8 or a low-precision rollout attention: bf16 old log-probs and truncated
        # importance weights (docs/fp8_rollout.md)
        self.correction = (
            RolloutCorrection(cfg.rollout.tis_cap) if cfg.rollout.differs_from_training else None
        )

    @classmethod
    def check(cls, cfg) -> list[str]:
        errors = super().check(cfg)
        if cfg.rollout.noise_level <= 0:
            errors.append(
                f"rollout.noise_level must be > 0 with algorithm.name {cfg.algorithm.name} (its SDE steps' "
                f"log-probabilities divide by the noise), got {cfg.rollout.noise_level!r}"
            )
        if cfg.grpo.clip_range == "auto" and cfg.train.steps_per_rollout < 2:
            errors.append(
                "grpo.clip_range auto measures the ratios of a rollout's second optimizer step (on its first "
                "the ratio is 1): it needs train.steps_per_rollout >= 2"
            )
        return errors

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        r = self.rollout
        return sde_step_indices(
            num_steps,
            sde_window_size=r.sde_window_size or None,
            sde_window_start_range=tuple(r.sde_window_range) if r.sde_window_size else None,
            timestep_fraction=r.timestep_fraction,
            generator=generator,
            sde_type=r.sde_type,
        )

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        cfg = 2 if self.grpo.train_cfg and self.rollout.guidance_scale > 1 else 1
        return len(batch.sde_steps) * cfg * (2 if self.kl_beta > 0 else 1)

    def _step_weight(self, ro, k: int) -> float:
        """``grpo.step_loss_weight``: 1, or σ_t/√|dt| of SDE step k, with σ_t the step's noise scale
        (``flow_grpo_wan``: sigmas[1]·σ, flow_grpo's Wan weight; ``sde``: a·√(σ/(1−σ));
        ``cps``: σ_next·sin(a·π/2))."""
        if self.grpo.step_loss_weight == "none":
            return 1.0
        sigma, sigma_next, a = ro.sigmas[k].float(), ro.sigma_next[k].float(), self.rollout.noise_level
        if self.rollout.sde_type == "cps":
            sigma_t = sigma_next * math.sin(a * math.pi / 2)
        elif self.rollout.sde_type == "flow_grpo_wan":
            sigma_t = wan_sde_std_dev(sigma, ro.schedule[1].float(), ro.schedule[-1].float())
        else:
            sigma_t = sde_std_dev(sigma, sigma_next, a)
        return float(sigma_t / torch.sqrt(sigma - sigma_next))

    def _log_prob(self, transformers, policy: Policy, ro, k: int, chunk: MicroBatch):
        return compute_log_prob(
            transformers,
            ro,
            k,
            prompt_embeds=chunk.pos,
            negative_embeds=chunk.neg if self.grpo.train_cfg else None,
            guidance_scales=policy.guidance_scales,
            routing=policy.routing,
            noise_level=self.rollout.noise_level,
            sde_type=self.rollout.sde_type,
            condition=chunk.condition,
        )

    def state_dict(self) -> dict:
        return {"clip_range": self.clip_range, "kl_beta": self.kl_beta}

    def scale_kl(self, factor: float) -> float:
        self.kl_beta *= factor
        return self.kl_beta

    def load_state_dict(self, state: dict) -> None:
        self.kl_beta = float(state.get("kl_beta", self.kl_beta))
        if self.grpo.clip_range == "auto" and state.get("clip_range") is not None:
            self.clip_range = float(state["clip_range"])  # a resume keeps the calibrated value

    @torch.no_grad()
    def _calibrate(self, policy: Policy, chunks: list[MicroBatch]) -> None:
        """``grpo.clip_range: auto`` (``miles.algorithms.clip_calibration``): |r − 1| of this step's ratios."""
        devs = []
        for chunk in chunks:
            ro = chunk.rollout
            for k in range(ro.log_probs.shape[1]):
                log_prob, mean, std = self._log_prob(policy.transformers, policy, ro, k, chunk)
                old = ro.log_probs[:, k].to(log_prob.device)
                old_mean = ro.means[:, k].to(mean.device) if self.ratio_norm else None
                log_ratio = policy_log_ratio(log_prob, old, mean=mean, std=std, old_mean=old_mean)
                devs.append((log_ratio.exp() - 1.0).abs())
        self.clip_range = calibrated_clip(torch.cat(devs), self.grpo.target_clipfrac)
        if rank() == 0:
            print(
                f"[miles] grpo.clip_range auto: {self.clip_range:.3e} (the {1 - self.grpo.target_clipfrac:.0%} "
                f"quantile of |ratio - 1| before a rollout's second step)",
                flush=True,
            )

    @torch.no_grad()
    def _reference_mean(self, policy: Policy, ro, k: int, chunk: MicroBatch) -> torch.Tensor:
        with policy.reference() as transformers:
            return self._log_prob(transformers, policy, ro, k, chunk)[1]

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        auto = self.grpo.clip_range == "auto"
        if auto and step_in_rollout == 1 and batch.rollout_index < self.grpo.calibration_rollouts:
            self._calibrate(policy, chunks)  # again at each of the first rollouts: the last holds
        clip_range = self.clip_range if self.clip_range is not None else math.inf  # the ratio is 1 here
        num_k = chunks[0].rollout.log_probs.shape[1]
        samples = sum(c.rollout.log_probs.shape[0] for c in chunks)
        sums = dict.fromkeys(_METRICS, 0.0)
        canary = 0.0
        if self.correction is not None:

            def recompute(c: MicroBatch, k: int) -> torch.Tensor:
                return self._log_prob(policy.transformers, policy, c.rollout, k, c)[0]

            self.correction.begin(recompute, batch, chunks, step_in_rollout)
        for chunk in chunks:
            ro = chunk.rollout
            adv = batch.advantages[chunk.slice]
            weight = ro.log_probs.shape[0] / (samples * num_k)
            for k in range(num_k):
                log_prob, mean, std = self._log_prob(policy.transformers, policy, ro, k, chunk)
                old = rollout_old = ro.log_probs[:, k].to(log_prob.device)
                tis = None
                if self.correction is not None:
                    old, tis = self.correction.old_and_weight(
                        chunk, k, log_prob, old, weight, step_in_rollout
                    )
                ref_mean = self._reference_mean(policy, ro, k, chunk) if self.kl_beta > 0 else None
                out = grpo_policy_loss(
                    log_prob,
                    old,
                    adv,
                    clip_range,
                    beta=self.kl_beta,
                    mean=mean,
                    ref_mean=ref_mean,
                    std=std,
                    policy_weight=self._step_weight(ro, k),
                    old_mean=ro.means[:, k].to(mean.device) if self.ratio_norm else None,
                    sample_weight=tis,
                )
                (out.loss * weight).backward()
                canary += (log_prob.detach() - rollout_old).abs().mean().item() * weight
                values = (out.loss, out.policy_loss, out.kl, out.clipfrac, out.approx_kl, out.ratio_mean)
                for key, value in zip(_METRICS, values):
                    sums[key] += float(value.detach()) * weight
        drift = self.correction.metrics() if self.correction is not None else {}
        calibrated = (
            {"clip_range": self.clip_range}
            if self.clip_range is not None and self.grpo.clip_range == "auto"
            else {}
        )
        return {**sums, "log_prob_mean_abs_diff": canary, **drift, **calibrated}


@register_algorithm("grpo_guard", options=GRPOConfig, section="grpo")
class GRPOGuard(FlowGRPO):
    name = "grpo_guard"
    summary = "Flow-GRPO with GRPO-Guard's normalised ratio and 1/|dt| step weights (``grpo``; needs rollout.sde_type sde)."
    ratio_norm = True
    records_means = True

    @classmethod
    def check(cls, cfg) -> list[str]:
        errors = super().check(cfg)
        if cfg.rollout.differs_from_training:
            errors.append(
                "rollout.precision fp8 and rollout.attention_precision correct Flow-GRPO's plain ratio; GRPO-Guard's "
                "normalised ratio would need the bf16 policy's old means: use algorithm.name flow_grpo or "
                "rollout.precision bf16 and rollout.attention_precision bf16"
            )
        if cfg.rollout.sde_type != "sde":
            errors.append(
                "algorithm.name grpo_guard normalises the ratio of Flow-GRPO's SDE: set rollout.sde_type sde"
            )
        if cfg.grpo.step_loss_weight != "none":
            errors.append(
                "algorithm.name grpo_guard weights every SDE step by 1/|dt| itself: set grpo.step_loss_weight none"
            )
        return errors

    def _step_weight(self, ro, k: int) -> float:
        """GRPO-Guard's gradient reweighting: 1/|dt| of SDE step k."""
        return float(1.0 / (ro.sigmas[k].double() - ro.sigma_next[k].double()))
