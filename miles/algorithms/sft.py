"""Supervised fine-tuning (SFT): Wan's flow-matching objective on the videos of a dataset.

There is no rollout: the batch source is ``videos`` (``miles.train.sources``), the clean latents
x0 of the JSONL's videos (``data.prompt_file``), VAE-encoded once. For each sample a noise level
σ (u drawn uniform or logit-normal, ``sft.timestep_sampling``, then time-shifted as the sampler
shifts, σ = s·u / (1 + (s − 1)·u)) and Gaussian noise ε give

    x_σ = (1 − σ)·x0 + σ·ε,        loss = mean_samples mean_elements (v_θ(x_σ, 1000·σ, c) − (ε − x0))²

on the conditional velocity (CFG-free; ``sft.caption_dropout`` trains a fraction of samples on the
negative prompt's embedding so that CFG keeps an unconditional branch). Every sample has its own σ:
the model's timestep is (B,), or one per token, (B, S), as the family's routing shapes it, with 0
on the tokens of a first-frame image condition, which carry no loss.

Two experts: every rank must run the same expert at each pass (FSDP's collectives pair up by call
order), so each optimizer step draws its expert from a generator shared by all ranks (keyed by the
rollout and the step), with the probability of the expert's σ range under the density, and every
sample of the step draws its σ within that range: over steps each expert is trained on exactly
the density restricted to its range. σ, ε and the caption dropout are keyed by the sample's global
index, so dp and sp layouts draw the same numbers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
from torch import Tensor

from miles.algorithms.base import Algorithm, Policy, run_schedule
from miles.algorithms.registry import register_algorithm
from miles.dtypes import compute_dtype
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.condition import generated
from miles.rollout.sampler import NUM_TRAIN_TIMESTEPS, call_expert
from miles.rollout.schedule import FlowSchedule

_METRICS = ("loss", "sigma_mean")


@dataclasses.dataclass(kw_only=True)
class SFTConfig:
    """``sft``: supervised flow matching on a video dataset."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "shift": ("(0, 100]", "1: no shift; unset: rollout.shift"),
        "logit_mean": ("[-10, 10]", "SD3 uses 0"),
        "logit_std": ("(0, 10]", "SD3 uses 1"),
        "caption_dropout": ("[0, 1)", ""),
    }
    """The numeric ranges of its fields (``miles.config.RANGES`` rules)."""

    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    """How ``algorithm.name sft`` draws each sample's noise level before the shift: ``uniform`` u ~ U(0, 1),
    or ``logit_normal`` u = sigmoid(logit_mean + logit_std * N(0, 1)) (SD3); then sigma = shift*u / (1 + (shift - 1)*u)."""
    shift: float | None = None
    """The time shift applied to u (Wan: 3.0 at 480p, 5.0 at 720p); None: the model family's (Wan: rollout.shift); 1: none."""
    logit_mean: float = 0.0
    """``logit_normal``: the mean of the normal before the sigmoid."""
    logit_std: float = 1.0
    """``logit_normal``: its standard deviation."""
    caption_dropout: float = 0.0
    """Fraction of samples trained on the negative prompt's embedding instead of their caption (keeps
    the unconditional branch that CFG needs; Wan-style fine-tunes use about 0.1)."""
    cache_latents: bool = True
    """Keep each video's VAE latents under ``<run>/sft_latents`` (encoded once; resumes and later epochs
    read them back). False encodes every video each time it is drawn."""


def shifted(u: Tensor, shift: float) -> Tensor:
    """The sampler's time shift: s·u / (1 + (s − 1)·u)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def sigma_of_quantile(q: Tensor, sampling: str, shift: float, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """σ at quantile ``q`` in [0, 1] of the training density: u = q (``uniform``) or
    u = sigmoid(mean + std·Φ⁻¹(q)) (``logit_normal``), then shifted."""
    u = q if sampling == "uniform" else torch.sigmoid(mean + std * torch.special.ndtri(q))
    return shifted(u, shift)


def quantile_of_sigma(
    sigma: float, sampling: str, shift: float, mean: float = 0.0, std: float = 1.0
) -> float:
    """The inverse of :func:`sigma_of_quantile` (where an expert's σ range starts)."""
    s = torch.tensor(sigma, dtype=torch.float64)
    u = s / (shift - (shift - 1.0) * s)
    if sampling == "uniform":
        return float(u)
    return float(torch.special.ndtr((torch.logit(u) - mean) / std))


def flow_matching_loss(v: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
    """Per-sample mean squared error (B,) of the velocity ``v`` against the flow's target ε − x0, fp32."""
    dims = tuple(range(1, v.ndim))
    return ((v.float() - (noise.float() - x0.float())) ** 2).mean(dim=dims)


def conditional_velocity(
    model, x_t: Tensor, sigma: Tensor, context: Tensor, condition=None, routing=None
) -> Tensor:
    """The model's velocity (fp32) at latents ``x_t`` (B, C, F, H, W), one σ per sample (B,), text
    ``context`` (B, L, D); inputs as ``predict_velocity`` passes them (timestep fp32, unrounded)."""
    dtype = compute_dtype(model)
    x = (x_t if condition is None else condition.model_input(x_t)).to(dtype)
    t = (sigma * NUM_TRAIN_TIMESTEPS).to(x.device, torch.float32)  # (B,)
    ones = torch.ones((), device=x.device)
    if condition is not None:  # (B,) or (B, S) with 0 on the first frame's tokens
        per = condition.timestep(ones, x, model.config.patch_size, x.shape[0])
        t = per * (t[:, None] if per.ndim == 2 else t)
    elif routing is not None:  # (B,), or (B, S) for per-token timesteps
        t = routing.model_timestep(t, x, model)
    image = None if condition is None or condition.image_embeds is None else condition.image_embeds.to(dtype)
    extra = {} if image is None else {"encoder_hidden_states_image": image}  # Wan2.1-I2V only
    return call_expert(routing, model, x, t, context.to(x.device, dtype), **extra).float()


@register_algorithm("sft", options=SFTConfig, section="sft")
class SFT(Algorithm):
    name = "sft"
    summary = 'supervised flow matching on the videos of data.prompt_file, a JSONL of {"video", "prompt"} (section ``sft``; no rollouts, no rewards in training).'
    batch_source = "videos"
    uses_rewards = False

    @classmethod
    def check(cls, cfg) -> list[str]:
        errors = super().check(cfg)
        if not (cfg.data.prompt_file or "").endswith(".jsonl"):
            errors.append(
                'algorithm.name sft trains on data.prompt_file: set it to a .jsonl of {"video": ..., "prompt": ...}'
            )
        return errors

    def __init__(self, cfg, schedule: FlowSchedule | None = None):
        self.sft = cfg.sft
        self.shift = cfg.sft.shift if cfg.sft.shift is not None else run_schedule(cfg, schedule).shift

    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        return []  # nothing is sampled

    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        return 1

    def _density(self) -> dict:
        s = self.sft
        return dict(sampling=s.timestep_sampling, shift=self.shift, mean=s.logit_mean, std=s.logit_std)

    def expert_range(self, policy: Policy, rollout: int, step_in_rollout: int) -> tuple[int, float, float]:
        """(expert, q_lo, q_hi): the step's expert and the quantile range its samples draw from,
        the same on every rank."""
        if len(policy.transformers) == 1:
            return 0, 0.0, 1.0
        q_b = quantile_of_sigma(policy.routing.boundary_sigma, **self._density())
        high = float(torch.rand((), generator=policy.generator(8, rollout, step_in_rollout))) >= q_b
        return (0, q_b, 1.0) if high else (1, 0.0, q_b)

    def draws(
        self, policy: Policy, rollout: int, ids: list[int], shape, q_range: tuple[float, float]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per sample, keyed by its global index: σ (B,), noise (B, *shape) and the caption-dropout mask (B,)."""
        lo, hi = q_range
        q, noise, drop = [], [], []
        for i in ids:
            g = policy.generator(7, rollout, i)
            q.append(lo + (hi - lo) * torch.rand((), generator=g, dtype=torch.float64))
            noise.append(torch.randn(shape, generator=g))
            drop.append(torch.rand((), generator=g) < self.sft.caption_dropout)
        sigma = sigma_of_quantile(torch.stack(q), **self._density()).float()
        return sigma, torch.stack(noise), torch.stack(drop)

    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        samples = sum(c.rollout.final_latents.shape[0] for c in chunks)
        expert, lo, hi = self.expert_range(policy, batch.rollout_index, step_in_rollout)
        model = policy.transformers[expert]
        sums = dict.fromkeys(_METRICS, 0.0)
        for chunk in chunks:
            x0 = chunk.rollout.final_latents.float()
            ids = batch.sample_ids[chunk.slice].tolist()
            sigma, noise, drop = self.draws(policy, batch.rollout_index, ids, x0.shape[1:], (lo, hi))
            sigma, noise, drop = sigma.to(x0.device), noise.to(x0.device), drop.to(x0.device)
            s = sigma.view(-1, *[1] * (x0.ndim - 1))
            x_t = (1.0 - s) * x0 + s * noise
            neg = chunk.neg.to(chunk.pos.device, chunk.pos.dtype).expand_as(chunk.pos)
            context = torch.where(drop.to(chunk.pos.device).view(-1, 1, 1), neg, chunk.pos)
            v = conditional_velocity(model, x_t, sigma, context, chunk.condition, policy.routing)
            # a first-frame image condition's frame is clean: no loss on it
            per_sample = flow_matching_loss(*generated(chunk.condition, v, x0, noise))
            loss = per_sample.sum() / samples
            loss.backward()
            sums["loss"] += float(loss.detach())
            sums["sigma_mean"] += float(sigma.sum()) / samples
        return sums
