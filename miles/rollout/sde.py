"""One denoising step of the Flow-GRPO SDE sampler, with the log-probability of its result.

Flow matching with the rectified-flow path x_σ = (1 − σ)·x0 + σ·ε and velocity prediction
v = ε − x0 is integrated from σ = 1 (noise) to σ = 0 (data). Flow-GRPO (Liu et al. 2025,
"Flow-GRPO: Training Flow Matching Models via Online RL") turns the deterministic ODE into an
SDE with the same marginals, so every step is a Gaussian policy whose log-density can be
scored and trained with a clipped-ratio objective:

    dt   = σ_next − σ                                  (negative: we integrate towards σ = 0)
    mean = x · (1 + σ_t²/(2σ) · dt) + v · (1 + σ_t²(1 − σ)/(2σ)) · dt
    std  = σ_t · sqrt(−dt)
    prev = mean + std · z,   z ~ N(0, I)

The steps differ only in the noise scale σ_t (``rollout.sde_type``):

- ``sde``: σ_t = a · sqrt(σ / (1 − σ)), a = ``rollout.noise_level``. This is the paper's and
  flow_grpo's SD3/FLUX step (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``), not its Wan
  step: flow_grpo's Wan script never uses this formula.
- ``flow_grpo_wan``: σ_t = σ_min + (σ_max − σ_min) · σ with σ_max = sigmas[1] and σ_min =
  sigmas[−1] of the sampling schedule and no noise-level parameter: flow_grpo's Wan step
  (``sde_step_with_logprob`` of ``flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py``, used by
  ``scripts/train_wan2_1.py``). Our schedule ends at σ = 0, so σ_t = sigmas[1] · σ. The sampler adds
  its other two rules (every denoising step noisy, the last one included; the first ⌊fraction·T⌋
  steps trained: ``miles.rollout.sampler``) and ``grpo.step_loss_weight: sigma_over_sqrt_dt`` its
  loss weight σ_t/√|dt| (``miles.algorithms.flow_grpo``). Golden values from flow_grpo's own
  function: tests/unit/test_sde_flow_grpo_wan.py.
- ``cps``: ``cps_step_with_logprob`` (coefficients-preserving sampling).

All arithmetic is fp32 whatever the model dtype (a bf16 mean overflows and its rounding
would swamp the tiny ratio changes GRPO clips at ~1e-4).

Departures from flow_grpo's two ``sde_step_with_logprob`` (SD3 and Wan):
- They look σ up from a diffusers scheduler by timestep; here σ and σ_next are passed in (a
  float or one per sample), so the step does not depend on a scheduler object. The schedule is
  the sampler's (exact endpoints σ_0 = 1, σ_T = 0; ``miles.rollout.sampler``), so σ_max = sigmas[1]
  is that schedule's, not Wan's UniPC grid's (0.9546 there, 0.9545 here, at 8 steps and shift 3).
- SD3 step: at σ = 1 its σ_t is infinite; flow_grpo replaces the 1 − σ in the denominator with
  1 − sigmas[1], the schedule's next-largest sigma. Since σ = 1 only at the first step,
  that value is exactly this step's σ_next, which is what we use. (The Wan step needs no guard.)
- ``std`` is the full per-step standard deviation σ_t·sqrt(−dt) (flow_grpo's ``std_dev_t``
  is σ_t alone); it is what the KL term in ``miles.grpo.losses`` divides by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class SDEStep:
    """Result of one SDE step; every tensor is fp32."""

    prev_sample: Tensor
    """The next latent (B, ...): sampled, or the one passed in to be scored."""
    log_prob: Tensor
    """(B,): log N(prev_sample; mean, std²) averaged over all non-batch dims."""
    mean: Tensor
    """(B, ...): mean of the Gaussian step; carries the gradient of the velocity."""
    std: Tensor
    """(B, 1, ..., 1): standard deviation σ_t·sqrt(−dt), broadcastable against ``mean``."""


def _per_sample(value: float | Tensor, like: Tensor) -> Tensor:
    """A float, 0-dim or (B,) value as an fp32 (B, 1, ..., 1) tensor on ``like``'s device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device).reshape(-1)
    batch = like.shape[0]
    if t.numel() == 1:
        t = t.expand(batch)
    elif t.numel() != batch:
        raise ValueError(f"expected a scalar or {batch} values (one per sample), got {t.numel()}")
    return t.reshape(batch, *([1] * (like.ndim - 1)))


def sde_std_dev(sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """``sde``'s σ_t = a·sqrt(σ / (1 − σ)), with flow_grpo's guard at σ = 1 (see the module docstring)."""
    denom_sigma = torch.where(sigma == 1.0, sigma_next, sigma)
    return noise_level * torch.sqrt(sigma / (1.0 - denom_sigma))


def wan_sde_std_dev(sigma: Tensor, sigma_max: float | Tensor, sigma_min: float | Tensor) -> Tensor:
    """``flow_grpo_wan``'s σ_t = σ_min + (σ_max − σ_min)·σ (σ_max, σ_min: the schedule's sigmas[1], sigmas[−1])."""
    return sigma_min + (sigma_max - sigma_min) * sigma


def draw_noise(
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    device: torch.device | str,
) -> Tensor:
    """fp32 N(0, I) noise of ``shape`` on ``device``.

    Drawn on the generator's device, so a CPU generator gives the same noise on any accelerator.
    With one generator per sample (a sequence of ``shape[0]``), sample i's noise depends only on
    its own generator: how samples are split over ranks or micro-batches does not change it.
    """
    if isinstance(generator, Sequence):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        draws = [torch.randn(shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return torch.stack(draws).to(device)
    draw_on = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=draw_on, dtype=torch.float32).to(device)


def sde_step_with_logprob(
    velocity: Tensor,
    latents: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> SDEStep:
    """One Flow-GRPO SDE step from ``latents`` at ``sigma`` to ``sigma_next``.

    Args:
        velocity: the (guided) model prediction v, (B, ...), any float dtype.
        latents: x at ``sigma``, same shape.
        sigma, sigma_next: a float for the whole batch or a (B,) tensor; 0 <= sigma_next < sigma <= 1.
        noise_level: a > 0.
        prev_sample: if given, it is scored instead of sampling a new one (the training recompute).
        generator: the source of the step noise when sampling, or one generator per sample.
    """
    if noise_level <= 0:
        raise ValueError(f"noise_level must be > 0 for an SDE step (got {noise_level}); use ode_step")
    velocity = velocity.float()
    latents = latents.float()
    sigma_b = _per_sample(sigma, latents)
    sigma_next_b = _per_sample(sigma_next, latents)
    std_dev_t = sde_std_dev(sigma_b, sigma_next_b, noise_level)
    return _flow_sde_step(velocity, latents, sigma_b, sigma_next_b, std_dev_t, prev_sample, generator)


def flow_grpo_wan_step_with_logprob(
    velocity: Tensor,
    latents: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    sigma_max: float | Tensor,
    sigma_min: float | Tensor,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> SDEStep:
    """flow_grpo's Wan SDE step (``rollout.sde_type: flow_grpo_wan``): the step of
    :func:`sde_step_with_logprob` with σ_t = σ_min + (σ_max − σ_min)·σ and no noise level.

    ``sigma_max``/``sigma_min`` are the sampling schedule's sigmas[1] and sigmas[−1] (the sampler
    passes them); the other arguments are as :func:`sde_step_with_logprob`'s. σ_next may be 0
    (flow_grpo's Wan sampler takes its last step with noise too).
    """
    sigma_max, sigma_min = float(sigma_max), float(sigma_min)
    if not 0.0 <= sigma_min < sigma_max <= 1.0:
        raise ValueError(
            f"flow_grpo_wan needs 0 <= sigma_min < sigma_max <= 1 (the schedule's sigmas[-1] and "
            f"sigmas[1]), got sigma_min={sigma_min}, sigma_max={sigma_max}"
        )
    velocity = velocity.float()
    latents = latents.float()
    sigma_b = _per_sample(sigma, latents)
    sigma_next_b = _per_sample(sigma_next, latents)
    std_dev_t = wan_sde_std_dev(sigma_b, sigma_max, sigma_min)
    return _flow_sde_step(velocity, latents, sigma_b, sigma_next_b, std_dev_t, prev_sample, generator)


def _flow_sde_step(
    velocity: Tensor,
    latents: Tensor,
    sigma_b: Tensor,
    sigma_next_b: Tensor,
    std_dev_t: Tensor,
    prev_sample: Tensor | None,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> SDEStep:
    """The Flow-GRPO SDE step given its noise scale σ_t (fp32, (B, 1, ..., 1) sigmas)."""
    dt = sigma_next_b - sigma_b
    mean = (
        latents * (1 + std_dev_t**2 / (2 * sigma_b) * dt)
        + velocity * (1 + std_dev_t**2 * (1 - sigma_b) / (2 * sigma_b)) * dt
    )
    std = std_dev_t * torch.sqrt(-dt)

    if prev_sample is None:
        noise = draw_noise(latents.shape, generator, latents.device)
        prev_sample = mean + std * noise
    # The sample is data, not a function of the policy: only the mean carries gradient.
    prev_sample = prev_sample.detach().float()

    log_density = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


def cps_step_with_logprob(
    velocity: Tensor,
    latents: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> SDEStep:
    """One coefficients-preserving sampling (CPS) step (Wang & Yu 2025, arXiv 2509.05952;
    flow_grpo's ``sde_type="cps"``), arguments as :func:`sde_step_with_logprob`.

    The step re-noises the predicted clean sample with exactly the noise coefficient σ_next the
    flow path has there, split between the predicted noise and fresh noise:

        x̂0 = x − σ·v,   x̂1 = x + (1 − σ)·v,   σ_t = σ_next · sin(a·π/2)
        mean = (1 − σ_next)·x̂0 + sqrt(σ_next² − σ_t²)·x̂1,   prev = mean + σ_t·z

    ``log_prob`` is flow_grpo's: −mean((prev − mean)²), the Gaussian log-density without its
    constants and without the 1/(2σ_t²) factor (so ratios are those of flow_grpo's CPS runs;
    ``grpo.clip_range`` applies to them). ``std`` is σ_t, the step's true standard deviation.
    """
    if not 0 < noise_level <= 1:
        raise ValueError(f"CPS needs 0 < noise_level <= 1 (σ_t = σ_next·sin(a·π/2)), got {noise_level}")
    velocity = velocity.float()
    latents = latents.float()
    sigma_b = _per_sample(sigma, latents)
    sigma_next_b = _per_sample(sigma_next, latents)
    std = sigma_next_b * math.sin(noise_level * math.pi / 2)
    x0 = latents - sigma_b * velocity
    x1 = latents + (1 - sigma_b) * velocity
    mean = x0 * (1 - sigma_next_b) + x1 * torch.sqrt(sigma_next_b**2 - std**2)
    if prev_sample is None:
        prev_sample = mean + std * draw_noise(latents.shape, generator, latents.device)
    prev_sample = prev_sample.detach().float()
    sq = (prev_sample - mean) ** 2
    log_prob = -sq.mean(dim=tuple(range(1, sq.ndim)))
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


SDE_STEPS = {
    "sde": sde_step_with_logprob,
    "cps": cps_step_with_logprob,
    "flow_grpo_wan": flow_grpo_wan_step_with_logprob,
}
"""``rollout.sde_type`` -> the stochastic step the rollout samples and training scores with. ``sde``
and ``cps`` take ``noise_level`` after σ_next; ``flow_grpo_wan`` takes ``sigma_max, sigma_min``
(``miles.rollout.sampler.bind_sde_step`` binds either)."""


def ode_step(velocity: Tensor, latents: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Deterministic Euler step of the flow ODE, x + v·(σ_next − σ), in fp32."""
    latents = latents.float()
    dt = _per_sample(sigma_next, latents) - _per_sample(sigma, latents)
    return latents + velocity.float() * dt
