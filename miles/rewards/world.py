"""``world_adherence``: a rule-based reward for the tiny world (``miles.world``), GenEval-style.

    reward = build_rewards({"world_adherence": 1.0})
    combined, _ = reward(videos, ["a big red ball moving left", ...])  # videos (B, F, 3, H, W)

It reads decoded frames only, and checks each attribute of a prompt of the world's grammar
with soft rules that stay meaningful through a tiny VAE's blur:

- **Object.** On frames smoothed by a 3x3 box filter, the background of each frame is its
  per-channel median; a pixel's contrast d is its largest channel distance to it, the frame's
  peak P_t the mean of its 8 largest d, and the object mask m = ramp(d / P_t; 0.3, 0.7) (a
  soft threshold at half the peak, whose area a blur barely moves). Per frame,
  q_t = present · steady · single, with present = ramp(P_t; 0.08, 0.2) (an empty frame scores
  0); steady = ramp(P_t / max P; 0.5, 0.8) · ramp(A_t / median A; 0.5, 0.75), A_t = sum m (an
  object that fades or shrinks away mid-clip loses those frames); single = ramp(A_t^2 /
  (2 pi I_t); 0.45, 0.75), I_t = sum m r^2 about the mask's centroid (1 for a disc, about 0.2
  for two balls or a split blob). Quality Q = mean_t q_t.
- **Colour.** The mask-weighted (m^2 · q_t) mean RGB of the object; its hue
  h = atan2(sqrt(3)(G - B), 2R - G - B) is unchanged by blending with grey. With d_k the
  circular distance to palette colour k's hue (the palette's hues are >= 54 deg apart) and c
  the prompt's colour: colour = softmax_k(-d_k^2 / (2 · 12^2))[c] · exp(-(max(0, d_c - 15) /
  15)^2 / 2) · ramp(chroma; 0.05, 0.15) (degrees): nearest-palette classification, softened,
  times a check that the hue is near c at all (a cyan ball is neither green nor blue).
- **Motion.** The centroid track, fitted by least squares weighted by q_t, gives a velocity v
  (px/frame); with u the prompt's direction, motion = ramp(v.u; 0.5, 2.0) · ramp(cos(v, u);
  0.7, 0.95): a still, sideways or backwards ball scores 0 (the world moves 2.5-3.5 px/frame).
- **Size.** The q_t-weighted mean log area: big = sigmoid((log A - log A_mid) / 0.1), small
  = 1 - big, with A_mid = pi · 7.4^2: between the rendered discs (radius 9 and 5, geometric
  mean 6.7) and what a blurring VAE decodes them as (a small ball's half-peak area grows most).

    world_adherence = Q · (colour + motion + size) / 3          in [0, 1]

with ramp(x; a, b) = clamp((x - a) / (b - a), 0, 1). At another ``miles.world.Shape`` (read from
the videos: frames, height, width) the motion ramp's px/frame scale by ``Shape.speed_scale`` and
A_mid's radius by ``Shape.scale``, as the world's render scales the ball; at 9 x 64 x 64 both are 1
(bitwise the 9-frame reward). Rendered ground truth scores ~1, a prompt
wrong in every attribute ~0, each wrong attribute costs a third. Vectorised over the batch and
frames (no per-pixel Python); scores (B,) float32 on the videos' device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from miles.rewards.base import Reward, check_videos
from miles.rewards.registry import register_reward
from miles.world.world import DIRECTION, RGB, Shape, parse_prompt

_TOP_K = 8
_HUE_TOLERANCE_DEG = 15.0
_HUE_SIGMA_DEG = 12.0
_SIZE_TEMPERATURE = 0.1
_SIZE_MID_RADIUS = 7.4
"""Big vs small boundary (px): above the rendered discs' geometric-mean radius (6.7) because
blur inflates a small disc's half-peak area more than a big one's (the world VAE decodes
radius 5 at ~6.7 and radius 9 at ~9.6)."""
_LOG_AREA_MID = math.log(math.pi * _SIZE_MID_RADIUS**2)


def ramp(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """0 below ``lo``, 1 above ``hi``, linear between."""
    return ((x - lo) / (hi - lo)).clamp(0.0, 1.0)


def lower_median(x: torch.Tensor) -> torch.Tensor:
    """``x.median(dim=-1).values`` (the lower of the two middle values) through a sort: the same
    numbers, and deterministic on CUDA, where ``median`` with indices is refused in deterministic mode."""
    return x.sort(dim=-1).values[..., (x.shape[-1] - 1) // 2]


def hue_deg(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hue in degrees [0, 360), chroma) of RGB (..., 3); invariant to adding grey."""
    r, g, b = rgb.unbind(-1)
    a, c = 2 * r - g - b, math.sqrt(3) * (g - b)
    return torch.rad2deg(torch.atan2(c, a)) % 360.0, 0.5 * torch.hypot(a, c)


_PALETTE_HUE = {name: float(hue_deg(torch.tensor(rgb, dtype=torch.float64))[0]) for name, rgb in RGB.items()}


def _colour_score(rgb: torch.Tensor, colours: list[str]) -> torch.Tensor:
    """Soft colour check of object colours (B, 3) against the prompts' colour names: (B,)."""
    hue, chroma = hue_deg(rgb)
    palette = torch.tensor(list(_PALETTE_HUE.values()), dtype=hue.dtype, device=hue.device)  # (K,)
    dh = (hue[:, None] - palette[None, :]).abs() % 360.0
    dh = torch.minimum(dh, 360.0 - dh)  # (B, K) circular hue distance in degrees
    target = torch.tensor([list(_PALETTE_HUE).index(c) for c in colours], device=hue.device)
    p_target = torch.softmax(-0.5 * (dh / _HUE_SIGMA_DEG) ** 2, dim=1).gather(1, target[:, None])[:, 0]
    d_target = dh.gather(1, target[:, None])[:, 0]
    near = torch.exp(-0.5 * ((d_target - _HUE_TOLERANCE_DEG).clamp_min(0.0) / _HUE_TOLERANCE_DEG) ** 2)
    return p_target * near * ramp(chroma, 0.05, 0.15)


def _object_masks(frames: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-frame object masks and statistics of frames (B, F, 3, H, W)."""
    b, f, _, h, w = frames.shape
    # a 3x3 box filter first: pixel noise averages down, a disc's half-peak outline barely moves
    smooth = F.avg_pool2d(frames.flatten(0, 1), 3, stride=1, padding=1, count_include_pad=False)
    smooth = smooth.view_as(frames)
    background = lower_median(smooth.flatten(-2))  # (B, F, 3)
    d = (smooth - background[..., None, None]).abs().amax(dim=2)  # (B, F, H, W)
    peak = d.flatten(-2).topk(_TOP_K, dim=-1).values.mean(dim=-1)  # (B, F)
    m = ramp(d / peak.clamp_min(1e-3)[..., None, None], 0.3, 0.7)  # (B, F, H, W)
    area = m.sum(dim=(-2, -1))  # (B, F)
    ys = torch.arange(h, dtype=frames.dtype, device=frames.device).view(h, 1) + 0.5
    xs = torch.arange(w, dtype=frames.dtype, device=frames.device).view(1, w) + 0.5
    safe_area = area.clamp_min(1e-6)
    cx = (m * xs).sum(dim=(-2, -1)) / safe_area
    cy = (m * ys).sum(dim=(-2, -1)) / safe_area
    inertia = (m * ((xs - cx[..., None, None]) ** 2 + (ys - cy[..., None, None]) ** 2)).sum(dim=(-2, -1))
    compact = area**2 / (2 * math.pi * inertia.clamp_min(1e-6))
    present = ramp(peak, 0.08, 0.2)
    steady = ramp(peak / peak.amax(dim=1, keepdim=True).clamp_min(1e-6), 0.5, 0.8)
    steady = steady * ramp(area / lower_median(area)[:, None].clamp_min(1e-6), 0.5, 0.75)
    quality = present * steady * ramp(compact, 0.45, 0.75)  # (B, F)
    return {"mask": m, "area": area, "cx": cx, "cy": cy, "quality": quality}


def _velocity(cx: torch.Tensor, cy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted least-squares slope of the centroid track: (B, F) tracks -> (B, 2) px/frame."""
    t = torch.arange(cx.shape[1], dtype=cx.dtype, device=cx.device).expand_as(cx)
    wsum = weight.sum(dim=1, keepdim=True).clamp_min(1e-6)
    t_mean = (weight * t).sum(dim=1, keepdim=True) / wsum
    var = (weight * (t - t_mean) ** 2).sum(dim=1)
    slopes = []
    for c in (cx, cy):
        c_mean = (weight * c).sum(dim=1, keepdim=True) / wsum
        cov = (weight * (t - t_mean) * (c - c_mean)).sum(dim=1)
        slopes.append(torch.where(var > 1e-3, cov / var.clamp_min(1e-3), torch.zeros_like(cov)))
    return torch.stack(slopes, dim=-1)


def world_scores(videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per-check scores of videos (B, F, 3, H, W) in [0, 1] against world prompts, each (B,) float32.

    Keys: ``quality``, ``colour``, ``motion``, ``size`` and their combination ``adherence``
    (the module docstring has the formulas). ``ValueError`` for a prompt outside the grammar.
    """
    check_videos(videos, prompts)
    if videos.shape[-2] * videos.shape[-1] < _TOP_K:
        raise ValueError(
            f"world_adherence reads each frame's {_TOP_K} most contrasting pixels: frames of "
            f"{videos.shape[-2]}x{videos.shape[-1]} pixels are too small"
        )
    attrs = [parse_prompt(p) for p in prompts]
    shape = Shape(*videos.shape[1:2], *videos.shape[-2:])
    # on the videos' device: an 81 x 480 x 832 video is 97M values, seconds a sample on a CPU
    frames = videos.detach().float().clamp(0.0, 1.0)
    obj = _object_masks(frames)
    q = obj["quality"]  # (B, F)
    wq = q.sum(dim=1).clamp_min(1e-6)

    pixel_w = obj["mask"] ** 2 * q[..., None, None]  # (B, F, H, W)
    weight_sum = pixel_w.sum(dim=(1, 2, 3)).clamp_min(1e-6)
    rgb = (frames * pixel_w[:, :, None]).sum(dim=(1, 3, 4)) / weight_sum[:, None]  # (B, 3)
    colour = _colour_score(rgb, [a.colour for a in attrs])

    v = _velocity(obj["cx"], obj["cy"], q)  # (B, 2)
    u = torch.tensor([DIRECTION[a.motion] for a in attrs], dtype=v.dtype, device=v.device)
    along = (v * u).sum(dim=-1)
    cos = along / v.norm(dim=-1).clamp_min(1e-6)
    motion = ramp(along, 0.5 * shape.speed_scale, 2.0 * shape.speed_scale) * ramp(cos, 0.7, 0.95)

    log_area = (q * obj["area"].clamp_min(1.0).log()).sum(dim=1) / wq
    log_area_mid = _LOG_AREA_MID + 2 * math.log(shape.scale)  # log(pi (7.4 scale)^2)
    big = torch.sigmoid((log_area - log_area_mid) / _SIZE_TEMPERATURE)
    size = torch.where(torch.tensor([a.size == "big" for a in attrs], device=big.device), big, 1.0 - big)

    quality = q.mean(dim=1)
    scores = {"quality": quality, "colour": colour, "motion": motion, "size": size}
    scores["adherence"] = quality * (colour + motion + size) / 3.0
    return {k: s.float().to(videos.device) for k, s in scores.items()}


@register_reward("world_adherence")
class WorldAdherence(Reward):
    """How well a decoded video shows its world prompt (colour, motion, size, one steady ball), in [0, 1]."""

    name = "world_adherence"

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return world_scores(videos, prompts)["adherence"]
