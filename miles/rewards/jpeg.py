"""JPEG (in)compressibility rewards from DDPO (Black et al., 2023), applied to video frames.

Each sampled frame is encoded as JPEG (PIL, quality 95) and scored by its size in kB
(bytes / 1000, as in DDPO): ``-size`` rewards smooth, simple frames (compressibility), ``+size``
detailed, noisy ones (incompressibility). Departure from DDPO: a video scores the mean over
``num_frames`` frames sampled uniformly in time. Deterministic; needs no weights.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from miles.rewards.base import Reward, check_num_frames, check_videos, frames_to_uint8, sample_frame_indices
from miles.rewards.registry import register_reward

JPEG_QUALITY = 95


def jpeg_size_kb(frame: np.ndarray) -> float:
    """Size in kB of one (H, W, 3) uint8 frame encoded as JPEG at quality 95."""
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000


class _JpegSize(Reward):
    sign: float

    def __init__(self, num_frames: int | None = 4) -> None:
        self.num_frames = check_num_frames(num_frames)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        idx = sample_frame_indices(videos.shape[1], self.num_frames)
        frames = frames_to_uint8(videos[:, idx.to(videos.device)])  # (B, K, H, W, C)
        sizes = torch.tensor([[jpeg_size_kb(f) for f in video] for video in frames], dtype=torch.float64)
        return (self.sign * sizes.mean(dim=1)).float()


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """``-size_kB`` of the JPEG-encoded frames, averaged over sampled frames."""

    name = "jpeg_compressibility"
    sign = -1.0


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """``+size_kB`` of the JPEG-encoded frames, averaged over sampled frames."""

    name = "jpeg_incompressibility"
    sign = 1.0
