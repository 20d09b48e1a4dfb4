"""The reward interface and the frame helpers every reward shares.

A reward maps decoded videos ``(B, F, C, H, W)`` in [0, 1] and their prompts to one score per
video, ``(B,)`` float32. Image rewards (JPEG size, PickScore) score a few frames sampled
uniformly over time and average them: the same reduction flow_grpo-style video trainers use.
"""

from __future__ import annotations

import abc
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from miles.models.fingerprint import safetensors_header


class Reward(abc.ABC):
    """One scalar reward per video. Constructors validate and load their resources, so that
    ``build_rewards`` fails before the first rollout rather than after it."""

    name: str = ""
    needs_images: bool = False
    """Image-to-video rewards set this: ``MultiReward`` then passes each sample's condition image as
    the keyword ``images`` (a sequence of image files or (3, H, W) tensors in [0, 1], one per video)."""
    loads_weights: bool = False
    """Rewards whose ``check_resources`` returns the weight files or folders they load set this: the
    run plan estimates their device bytes from those files (:func:`weight_file_bytes`)."""

    @abc.abstractmethod
    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score ``videos`` (B, F, C, H, W) in [0, 1] against ``prompts`` (B,) -> (B,) float32."""

    def modules(self) -> list[nn.Module]:
        """The torch modules this reward keeps loaded (its scoring models): by default its
        ``nn.Module`` attributes. The trainer's memory budget counts their device bytes."""
        return [v for v in vars(self).values() if isinstance(v, nn.Module)]


def resident_bytes(rewards: Sequence[Reward], device: torch.device | str) -> int:
    """Bytes of the parameters and buffers that ``rewards`` keep on ``device``'s type, each tensor
    once (rewards may share a model)."""
    kind = torch.device(device).type
    seen: set[int] = set()
    total = 0
    for reward in rewards:
        for module in reward.modules():
            for t in (*module.parameters(), *module.buffers()):
                if t.device.type == kind and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _safetensors_numel(path: Path) -> int:
    """Elements of every tensor a safetensors file holds, from its JSON header (no tensor read; the
    header's length bounded and checked by :func:`miles.models.fingerprint.safetensors_header`)."""
    header = json.loads(safetensors_header(path))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def weight_file_bytes(paths: Sequence[str | os.PathLike] | str | os.PathLike, itemsize: int = 4) -> int:
    """Bytes on the device of the weights in ``paths`` (files, or folders searched recursively) once
    loaded in a dtype of ``itemsize`` bytes: safetensors counted by their headers' elements (a
    folder's ``.bin``/``.pt`` files then ignored: the same weights twice), other weight files by their
    size. The dry run's estimate of a reward model's :func:`resident_bytes`, loading nothing."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: set[Path] = set()
    for p in map(Path, paths):
        if p.is_dir():
            found = [f for f in p.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES]
            safetensors = [f for f in found if f.suffix == ".safetensors"]
            files.update(safetensors or found)
        elif p.is_file() and p.suffix in _WEIGHT_SUFFIXES:
            files.add(p)
    return sum(
        _safetensors_numel(f) * itemsize if f.suffix == ".safetensors" else f.stat().st_size
        for f in sorted(files)
    )


def check_videos(videos: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``videos`` is (B, F, 3, H, W) floating point, none of B, F, H, W 0,
    with B prompts."""
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or not videos.is_floating_point():
        got = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(
            f"rewards expect a float tensor of decoded frames (B, F, C, H, W) in [0, 1]; got {got}"
        )
    if videos.shape[2] != 3:
        raise ValueError(
            f"rewards expect RGB frames (C=3 at dim 2 of (B, F, C, H, W)); got shape {tuple(videos.shape)}"
        )
    if 0 in videos.shape:
        raise ValueError(
            f"rewards expect at least one video of at least one frame of at least 1x1 pixels; got shape "
            f"{tuple(videos.shape)}"
        )
    if isinstance(prompts, str) or len(prompts) != videos.shape[0]:
        n = "a str" if isinstance(prompts, str) else len(prompts)
        raise ValueError(f"rewards expect one prompt per video: {videos.shape[0]} videos but prompts is {n}")


def check_num_frames(num_frames: int | None) -> int | None:
    """Validate the ``num_frames`` option (a positive int, or None for every frame)."""
    if num_frames is not None and (
        isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1
    ):
        raise ValueError(
            f"reward.num_frames must be a positive int (or None for all frames); got {num_frames!r}"
        )
    return num_frames


def sample_frame_indices(num_total: int, num_samples: int | None) -> torch.Tensor:
    """Indices of ``num_samples`` frames spread uniformly over ``num_total``, first and last included.

    ``round(linspace(0, F - 1, K))``; with ``K >= F`` (or None) every frame is used once.
    """
    if num_total < 1:
        raise ValueError(f"cannot sample frames from a video with {num_total} frames")
    check_num_frames(num_samples)
    if num_samples is None or num_samples >= num_total:
        return torch.arange(num_total)
    return torch.linspace(0, num_total - 1, num_samples, dtype=torch.float64).round().long()


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """(..., C, H, W) float in [0, 1] -> (..., H, W, C) uint8 numpy, rounding as DDPO/flow_grpo do."""
    x = (frames.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    return x.movedim(-3, -1).cpu().numpy()
