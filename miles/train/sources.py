"""Where a step's latents come from, as the algorithm declares it (``Algorithm.batch_source``):

- ``rollout``: sampled by the policy (:class:`miles.train.collect.Collector`);
- ``videos``: the clean latents of a video dataset (:class:`VideoSource`), for supervised
  fine-tuning. ``data.prompt_file`` is a JSONL of ``{"video", "prompt"}`` (``miles.data.videos``):
  the run's prompt sampler deals its lines to the dp ranks as it deals prompts (its state is
  checkpointed: a resume continues the epoch), each line is repeated ``data.group_size`` times
  (each copy with its own noise level and noise), and each video is cut to the recipe's
  ``rollout.num_frames x height x width``, VAE-encoded (the latent distribution's mode, normalised by
  the VAE's ``latents_mean``/``latents_std``, as the decoder un-normalises) once and kept under
  ``<run>/sft_latents`` (``sft.cache_latents``). sp peers share their dp rank and so their videos:
  each encodes them (the cache is written atomically), so they train on the same latents.

The trainer asks ``batch_source(algorithm, collector)`` for its source and calls its ``collect``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from miles.data.videos import VideoItem, check_clips, load_clip, read_video_jsonl
from miles.models.dtypes import DTYPES
from miles.rollout.batch import MicroBatch, RolloutBatch, Scores
from miles.rollout.condition import conditions_of
from miles.train.collect import Collector, micro_slices, step_major_order

__all__ = ["CleanLatents", "VideoSource", "batch_source", "check_batch_source", "unscored"]


@dataclass
class CleanLatents:
    """A micro-batch's dataset latents, where a rollout keeps its sampled ones (``final_latents``)."""

    final_latents: Tensor  # (B, C, F, H, W) fp32, normalised as the sampler's latents are


def unscored(batch: RolloutBatch, dp_size: int) -> Scores:
    """The :class:`Scores` of a batch nothing scores (``Algorithm.uses_rewards`` False): zeros."""
    zeros = torch.zeros(batch.group_ids.numel() * dp_size)
    batch.advantages = torch.zeros(batch.group_ids.numel())
    return Scores(reward_all=zeros, shaped_all=zeros, per_reward_all={}, advantages_all=zeros)


class VideoSource:
    """The ``videos`` batch source: the collector's prompt sampler over a video JSONL."""

    def __init__(self, collector: Collector):
        self.collector = collector
        cfg = collector.cfg
        self.items: list[VideoItem] = read_video_jsonl(cfg.data.prompt_file)
        texts = [p.text for p in collector.prompts]
        if [i.prompt for i in self.items] != texts:
            raise ValueError(f"{cfg.data.prompt_file}: its prompts changed while the run was starting")
        self.cache_dir = (
            Path(cfg.run.output_dir) / cfg.run.name / "sft_latents" if cfg.sft.cache_latents else None
        )
        self.num_encoded = 0  # videos this rank encoded (not read back from the cache)

    def _key(self, item: VideoItem) -> str:
        r, stat = self.collector.cfg.rollout, item.video.stat()
        parts = (item.video.resolve(), stat.st_mtime_ns, stat.st_size, r.num_frames, r.height, r.width)
        return hashlib.sha1(repr((*parts, str(self.collector.model.path))).encode()).hexdigest()[:20]

    @torch.no_grad()
    def encode(self, item: VideoItem) -> Tensor:
        """The normalised latents (C, F', H', W') fp32 on the CPU of ``item``'s clip."""
        c, r = self.collector, self.collector.cfg.rollout
        clip = load_clip(item, r.num_frames, r.height, r.width)  # (F, 3, H, W) in [0, 1]
        z = c.model.encode_video(clip, c.device)
        self.num_encoded += 1
        return z.cpu()

    def latents(self, index: int) -> Tensor:
        """Item ``index``'s latents, from the cache where it holds them."""
        item = self.items[index]
        if self.cache_dir is None:
            return self.encode(item)
        path = self.cache_dir / f"{self._key(item)}.pt"
        if path.is_file():
            return torch.load(path, weights_only=True)
        z = self.encode(item)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(z, tmp)
        os.replace(tmp, path)  # sp peers may write the same file: each write is whole
        return z

    def collect(self, rollout_index: int) -> RolloutBatch:
        """This rank's share of the next lines, in the collector's sample order and micro-batches."""
        c, cfg = self.collector, self.collector.cfg
        groups = next(c.sampler)
        G = cfg.data.group_size
        ids = [g * G + i % G for i, g in enumerate(groups.group_ids)]  # global sample index
        order = step_major_order(cfg, len(ids))
        index = [groups.prompt_indices[i] for i in order]
        prompts = [c.prompts[i].text for i in index]
        images = [c.prompts[i].image for i in index]
        latents = {i: self.latents(i) for i in dict.fromkeys(index)}
        dtype = DTYPES[cfg.model.dtype]
        c.prompt_cache.start_rollout(prompts)
        neg = c.prompt_cache.negative().to(dtype)
        chunks, image_cache = [], {}
        for sl in micro_slices(cfg, len(prompts)):
            condition = None
            if c.model.condition_mode is not None:
                r = cfg.rollout
                size = dict(num_frames=r.num_frames, height=r.height, width=r.width)
                condition = conditions_of(c.model, images[sl], **size, device=c.device, cache=image_cache)
            x0 = torch.stack([latents[i] for i in index[sl]]).to(c.device)
            pos = c.prompt_cache.embeds(prompts[sl]).to(dtype)
            chunks.append(
                MicroBatch(slice=sl, pos=pos, neg=neg, rollout=CleanLatents(x0), condition=condition)
            )
        return RolloutBatch(
            prompts=prompts,
            images=images,
            group_ids=torch.as_tensor([groups.group_ids[i] for i in order]),
            sample_ids=torch.as_tensor([ids[i] for i in order]),
            rollout_index=rollout_index,
            chunks=chunks,
            sde_steps=[],
        )


def check_batch_source(cfg) -> None:
    """What the algorithm's batch source refuses before any weights load (the run plan calls it):
    for ``videos``, a JSONL line that is not valid or names a missing video, and every video opened
    by the check :class:`VideoSource` runs before decoding one (``check_clips``: unreadable, empty,
    too few frames, frames of mixed sizes), each ValueError naming its line."""
    from miles.algorithms import build_algorithm

    if build_algorithm(cfg).batch_source == "videos":
        check_clips(read_video_jsonl(cfg.data.prompt_file), cfg.rollout.num_frames)


def batch_source(algorithm, collector: Collector):
    """The source of the algorithm's batches: the collector itself, or a source built on it."""
    sources = {"rollout": lambda c: c, "videos": VideoSource}
    if algorithm.batch_source not in sources:
        raise ValueError(f"unknown batch source {algorithm.batch_source!r}; known: {sorted(sources)}")
    return sources[algorithm.batch_source](collector)
