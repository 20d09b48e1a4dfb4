"""Collect one rank's rollout: its prompt groups sampled in fixed micro-batches, with the SDE
steps, latents and log-probabilities the algorithm trains on (:class:`RolloutBatch`).

The noise of every sample is a function of the run seed, the rollout and the sample's global
index only, so dp4, dp2 x sp2 and sp4 draw the same videos; sp peers share their dp rank and so
share samples. The experts sample one at a time (``parallel.rollout_unsharded``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from miles.algorithms import Algorithm, Policy
from miles.config import Config
from miles.data.prompts import GroupSampler, Prompt
from miles.models.dtypes import DTYPES
from miles.models.family import FamilyModel, rollout_schedule
from miles.parallel.fsdp import unsharded_for_rollout
from miles.rollout.attention import rollout_attention
from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.condition import conditions_of
from miles.rollout.guidance import guidance_scales
from miles.rollout.precision import rollout_precision
from miles.rollout.prompt_cache import PromptCache
from miles.rollout.sampler import begin_sampling, expert_phases
from miles.rollout.schedule import FlowSchedule
from miles.train.overlap import DecodeAhead
from miles.train.stop import StopRequested, maybe_inject_signal

__all__ = [
    "Collector",
    "decode_ahead_for",
    "guidance_scales",
    "micro_slices",
    "run_generator",
    "step_major_order",
]


def run_generator(seed: int, *parts: int) -> torch.Generator:
    """A generator seeded from the run seed and ``parts``: same on every rank given the same parts."""
    g = torch.Generator(device="cpu")
    g.manual_seed(hash((seed, *parts)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def micro_slices(cfg: Config, n: int) -> list[slice]:
    """``n`` samples in micro-batches of ``train.micro_batch_size`` (the same in rollout and training)."""
    mb = cfg.train.micro_batch_size
    return [slice(i, i + mb) for i in range(0, n, mb)]


def _bar(items, desc: str, progress: bool):
    """An inner progress bar on rank 0 (cleared when done)."""
    return tqdm(items, desc=desc, leave=False, disable=not progress)


def step_major_order(cfg, n: int) -> list[int]:
    """The order of this rank's samples, so that consecutive optimizer steps take the same
    global samples in every dp layout.

    Samples arrive group by group. Each step takes the same slice of every group (sample i of
    a group goes to step i // (G / steps)), which depends on neither dp nor prompts_per_rank.
    If steps_per_rollout does not divide the group size, groups stay whole and consecutive
    ones go to consecutive steps (then the split depends on the dp layout).
    """
    steps, G = cfg.train.steps_per_rollout, cfg.data.group_size
    if G % steps:
        return list(range(n))
    per = G // steps
    groups = n // G
    return [j * G + m * per + i for m in range(steps) for j in range(groups) for i in range(per)]


def decode_ahead_for(
    cfg: Config, algorithm: Algorithm, model: FamilyModel, mesh, device
) -> DecodeAhead | None:
    """``rollout.overlap_decode``'s decoder for the collector, or None (off, or nothing is scored):
    this rank decodes ahead the micro-batches it scores (sp peers split them, as ``score`` does)."""
    if not (cfg.rollout.overlap_decode and algorithm.uses_rewards):
        return None
    sp, sp_rank = mesh.sp_size, mesh.sp_rank
    return DecodeAhead(model.decode, device, mine=lambda index: index % sp == sp_rank)


@dataclass
class Collector:
    """What collecting a rollout needs of the run; :meth:`collect` samples the next prompt groups."""

    cfg: Config
    model: FamilyModel
    algorithm: Algorithm
    policy: Policy
    prompts: list[Prompt]
    prompt_cache: PromptCache
    sampler: GroupSampler
    device: torch.device
    rank: int
    stop: Callable[[], bool]  # whether a stop was requested (the rollout is then abandoned)
    progress: bool = False
    rollout_index: int = 0
    # rollout.overlap_decode: called with each micro-batch's index and final latents as soon as they
    # are sampled (miles.train.overlap.DecodeAhead); what it returns is the micro-batch's ``video``.
    decode_ahead: Callable[[int, torch.Tensor], Any] | None = None

    @property
    def schedule(self) -> FlowSchedule:
        """The family's noise schedule at the rollout's size (as the plan's, ``rollout_schedule``)."""
        return rollout_schedule(self.model, self.cfg.rollout)

    def collect(self, rollout_index: int) -> RolloutBatch:
        """Sample this rank's prompt groups in fixed micro-batches; the noise of every sample is a
        function of its global index in the rollout batch only."""
        self.rollout_index = rollout_index
        cfg, r = self.cfg, self.cfg.rollout
        groups = next(self.sampler)
        G = cfg.data.group_size
        sample_ids = [g * G + i % G for i, g in enumerate(groups.group_ids)]  # global sample index
        order = step_major_order(cfg, len(sample_ids))
        prompts = [self.prompts[groups.prompt_indices[i]].text for i in order]
        images = [self.prompts[groups.prompt_indices[i]].image for i in order]
        image_cache: dict = {}  # each group's image is encoded once per rollout
        group_list = [groups.group_ids[i] for i in order]
        sample_ids = [sample_ids[i] for i in order]
        group_ids = torch.as_tensor(group_list)
        # The SDE steps are the same on every rank (so expert routing and FSDP's collectives match).
        sde_steps = self.algorithm.sde_steps(r.num_steps, run_generator(cfg.run.seed, 1, self.rollout_index))
        latent_shape = self.model.latent_shape(r.num_frames, r.height, r.width)
        init_noise, sde_gens = self._rollout_noise(group_list, sample_ids, latent_shape)
        dtype = DTYPES[cfg.model.dtype]
        # Each unique prompt is encoded once (CPU rows; the negative once per run), then the
        # micro-batches are sampled in fixed slices, so a sample's numbers do not depend on the
        # layout (or on dp), and training's recompute sees exactly the rollout's batch composition.
        self.prompt_cache.start_rollout(prompts)
        neg = self.prompt_cache.negative().to(dtype)
        runs = []
        for sl in micro_slices(cfg, len(prompts)):
            condition = None
            if self.model.condition_mode is not None:
                size = dict(num_frames=r.num_frames, height=r.height, width=r.width)
                condition = conditions_of(
                    self.model, images[sl], **size, device=self.device, cache=image_cache
                )
            runs.append(
                begin_sampling(
                    self.prompt_cache.embeds(prompts[sl]).to(dtype),
                    neg,
                    latent_shape,
                    num_steps=r.num_steps,
                    shift=self.schedule,
                    guidance_scales=guidance_scales(r, len(self.model.transformers)),
                    routing=self.model.routing,
                    noise_level=r.noise_level,
                    generator=sde_gens[sl],
                    latents=init_noise[sl].to(self.device),
                    sde_steps=sde_steps,
                    sde_type=r.sde_type,
                    record_means=self.algorithm.records_means,
                    condition=condition,
                    device=self.device,
                )
            )
        videos = self._sample_expert_at_a_time(runs)
        chunks = [
            MicroBatch(
                slice=sl,
                pos=run.prompt_embeds,
                neg=neg,
                rollout=run.finish(),
                condition=run.condition,
                video=video,
            )
            for sl, run, video in zip(micro_slices(cfg, len(prompts)), runs, videos)
        ]
        return RolloutBatch(
            prompts=prompts,
            images=images,  # each sample's first frame (None for text-to-video)
            group_ids=group_ids,
            sample_ids=torch.as_tensor(sample_ids),
            rollout_index=self.rollout_index,
            chunks=chunks,
            sde_steps=sde_steps,
        )

    def _rollout_noise(self, group_list: list[int], sample_ids: list[int], latent_shape) -> tuple:
        """Each sample's initial noise and SDE generator, keyed by its global index (its group's with
        ``rollout.same_noise_per_group``), so dp4, dp2 x sp2 and sp4 draw the same videos; sp peers
        share dp_rank and so share samples."""
        init_keys = group_list if self.cfg.rollout.same_noise_per_group else sample_ids
        init_noise = torch.stack(
            [
                torch.randn(
                    latent_shape, generator=run_generator(self.cfg.run.seed, 2, self.rollout_index, k)
                )
                for k in init_keys
            ]
        )
        return init_noise, [run_generator(self.cfg.run.seed, 3, self.rollout_index, k) for k in sample_ids]

    @torch.no_grad()
    def _sample_expert_at_a_time(self, runs: list) -> list:
        """Every micro-batch's steps of the high-noise expert with only that expert gathered
        (``parallel.rollout_unsharded``), then it is resharded and the low-noise expert takes every
        micro-batch's remaining steps: one expert's full weights on the GPU at a time. Bitwise the
        same as sampling each micro-batch start to finish (``SamplingRun``). Returns each
        micro-batch's ``decode_ahead`` handle (None without it), started as its last step is sampled."""
        videos = [None] * len(runs)
        cfg, r = self.cfg, self.cfg.rollout
        experts = self.algorithm.rollout_transformers(self.policy)
        phases = expert_phases(r.num_steps, self.schedule, self.model.routing, len(experts))
        for phase, (e, start, stop) in enumerate(phases):
            with (
                unsharded_for_rollout(
                    [experts[e]],
                    enabled=cfg.parallel.rollout_unsharded,
                    reshard_after_forward=cfg.parallel.reshard_after_forward,
                ),
                rollout_precision([experts[e]], r.precision),  # fp8: a float8 copy of the gathered expert
                rollout_attention([experts[e]], r.attention_precision),  # its self-attention's kernel
            ):
                desc = f"rollout expert {e + 1}/{len(experts)}"
                for mb, run in enumerate(_bar(runs, desc, self.progress)):
                    if phase == 0:
                        maybe_inject_signal(self.rank, self.rollout_index, mb)
                    if self.stop():  # nothing trained yet: abandon the rollout
                        raise StopRequested
                    run.run_steps(experts, start, stop)
                    if self.decode_ahead is not None and run.next_step == r.num_steps:
                        videos[mb] = self.decode_ahead(mb, run.x)
        return videos
