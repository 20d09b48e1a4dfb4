"""``world_i2v``: the tiny world's rule reward for image-to-video, against each sample's given frame.

    reward = build_rewards({"world_i2v": 1.0})
    combined, _ = reward(videos, prompts, images=image_files)  # one first frame per video

The given frame (``miles.world.i2v``: frame 0 of a render) fixes the ball's colour, size and
start; the prompt's last word says its motion. The video is measured with ``world_adherence``'s
helpers (``miles.rewards.world``: soft object masks, per-frame quality Q, hue, q-weighted
centroid track) and the frame with the same helpers, as a one-frame video:

- **Colour.** The frame's ball is classified to the nearest palette hue; the video scores
  ``world_adherence``'s soft colour check against that colour.
- **Size.** Big iff the frame's ball area is above that of a disc of radius 6.7 px (the
  geometric mean of the rendered radii 5 and 9: the frame is crisp, not decoded); the video
  scores ``world_adherence``'s size check against that size.
- **Start.** The track of the generated frames 1..F-1 (least squares, q-weighted) is extrapolated
  back to frame 0; start = 1 - ramp(distance to the frame's ball; 2, 8) px (the world moves
  2.5-3.5 px a frame: a ball that jumps away from the given one, or appears elsewhere, scores 0).
- **Motion.** ``world_adherence``'s motion check of the same fitted velocity against the prompt's
  direction.

    world_i2v = Q · ((colour + size + start) / 3 + motion) / 2          in [0, 1]

Half consistency with the given frame, half the motion words. A rendered ground truth scores ~1,
a wrong direction alone ~0.5, a video wrong in everything ~0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from miles.rewards.base import Reward, check_videos
from miles.rewards.registry import register_reward
from miles.rewards.world import (
    _LOG_AREA_MID,
    _PALETTE_HUE,
    _colour_score,
    _object_masks,
    _velocity,
    hue_deg,
    ramp,
)
from miles.world.world import DIRECTION, RADIUS, parse_prompt

_FRAME_LOG_AREA_MID = math.log(math.pi * RADIUS["big"] * RADIUS["small"])
"""Big vs small on a crisp given frame: the area of a disc of radius sqrt(5 * 9) = 6.7 px."""
_START_RAMP_PX = (2.0, 8.0)


def _as_frames(images: Sequence, height: int, width: int) -> torch.Tensor:
    """Condition images (files, or (3, H, W) tensors in [0, 1]) -> (B, 1, 3, H, W) float32."""
    from PIL import Image

    frames = []
    for image in images:
        if isinstance(image, (str, Path)):
            with Image.open(image) as im:
                rgb = im.convert("RGB").resize((width, height), Image.BICUBIC)
                image = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
                image = image.view(height, width, 3).permute(2, 0, 1).float() / 255
        if not isinstance(image, torch.Tensor) or tuple(image.shape) != (3, height, width):
            got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(
                f"world_i2v expects condition images (3, {height}, {width}) or image files; got {got}"
            )
        frames.append(image.detach().float().cpu())
    return torch.stack(frames)[:, None]


def _given(frames: torch.Tensor) -> dict[str, object]:
    """Colour name, size name and centre of the ball on each given frame (B, 1, 3, H, W)."""
    obj = _object_masks(frames)
    w = obj["mask"][:, 0] ** 2  # (B, H, W)
    rgb = (frames[:, 0] * w[:, None]).sum(dim=(-2, -1)) / w.sum(dim=(-2, -1)).clamp_min(1e-6)[:, None]
    hue, _ = hue_deg(rgb)
    palette = torch.tensor(list(_PALETTE_HUE.values()), dtype=hue.dtype)
    dh = (hue[:, None] - palette[None, :]).abs() % 360.0
    nearest = torch.minimum(dh, 360.0 - dh).argmin(dim=1)
    colours = [list(_PALETTE_HUE)[k] for k in nearest.tolist()]
    big = obj["area"][:, 0].clamp_min(1.0).log() > _FRAME_LOG_AREA_MID
    centre = torch.stack([obj["cx"][:, 0], obj["cy"][:, 0]], dim=-1)  # (B, 2)
    return {"colours": colours, "big": big, "centre": centre}


def world_i2v_scores(
    videos: torch.Tensor, prompts: Sequence[str], images: Sequence
) -> dict[str, torch.Tensor]:
    """Per-check scores of videos (B, F, 3, H, W) in [0, 1] against their given first frames and
    the motion of their world prompts, each (B,) float32: ``quality``, ``colour``, ``size``,
    ``start``, ``motion`` and their combination ``i2v`` (the module docstring has the formulas)."""
    check_videos(videos, prompts)
    if len(images) != videos.shape[0]:
        raise ValueError(
            f"world_i2v needs one image per video: {videos.shape[0]} videos, {len(images)} images"
        )
    attrs = [parse_prompt(p) for p in prompts]
    frames = videos.detach().float().cpu().clamp(0.0, 1.0)
    given = _given(_as_frames(images, frames.shape[-2], frames.shape[-1]))
    obj = _object_masks(frames)
    q = obj["quality"]  # (B, F)

    pixel_w = obj["mask"] ** 2 * q[..., None, None]
    rgb = (frames * pixel_w[:, :, None]).sum(dim=(1, 3, 4)) / pixel_w.sum(dim=(1, 2, 3)).clamp_min(1e-6)[
        :, None
    ]
    colour = _colour_score(rgb, given["colours"])

    log_area = (q * obj["area"].clamp_min(1.0).log()).sum(dim=1) / q.sum(dim=1).clamp_min(1e-6)
    big = torch.sigmoid((log_area - _LOG_AREA_MID) / 0.1)
    size = torch.where(given["big"], big, 1.0 - big)

    # The generated frames' track, fitted without frame 0 (which an I2V model may copy from the
    # condition), extrapolated back to frame 0.
    wg = q.clone()
    wg[:, 0] = 0
    v = _velocity(obj["cx"], obj["cy"], wg)  # (B, 2) px/frame
    t = torch.arange(q.shape[1], dtype=q.dtype)
    wsum = wg.sum(dim=1).clamp_min(1e-6)
    mean_t = (wg * t).sum(dim=1) / wsum
    mean_c = torch.stack([(wg * obj[k]).sum(dim=1) / wsum for k in ("cx", "cy")], dim=-1)
    track0 = mean_c - mean_t[:, None] * v
    start = 1.0 - ramp((track0 - given["centre"]).norm(dim=-1), *_START_RAMP_PX)

    u = torch.tensor([DIRECTION[a.motion] for a in attrs], dtype=v.dtype)
    along = (v * u).sum(dim=-1)
    motion = ramp(along, 0.5, 2.0) * ramp(along / v.norm(dim=-1).clamp_min(1e-6), 0.7, 0.95)

    quality = q.mean(dim=1)
    scores = {"quality": quality, "colour": colour, "size": size, "start": start, "motion": motion}
    scores["i2v"] = quality * ((colour + size + start) / 3.0 + motion) / 2.0
    return {k: s.float().to(videos.device) for k, s in scores.items()}


@register_reward("world_i2v")
class WorldI2V(Reward):
    """How well a decoded video animates its given world frame as its prompt's motion, in [0, 1]."""

    name = "world_i2v"
    needs_images = True

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str], images: Sequence = ()) -> torch.Tensor:
        return world_i2v_scores(videos, prompts, images)["i2v"]
