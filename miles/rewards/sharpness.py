"""Sharpness: the mean absolute luminance gradient of the frames — a continuous, download-free reward.

Rewards detail and edges (and punishes blur), which is visible in the samples. Unlike the
JPEG rewards it is a smooth function of the pixels (no 8-bit quantisation, no entropy coder),
so two layouts whose decoded frames differ by float rounding score the same to many digits:
the tiny recipe's band comparisons use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles.rewards.base import Reward, check_num_frames, check_videos, sample_frame_indices
from miles.rewards.registry import register_reward

_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601


def sharpness(frames: torch.Tensor) -> torch.Tensor:
    """Mean |dY/dx| + |dY/dy| of frames (..., 3, H, W) in [0, 1], over all leading frames; float64."""
    y = torch.einsum("...chw,c->...hw", frames.double(), torch.tensor(_LUMA, dtype=torch.float64))
    dx = (y[..., :, 1:] - y[..., :, :-1]).abs().mean(dim=(-2, -1))
    dy = (y[..., 1:, :] - y[..., :-1, :]).abs().mean(dim=(-2, -1))
    return dx + dy


@register_reward("sharpness")
class Sharpness(Reward):
    """Mean absolute luminance gradient over uniformly sampled frames (x10, to read like kB)."""

    name = "sharpness"

    def __init__(self, num_frames: int | None = 4) -> None:
        self.num_frames = check_num_frames(num_frames)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        idx = sample_frame_indices(videos.shape[1], self.num_frames).to(videos.device)
        return (10.0 * sharpness(videos[:, idx].cpu()).mean(dim=1)).float().to(videos.device)
