"""Reward preflight: can GRPO get a signal from this reward on this model's samples?

GRPO learns from the differences between a prompt's samples (its advantages are normalised within
each group), so a reward is useful to it when, on the policy's own samples,

- it **spreads within groups** more than it **moves when the same video is scored again** (a
  stochastic judge, a remote scorer): the ratio of the mean within-group std to the re-scoring std;
- few groups have **zero spread** (every sample scored alike: no advantage, no gradient);
- it **responds to known degradations** of the same videos: a blur, the frames shuffled, a colour
  shift (the channels rolled RGB → GBR). A reward that does not fall under any of them cannot tell
  a worse video from a better one on those axes (it may still be what you want: say so).

This module takes decoded videos grouped by prompt and a reward (``MultiReward`` or
``EvalRewards``) and returns the numbers and a verdict per reward; ``python -m miles.preflight``
samples the prior and prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

ZERO_SPREAD = 1e-6
"""A group whose reward std is below this carries no advantage."""
MIN_SNR = 3.0
"""Within-group spread over re-scoring noise needed for a usable signal."""
MAX_ZERO_SPREAD_FRACTION = 0.5
"""Above this fraction of zero-spread groups, most of a rollout trains nothing."""
RESPONSE_Z = 3.0
"""A degradation "lowers" a reward when the mean drop is at least this many paired SEs."""


def blur(videos: torch.Tensor, kernel: int = 5) -> torch.Tensor:
    """A box blur of every frame (reflect-padded): (B, F, 3, H, W) -> same."""
    b, f, c, h, w = videos.shape
    x = F.pad(videos.reshape(b * f, c, h, w), (kernel // 2,) * 4, mode="reflect")
    return F.avg_pool2d(x, kernel, stride=1).reshape(b, f, c, h, w)


def shuffle_frames(videos: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The frames of every video in one fixed random order (not the identity)."""
    f = videos.shape[1]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(f, generator=g)
    while f > 1 and bool((order == torch.arange(f)).all()):
        order = torch.randperm(f, generator=g)
    return videos[:, order]


def colour_shift(videos: torch.Tensor) -> torch.Tensor:
    """The colour channels rolled (R, G, B) -> (G, B, R): every hue rotated by 120 degrees."""
    return videos.roll(-1, dims=2)


DEGRADATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "blur": blur,
    "frame_shuffle": shuffle_frames,
    "colour_shift": colour_shift,
}


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    x = x.double()
    n = x.numel()
    return float(x.mean()), float(x.std() / math.sqrt(n)) if n > 1 else 0.0


def score_all(
    reward, videos: torch.Tensor, prompts: Sequence[str], micro_batch: int
) -> dict[str, torch.Tensor]:
    """Every reward's (B,) scores of ``videos`` (scored ``micro_batch`` at a time), ``reward`` the combined."""
    rows: dict[str, list[torch.Tensor]] = {}
    for k in range(0, len(prompts), micro_batch):
        combined, per = reward(videos[k : k + micro_batch], list(prompts[k : k + micro_batch]))
        for name, v in {"reward": combined, **per}.items():
            rows.setdefault(name, []).append(v.detach().double().cpu())
    return {name: torch.cat(v) for name, v in rows.items()}


def preflight(
    reward,
    videos: torch.Tensor,
    prompts: Sequence[str],
    group_size: int,
    *,
    rescore: int = 2,
    micro_batch: int = 8,
) -> dict:
    """The preflight of ``reward`` on ``videos`` (B, F, 3, H, W) in [0, 1], consecutive runs of
    ``group_size`` samples sharing a prompt. Returns per reward: the mean, the within-group std,
    the re-scoring std, their ratio, the zero-spread fraction, each degradation's paired change
    and the verdict."""
    b = videos.shape[0]
    if b % group_size or b < 2 * group_size or group_size < 2:
        raise ValueError(
            f"preflight needs >= 2 whole groups of >= 2 samples, got {b} samples in groups of {group_size}"
        )
    first = score_all(reward, videos, prompts, micro_batch)
    again = [score_all(reward, videos, prompts, micro_batch) for _ in range(rescore)]
    degraded = {
        name: score_all(reward, fn(videos), prompts, micro_batch) for name, fn in DEGRADATIONS.items()
    }
    out = {}
    for name, s in first.items():
        groups = s.reshape(-1, group_size)
        within = groups.std(dim=1)
        repeats = torch.stack([s, *(a[name] for a in again)])  # (1 + rescore, B)
        noise = float(repeats.std(dim=0).pow(2).mean().sqrt()) if rescore else 0.0
        spread = float(within.mean())
        entry = {
            "mean": float(s.mean()),
            "within_group_std": spread,
            "rescore_std": noise,
            "snr": spread / noise if noise > 0 else (math.inf if spread > 0 else 0.0),
            "zero_spread_fraction": float((within < ZERO_SPREAD).double().mean()),
            "degradations": {},
        }
        for d, scores in degraded.items():
            change, se = _mean_se(scores[name] - s)
            entry["degradations"][d] = {
                "change": change,
                "se": se,
                "lowers": change < 0 and -change >= RESPONSE_Z * se,
            }
        entry["verdict"] = verdict(entry)
        out[name] = entry
    return {"num_samples": b, "group_size": group_size, "num_groups": b // group_size, "rewards": out}


def verdict(entry: dict) -> str:
    """One line: whether GRPO can learn from this reward, and what is wrong if not."""
    problems = []
    if entry["zero_spread_fraction"] > MAX_ZERO_SPREAD_FRACTION:
        problems.append(f"{entry['zero_spread_fraction']:.0%} of groups have zero spread")
    if entry["snr"] < MIN_SNR:
        problems.append(f"within-group spread is only {entry['snr']:.1f}x its re-scoring noise")
    deaf = [d for d, r in entry["degradations"].items() if not r["lowers"]]
    if problems:
        return "NO signal: " + "; ".join(problems)
    note = f" (does not fall under {', '.join(deaf)})" if deaf else ""
    return "signal: GRPO can learn from it" + note


def table(report: dict) -> str:
    """Markdown: one row per reward."""
    names = list(DEGRADATIONS)
    head = "| reward | mean | within-group std | re-scoring std | spread/noise | zero-spread groups | "
    head += " | ".join(f"{d} change (SE)" for d in names) + " | verdict |"
    lines = [
        f"Reward preflight: {report['num_groups']} groups of {report['group_size']} samples",
        "",
        head,
        "|" + "---|" * (7 + len(names)),
    ]
    for name, e in report["rewards"].items():
        degr = " | ".join(
            f"{e['degradations'][d]['change']:+.4f} ({e['degradations'][d]['se']:.4f})" for d in names
        )
        lines.append(
            f"| {name} | {e['mean']:.4f} | {e['within_group_std']:.4f} | {e['rescore_std']:.2g} | "
            f"{e['snr']:.3g} | {e['zero_spread_fraction']:.0%} | {degr} | {e['verdict']} |"
        )
    return "\n".join(lines) + "\n"
