"""The rollout sampling loop: Wan denoising with SDE steps that record log-probabilities.

``sample_with_logprob`` runs the whole denoising chain for a batch of prompts and returns a
``Rollout`` holding, for the K SDE steps only, the latent going in, the latent coming out and
its log-probability; ``compute_log_prob`` recomputes that log-probability for one stored step
under the current weights (the GRPO update). Both go through ``predict_velocity`` so CFG and
expert routing are the same code on both sides: with unchanged weights and the same batch the
recompute equals the rollout's log-prob bit for bit (fp32, CPU).

- Schedule: the model family's (``miles.rollout.schedule``), timestep t = 1000·σ. Wan's (a float
  ``shift``): σ_i = shift·s/(1 + (shift − 1)·s) with s = 1 − i/T, i = 0..T (σ_0 = 1, σ_T = 0),
  the shift of Wan's FlowMatch/UniPC schedulers on DanceGRPO's evenly spaced grid; diffusers'
  schedulers use slightly different grids (UniPC starts at shift(0.999), FlowMatchEuler ends at
  ~shift(1/1000)) — the endpoints here are exact. LTX-Video's (a ``FlowSchedule``): its
  scheduler's as ``LTXPipeline`` sets it (dynamic shift from the token count, ``shift_terminal``).
- SDE steps: the first ⌈fraction·T⌉ steps, or a window of ``sde_window_size`` steps whose start
  is drawn each rollout from ``[lo, hi)`` (flow_grpo's "SDE window"). The last step (to σ = 0)
  is never an SDE step: noise injected there would land in the output with no later step to
  denoise it. All other steps are ODE (Euler) steps and are not recorded.
- ``sde_type="flow_grpo_wan"`` follows flow_grpo's Wan sampler instead: every step is an SDE step,
  the last one included (its noise stays in the output, as there), and the recorded (trained)
  steps are the first ⌊fraction·T⌋, which may include the last (a window is drawn as above,
  every step still noisy).
- CFG is batched: one forward over [cond; uncond] (2B samples), then v = v_u + g·(v_c − v_u)
  in fp32. A step uses CFG iff negative embeddings are given and its expert's scale is > 1
  (diffusers' rule, applied per expert).
- Experts and timesteps: the model family's ``routing`` (:class:`miles.models.family.ExpertRouting`,
  ``model.routing``) picks the expert of each timestep, shapes the timestep the expert takes
  (one per sample, or one per token) and calls it (``routing.forward``: how the expert takes the
  latent and the family's text condition); None: one expert, one timestep per sample, called as
  a diffusers Wan transformer.

Sampling can run in pieces: ``begin_sampling`` → ``SamplingRun.run_steps(transformers, i, j)``
→ ``SamplingRun.finish()`` is bitwise ``sample_with_logprob``; ``expert_phases`` gives each
expert's steps, so a trainer can run every micro-batch's high-noise steps with only that expert
gathered, then the low-noise ones (docs/rollout_memory.md).

Image-to-video (``condition``, ``miles.rollout.condition``): the condition builds the model
input (channel concatenation, or the clean first frame with per-token timestep 0) and carries
the image embeddings; it is the same at every step. With a first-frame condition the sampler's
state keeps that frame clean and the SDE steps (noise, mean, log-prob) cover the other frames.

Randomness comes from one ``torch.Generator`` in a fixed order (SDE window, initial noise,
then one draw per SDE step), so a rollout is a function of the generator's seed: ranks that
must produce identical samples (sequence-parallel peers) seed their generators identically.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from miles.dtypes import compute_dtype
from miles.rollout.condition import ImageCondition, generated
from miles.rollout.schedule import FlowSchedule, flow_sigmas
from miles.rollout.sde import SDE_STEPS, ode_step

NUM_TRAIN_TIMESTEPS = 1000
"""Wan's ``num_train_timesteps``: the model is conditioned on t = 1000·σ."""


def sde_step_indices(
    num_steps: int,
    sde_window_size: int | None = None,
    sde_window_start_range: tuple[int, int] | None = None,
    timestep_fraction: float = 1.0,
    generator: torch.Generator | None = None,
    sde_type: str = "sde",
) -> list[int]:
    """Indices of the denoising steps that are recorded and trained on, ascending.

    With ``sde_window_size`` (> 0): ``sde_window_size`` consecutive steps starting at an index
    drawn uniformly from the half-open ``sde_window_start_range`` [lo, hi) (default: every
    start that fits). Otherwise the first ⌈timestep_fraction·num_steps⌉ steps. Either way the
    final step (to σ = 0) is excluded, so at most num_steps − 1 steps are returned and the
    count K does not depend on the draw (every rank runs the same number of training passes).
    With ``sde_type="flow_grpo_wan"`` and no window: the first ⌊timestep_fraction·num_steps⌋
    steps, as flow_grpo's Wan script counts them (the last step included at fraction 1).
    """
    if sde_type == "flow_grpo_wan" and not sde_window_size:
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        count = math.floor(round(timestep_fraction * num_steps, 9))
        if count < 1:
            raise ValueError(
                f"rollout.sde_type flow_grpo_wan trains floor(timestep_fraction * num_steps) = "
                f"floor({timestep_fraction} * {num_steps}) = 0 steps: raise rollout.timestep_fraction"
            )
        return list(range(count))
    last = num_steps - 1  # steps 0..last-1 may be SDE steps
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 to have an SDE step before the final one, got {num_steps}")
    if sde_window_size:
        w = sde_window_size
        if not 1 <= w <= last:
            raise ValueError(f"sde_window_size must be in [1, num_steps - 1 = {last}], got {w}")
        lo, hi = sde_window_start_range if sde_window_start_range is not None else (0, last - w + 1)
        if not (0 <= lo < hi and hi - 1 + w <= last):
            raise ValueError(
                f"sde_window_start_range [lo, hi) = [{lo}, {hi}) with window size {w} must satisfy "
                f"0 <= lo < hi and hi - 1 + {w} <= {last} (the final step is never an SDE step); "
                f"lower hi to at most {last - w + 1}"
            )
        device = generator.device if generator is not None else "cpu"
        start = int(torch.randint(lo, hi, (1,), generator=generator, device=device).item())
        return list(range(start, start + w))
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    # round() first so that e.g. 0.6 * 10 = 6.000000000000001 gives 6 steps, not 7.
    count = min(math.ceil(round(timestep_fraction * num_steps, 9)), last)
    return list(range(count))


def _expert(routing, t: Tensor, num_experts: int) -> int:
    """The index of the expert that denoises at timestep ``t``: the family's routing decides."""
    if routing is None:
        if num_experts != 1:
            raise ValueError(f"{num_experts} experts need the model family's routing (model.routing)")
        return 0
    return routing.expert_index(t, num_experts)


def diffusers_call(expert: nn.Module, x: Tensor, timestep: Tensor, text: Tensor, **extra) -> Tensor:
    """The output of a diffusers video transformer that takes the latent (B, C, F, H, W) and the
    text embeddings as they are (Wan's call): ``expert(hidden_states=x, timestep=...,
    encoder_hidden_states=text)``."""
    out = expert(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False, **extra)
    return out[0]


def call_expert(routing, expert: nn.Module, x: Tensor, timestep: Tensor, text: Tensor, **extra) -> Tensor:
    """The expert's output (B, C, F, H, W) at model input ``x``: the family's ``routing.forward``
    (how its experts take the latent and its text condition), or :func:`diffusers_call` without routing."""
    if routing is None:
        return diffusers_call(expert, x, timestep, text, **extra)
    return routing.forward(expert, x, timestep, text, **extra)


def cfg_combine(v_cond: Tensor, v_uncond: Tensor, guidance_scale: float) -> Tensor:
    """Classifier-free guidance: v_u + g·(v_c − v_u)."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def _guidance_per_expert(guidance_scales: float | Sequence[float], num_experts: int) -> list[float]:
    scales = [float(guidance_scales)] if isinstance(guidance_scales, int | float) else list(guidance_scales)
    if len(scales) == 1:
        scales = scales * num_experts
    if len(scales) != num_experts:
        raise ValueError(f"give one guidance scale or one per expert ({num_experts}), got {len(scales)}")
    return scales


def predict_velocity(
    transformers: Sequence[nn.Module],
    latents: Tensor,
    t: Tensor,
    prompt_embeds: Tensor,
    negative_embeds: Tensor | None,
    guidance_scales: float | Sequence[float],
    routing=None,
    condition: ImageCondition | None = None,
) -> Tensor:
    """The routed, guided velocity at timestep ``t`` (0-dim tensor) for latents (B, C, F, H, W), fp32.

    ``routing`` (the family's ``ExpertRouting``) picks the expert and shapes its timestep: (B,), or
    one per token, (B, S). ``condition``: the image condition of image-to-video models
    (``miles.rollout.condition``): it builds the model input and timestep and carries the image
    embeddings.
    """
    idx = _expert(routing, t, len(transformers))
    model = transformers[idx]
    scale = _guidance_per_expert(guidance_scales, len(transformers))[idx]
    use_cfg = negative_embeds is not None and scale > 1.0

    # Inputs as WanPipeline passes them: latents and text embeddings in the compute dtype, the
    # timestep in fp32 (the model's sinusoidal embedding must see it unrounded).
    batch = latents.shape[0]
    dtype = compute_dtype(model)
    x = (latents if condition is None else condition.model_input(latents)).to(dtype)
    context = prompt_embeds.to(latents.device, dtype)  # cached embeddings may live on the CPU
    image = None if condition is None or condition.image_embeds is None else condition.image_embeds.to(dtype)
    if use_cfg:
        if negative_embeds.shape[0] == 1:
            negative_embeds = negative_embeds.expand(batch, *negative_embeds.shape[1:])
        if negative_embeds.shape != prompt_embeds.shape:
            raise ValueError(
                f"negative_embeds {tuple(negative_embeds.shape)} must match prompt_embeds "
                f"{tuple(prompt_embeds.shape)} (pad both to the same text length) for batched CFG"
            )
        x = torch.cat([x, x])  # (2B, C, F, H, W): [cond; uncond]
        context = torch.cat([context, negative_embeds.to(latents.device, dtype)])
        image = None if image is None else torch.cat([image, image])
    timestep = t.to(latents.device, torch.float32).expand(x.shape[0])
    if condition is not None:
        timestep = condition.timestep(timestep[0], x, model.config.patch_size, x.shape[0])
    elif routing is not None:
        timestep = routing.model_timestep(timestep, x, model)
    extra = {} if image is None else {"encoder_hidden_states_image": image}  # Wan2.1-I2V only
    out = call_expert(routing, model, x, timestep, context, **extra).float()
    if use_cfg:
        v_cond, v_uncond = out.chunk(2)
        return cfg_combine(v_cond, v_uncond, scale)
    return out


def bind_sde_step(sde_type: str, noise_level: float, schedule: Tensor | None):
    """``rollout.sde_type``'s step with its noise parameters bound: a callable
    ``(velocity, latents, sigma, sigma_next, prev_sample=None, generator=None) -> SDEStep``.

    ``sde``/``cps`` take ``noise_level``; ``flow_grpo_wan`` takes the (T + 1,) sigma ``schedule``'s
    sigmas[1] and sigmas[−1] and ignores ``noise_level`` (flow_grpo's Wan noise has no level).
    """
    if sde_type not in SDE_STEPS:
        raise ValueError(f"rollout.sde_type must be one of {sorted(SDE_STEPS)}, got {sde_type!r}")
    if sde_type == "flow_grpo_wan":
        if schedule is None:
            raise ValueError("rollout.sde_type flow_grpo_wan needs the rollout's sigma schedule")
        return functools.partial(SDE_STEPS[sde_type], sigma_max=schedule[1], sigma_min=schedule[-1])
    return functools.partial(SDE_STEPS[sde_type], noise_level=noise_level)


@dataclass
class Rollout:
    """One batch of sampled trajectories; K = number of SDE steps. All float tensors are fp32."""

    latents: Tensor
    """(B, K, C, F, H, W): the latent entering each SDE step."""
    next_latents: Tensor
    """(B, K, C, F, H, W): the latent the SDE step produced (what training scores)."""
    log_probs: Tensor
    """(B, K): log-probability of ``next_latents`` under the sampling policy."""
    timesteps: Tensor
    """(K,): model timestep t = 1000·σ of each SDE step."""
    sigmas: Tensor
    """(K,): σ at each SDE step."""
    sigma_next: Tensor
    """(K,): σ after each SDE step."""
    step_indices: list[int]
    """The K denoising-step indices (into the schedule) of the SDE steps."""
    final_latents: Tensor
    """(B, C, F, H, W): the clean latent at σ = 0, for decoding and reward."""
    means: Tensor | None = None
    """(B, K, C, F', H, W): the sampling policy's SDE mean of each step (``record_means``; GRPO-Guard);
    F' = F − 1 with a first-frame image condition (only the generated frames are stepped)."""
    schedule: Tensor | None = None
    """(T + 1,): the whole sigma schedule the rollout ran on (``flow_grpo_wan``'s noise reads it)."""

    @property
    def num_sde_steps(self) -> int:
        return len(self.step_indices)

    def select(self, batch_indices: Tensor | Sequence[int]) -> Rollout:
        """The rollout restricted to some samples (e.g. a training micro-batch)."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long, device=self.latents.device)
        per_sample = {"latents", "next_latents", "log_probs", "final_latents", "means"}
        return Rollout(
            **{
                f.name: v[idx] if f.name in per_sample and v is not None else v
                for f in fields(self)
                for v in [getattr(self, f.name)]
            }
        )

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(
            **{
                f.name: v.to(device) if isinstance(v, Tensor) else v
                for f in fields(self)
                for v in [getattr(self, f.name)]
            }
        )


def initial_noise(
    num_samples: int,
    latent_shape: Sequence[int],
    generator: torch.Generator | None,
    group_size: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """fp32 N(0, I) noise (num_samples, *latent_shape); with ``group_size``, each run of
    ``group_size`` consecutive samples (a GRPO group) shares one draw."""
    draw_on = generator.device if generator is not None else (device or "cpu")
    device = device if device is not None else draw_on
    if group_size is None:
        return torch.randn(num_samples, *latent_shape, generator=generator, device=draw_on).to(device)
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"num_samples ({num_samples}) must be a multiple of group_size ({group_size})")
    noise = torch.randn(num_samples // group_size, *latent_shape, generator=generator, device=draw_on)
    return noise.repeat_interleave(group_size, dim=0).to(device)


def expert_phases(
    num_steps: int, shift: float | FlowSchedule, routing, num_experts: int
) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` for each expert's run of denoising steps, in order, empty runs left
    out: a rollout that gathers one expert at a time runs every batch's ``start..stop - 1``."""
    switch = expert_switch_step(num_steps, shift, routing, num_experts)
    return [(e, a, b) for e, (a, b) in enumerate(((0, switch), (switch, num_steps))[:num_experts]) if a < b]


@torch.no_grad()
def sample_with_logprob(
    transformers: Sequence[nn.Module],
    prompt_embeds: Tensor,
    negative_embeds: Tensor | None,
    latent_shape: Sequence[int],
    **options,
) -> Rollout:
    """Denoise a batch from noise to σ = 0, recording the SDE steps: ``begin_sampling`` (its
    arguments), every step, ``finish``. See ``SamplingRun`` to run the steps expert by expert."""
    run = begin_sampling(prompt_embeds, negative_embeds, latent_shape, **options)
    run.run_steps(transformers, 0, run.num_steps)
    return run.finish()


def _chosen_sde_steps(
    sde_steps, num_steps: int, noise_level: float, window: tuple, generator, sde_type: str
) -> list[int]:
    """The caller's SDE steps (checked), else a window drawn from ``window`` = (size, start range,
    timestep fraction), else none (the ODE: noise level 0)."""
    if sde_steps is not None:
        steps = sorted(int(i) for i in sde_steps)
        end = num_steps if sde_type == "flow_grpo_wan" else num_steps - 1  # flow_grpo_wan: last too
        if steps and (noise_level <= 0 or steps[0] < 0 or steps[-1] >= end):
            raise ValueError(f"sde_steps {steps} must lie in [0, {end}) with noise_level > 0")
        return steps
    if noise_level > 0:
        return sde_step_indices(num_steps, *window, generator, sde_type=sde_type)
    return []


def begin_sampling(
    prompt_embeds: Tensor,
    negative_embeds: Tensor | None,
    latent_shape: Sequence[int],
    *,
    num_steps: int,
    shift: float | FlowSchedule,
    guidance_scales: float | Sequence[float],
    routing=None,
    noise_level: float,
    generator: torch.Generator | Sequence[torch.Generator],
    timestep_fraction: float = 1.0,
    sde_window_size: int | None = None,
    sde_window_start_range: tuple[int, int] | None = None,
    same_noise_per_group: bool = False,
    group_size: int | None = None,
    latents: Tensor | None = None,
    sde_steps: Sequence[int] | None = None,
    sde_type: str = "sde",
    record_means: bool = False,
    condition: ImageCondition | None = None,
    device: torch.device | str | None = None,
) -> SamplingRun:
    """The state of a batch about to be denoised (initial noise drawn, SDE steps chosen).

    Args:
        shift: the time shift of Wan's schedule, or the model family's noise schedule
            (``FlowSchedule``, ``FamilyModel.flow_schedule``): :func:`flow_sigmas`.
        routing: the model family's ``ExpertRouting`` (``model.routing``); None: one expert, one
            timestep per sample.
        prompt_embeds: (B, L, D) text embeddings, one row per sample (groups contiguous); they may
            live on the CPU (``device`` then says where to sample): each forward moves them.
        negative_embeds: (B, L, D) or (1, L, D) for CFG, or None for no CFG.
        latent_shape: (C, F, H, W) of one sample's latent.
        noise_level: the SDE noise level a; 0 samples with the ODE only (K = 0, e.g. evaluation).
        generator: see the module docstring for the draw order; or one generator per sample for
            the SDE noise (then ``latents`` and ``sde_steps`` must be given).
        same_noise_per_group / group_size: start each group of ``group_size`` contiguous samples
            from the same initial noise (the SDE noise still differs per sample).
        latents: initial noise to use instead of drawing it.
        sde_steps: the SDE step indices, chosen by the caller (then no window is drawn here). A
            distributed trainer picks them once for all ranks so expert routing matches everywhere.
        sde_type: ``sde`` (Flow-GRPO's SDE), ``cps`` (coefficients-preserving sampling) or
            ``flow_grpo_wan`` (flow_grpo's Wan SDE; every step noisy once any step is recorded).
        record_means: also keep each SDE step's mean (``Rollout.means``, for GRPO-Guard's ratio).
        condition: the image condition (image-to-video), one row per sample. A first-frame
            condition keeps the first latent frame clean: the steps and log-probs cover the rest.
        device: where the latents live (default: the prompt embeddings' device).
    """
    batch = prompt_embeds.shape[0]
    device = torch.device(device) if device is not None else prompt_embeds.device
    sigmas = flow_sigmas(num_steps, shift).to(device)
    bind_sde_step(sde_type, noise_level, sigmas)  # checks sde_type

    window = (sde_window_size, sde_window_start_range, timestep_fraction)
    steps = _chosen_sde_steps(sde_steps, num_steps, noise_level, window, generator, sde_type)
    if latents is None:
        if same_noise_per_group and group_size is None:
            raise ValueError("same_noise_per_group needs group_size")
        latents = initial_noise(
            batch, latent_shape, generator, group_size if same_noise_per_group else None, device=device
        )
    x = latents.float() if condition is None else condition.clean(latents.float())
    return SamplingRun(
        prompt_embeds=prompt_embeds,
        negative_embeds=negative_embeds,
        sigmas=sigmas,
        timesteps=sigmas * NUM_TRAIN_TIMESTEPS,
        steps=steps,
        x=x,
        guidance_scales=guidance_scales,
        routing=routing,
        noise_level=noise_level,
        generator=generator,
        sde_type=sde_type,
        record_means=record_means,
        condition=condition,
    )


@dataclass
class SamplingRun:
    """One batch part-way through denoising: ``run_steps(transformers, i, j)`` takes steps i..j-1,
    ``finish()`` returns the ``Rollout`` once every step has run.

    Running the steps in pieces is bitwise the same as running them at once: the state (latent,
    records) carries over, and each sample's SDE noise comes from its own generator(s) in step
    order. So a trainer may run all micro-batches' high-noise steps while only the high-noise
    expert is gathered, then all their low-noise steps (``expert_switch_step``).
    """

    prompt_embeds: Tensor
    negative_embeds: Tensor | None
    sigmas: Tensor
    timesteps: Tensor
    steps: list[int]
    x: Tensor
    guidance_scales: float | Sequence[float]
    routing: object  # the family's ExpertRouting, or None
    noise_level: float
    generator: torch.Generator | Sequence[torch.Generator]
    sde_type: str
    record_means: bool
    condition: ImageCondition | None
    next_step: int = 0
    records: dict = dataclasses.field(
        default_factory=lambda: {"latents": [], "next": [], "log_probs": [], "means": []}
    )

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    def run_steps(self, transformers: Sequence[nn.Module], start: int, stop: int) -> None:
        """Denoising steps ``start``..``stop - 1``; ``start`` must be the next step not yet taken."""
        if not 1 <= len(transformers) <= 2:
            raise ValueError(f"expected 1 or 2 transformers, got {len(transformers)}")
        if start != self.next_step or not start <= stop <= self.num_steps:
            raise ValueError(
                f"run_steps({start}, {stop}): the next step is {self.next_step} of {self.num_steps}"
            )
        sde_step, recorded, rec = (
            bind_sde_step(self.sde_type, self.noise_level, self.sigmas),
            set(self.steps),
            self.records,
        )
        # flow_grpo_wan: every step takes the SDE (the last one too), only ``steps`` are recorded.
        all_noisy = self.sde_type == "flow_grpo_wan" and bool(recorded)
        condition, sigmas, x = self.condition, self.sigmas, self.x
        device = x.device
        pos = self.prompt_embeds.to(device)  # a no-op when they are there already
        neg = None if self.negative_embeds is None else self.negative_embeds.to(device)
        for i in range(start, stop):
            v = predict_velocity(
                transformers,
                x,
                self.timesteps[i],
                pos,
                neg,
                self.guidance_scales,
                self.routing,
                condition,
            )
            if i in recorded or all_noisy:
                step = sde_step(
                    *generated(condition, v, x), sigmas[i], sigmas[i + 1], generator=self.generator
                )
                x_in, x = x, step.prev_sample if condition is None else condition.full(step.prev_sample)
                if i in recorded:
                    rec["latents"].append(x_in)
                    rec["next"].append(x)
                    rec["log_probs"].append(step.log_prob)
                    if self.record_means:
                        rec["means"].append(step.mean)
            else:
                x = ode_step(v, x, sigmas[i], sigmas[i + 1])
                x = x if condition is None else condition.clean(x)
        self.x, self.next_step = x, stop

    def finish(self) -> Rollout:
        """The ``Rollout`` of the finished batch."""
        if self.next_step != self.num_steps:
            raise ValueError(f"finish() after step {self.next_step} of {self.num_steps}: run the rest first")
        x, steps, rec, sigmas = self.x, self.steps, self.records, self.sigmas
        batch = x.shape[0]
        k_idx = torch.tensor(steps, dtype=torch.long, device=x.device)
        empty = x.new_empty(batch, 0, *x.shape[1:])
        means = None
        if self.record_means:
            means = torch.stack(rec["means"], dim=1) if steps else generated(self.condition, empty)[0].clone()
        return Rollout(
            latents=torch.stack(rec["latents"], dim=1) if steps else empty,
            next_latents=torch.stack(rec["next"], dim=1) if steps else empty.clone(),
            log_probs=torch.stack(rec["log_probs"], dim=1) if steps else x.new_empty(batch, 0),
            timesteps=self.timesteps[k_idx],
            sigmas=sigmas[k_idx],
            sigma_next=sigmas[k_idx + 1],
            step_indices=steps,
            final_latents=x,
            means=means,
            schedule=sigmas,
        )


def expert_switch_step(num_steps: int, shift: float | FlowSchedule, routing, num_experts: int) -> int:
    """The first denoising step the low-noise expert takes (``num_steps`` when it takes none):
    steps before it route to ``transformers[0]``, steps from it on to ``transformers[1]``
    (timesteps fall monotonically). Computed from the sampler's own fp32 schedule and routing rule."""
    timesteps = flow_sigmas(num_steps, shift) * NUM_TRAIN_TIMESTEPS
    for i in range(num_steps):
        if _expert(routing, timesteps[i], num_experts) == 1:
            return i
    return num_steps


def compute_log_prob(
    transformers: Sequence[nn.Module],
    rollout: Rollout,
    k: int,
    prompt_embeds: Tensor,
    negative_embeds: Tensor | None,
    guidance_scales: float | Sequence[float],
    routing,
    noise_level: float,
    sde_type: str = "sde",
    condition: ImageCondition | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-prob (B,) of the stored ``next_latents[:, k]`` under the current weights, with the
    SDE mean (B, C, F, H, W) and std (B, 1, 1, 1, 1); differentiable through the transformer.

    ``prompt_embeds``/``negative_embeds`` must be the rollout's rows for the same samples
    (use ``Rollout.select`` for micro-batches), and so must ``condition``. With a first-frame
    condition the log-prob and mean cover the generated frames only.
    """
    v = predict_velocity(
        transformers,
        rollout.latents[:, k],
        rollout.timesteps[k],
        prompt_embeds,
        negative_embeds,
        guidance_scales,
        routing,
        condition,
    )
    v, latents, next_latents = generated(condition, v, rollout.latents[:, k], rollout.next_latents[:, k])
    step = bind_sde_step(sde_type, noise_level, rollout.schedule)(
        v, latents, rollout.sigmas[k], rollout.sigma_next[k], prev_sample=next_latents
    )
    return step.log_prob, step.mean, step.std
