"""The tiny learnable world: one coloured ball moving on grey, rendered procedurally from a seed.

    from miles.world import Attributes, parse_prompt, prompt_for, render, train_prompts
    video = render(parse_prompt("a big red ball moving left"), seed=0)  # (9, 3, 64, 64) in [0, 1]

Videos are 64x64, 9 frames: one anti-aliased disc on a plain grey (0.5) background, moving
2.5-3.5 px a frame in a straight line and staying wholly inside the frame. The vocabulary is
colour x motion x size = 4 x 4 x 2 = 32 combinations, and prompts follow one grammar,
``"a {size} {colour} ball moving {motion}"``. Size is the third attribute because it survives a
tiny VAE; circle vs square did not (``../shared/DESIGN.md``).

The held-out split is a Latin-square pattern over the attribute indices (colour c, motion m,
size s, in the order of ``COLOURS``, ``MOTIONS``, ``SIZES``): a combination is held out iff
``m == (c + 2 s) mod 4``. That holds out 8 of 32 triples while every colour-motion,
colour-size and motion-size *pair* still appears in training: only the triples are new.
``prompts_train.txt`` and ``prompts_heldout.txt`` beside this file list the two splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

COLOURS = ("red", "green", "blue", "yellow")
MOTIONS = ("left", "right", "up", "down")
SIZES = ("big", "small")

NUM_FRAMES = 9
HEIGHT = WIDTH = 64
BACKGROUND = 0.5
"""The grey of the background, every channel."""
RGB = {
    "red": (0.90, 0.15, 0.15),
    "green": (0.15, 0.80, 0.20),
    "blue": (0.20, 0.30, 0.95),
    "yellow": (0.95, 0.85, 0.10),
}
RADIUS = {"big": 9.0, "small": 5.0}
"""Nominal disc radius in pixels; a seed jitters it by up to ``RADIUS_JITTER``."""
RADIUS_JITTER = 0.06
SPEED_RANGE = (2.5, 3.5)
"""Pixels a frame, drawn uniformly per seed."""
DIRECTION = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
"""Unit (dx, dy) in image coordinates (y grows downwards)."""
MARGIN = 2.0
"""Pixels kept free between the disc's edge and the frame's border on every frame."""

PROMPT_FILES = {
    "train": Path(__file__).with_name("prompts_train.txt"),
    "heldout": Path(__file__).with_name("prompts_heldout.txt"),
}


@dataclass(frozen=True)
class Attributes:
    """One combination of the vocabulary."""

    colour: str
    motion: str
    size: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("colour", self.colour, COLOURS),
            ("motion", self.motion, MOTIONS),
            ("size", self.size, SIZES),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; the world has {allowed}")


def prompt_for(attrs: Attributes) -> str:
    """The grammar's prompt for ``attrs``: ``"a big red ball moving left"``."""
    return f"a {attrs.size} {attrs.colour} ball moving {attrs.motion}"


def parse_prompt(text: str) -> Attributes:
    """Inverse of ``prompt_for``; ``ValueError`` naming the prompt if it is not of the grammar."""
    words = text.split() if isinstance(text, str) else []
    if (
        len(words) != 6
        or words[0] != "a"
        or words[3] != "ball"
        or words[4] != "moving"
        or words[1] not in SIZES
        or words[2] not in COLOURS
        or words[5] not in MOTIONS
        or " ".join(words) != text
    ):
        raise ValueError(
            f"prompt {text!r} is not of the world's grammar 'a {{size}} {{colour}} ball moving {{motion}}' "
            f"with size in {SIZES}, colour in {COLOURS}, motion in {MOTIONS}"
        )
    return Attributes(colour=words[2], motion=words[5], size=words[1])


def all_attributes() -> list[Attributes]:
    """The 32 combinations, colour-major, then motion, then size."""
    return [Attributes(c, m, s) for c in COLOURS for m in MOTIONS for s in SIZES]


def is_heldout(attrs: Attributes) -> bool:
    """The Latin-square rule: held out iff motion index == (colour index + 2 * size index) mod 4."""
    c, m, s = COLOURS.index(attrs.colour), MOTIONS.index(attrs.motion), SIZES.index(attrs.size)
    return m == (c + 2 * s) % len(MOTIONS)


def train_prompts() -> list[str]:
    """The 24 training prompts (the order of ``all_attributes``)."""
    return [prompt_for(a) for a in all_attributes() if not is_heldout(a)]


def heldout_prompts() -> list[str]:
    """The 8 held-out prompts that no training caption uses (the order of ``all_attributes``)."""
    return [prompt_for(a) for a in all_attributes() if is_heldout(a)]


def read_prompt_file(split: str) -> list[str]:
    """The committed ``prompts_{split}.txt`` (``split`` is ``train`` or ``heldout``), one prompt a line."""
    if split not in PROMPT_FILES:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(PROMPT_FILES)}")
    return [line for line in PROMPT_FILES[split].read_text().splitlines() if line.strip()]


def trajectory(attrs: Attributes, seed: int) -> tuple[np.ndarray, float]:
    """Disc centres (F, 2) as (x, y) in pixels, and the radius, for ``attrs`` and ``seed``.

    The seed draws the exact radius (within +-6%), the speed (2.5-3.5 px a frame) and the start,
    uniformly among the starts that keep the disc ``MARGIN`` px inside the frame on every frame.
    """
    rng = np.random.default_rng(seed)
    radius = RADIUS[attrs.size] * (1.0 + rng.uniform(-RADIUS_JITTER, RADIUS_JITTER))
    speed = rng.uniform(*SPEED_RANGE)
    travel = speed * (NUM_FRAMES - 1)
    lo, hi = radius + MARGIN, WIDTH - radius - MARGIN  # the square is HEIGHT = WIDTH
    direction = np.array(DIRECTION[attrs.motion])
    start = np.empty(2)
    for axis in range(2):
        d = direction[axis]
        # the moving axis must fit the whole travel; the other axis is free within [lo, hi]
        a, b = (lo + travel, hi) if d < 0 else (lo, hi - travel) if d > 0 else (lo, hi)
        start[axis] = rng.uniform(a, b)
    steps = np.arange(NUM_FRAMES)[:, None]
    return start + steps * speed * direction, float(radius)


def render(attrs: Attributes, seed: int) -> torch.Tensor:
    """The video of ``attrs`` for ``seed``: (F, 3, H, W) float32 in [0, 1], deterministic."""
    centres, radius = trajectory(attrs, seed)
    ys = torch.arange(HEIGHT, dtype=torch.float64) + 0.5  # pixel centres
    xs = torch.arange(WIDTH, dtype=torch.float64) + 0.5
    c = torch.from_numpy(centres)  # (F, 2)
    dist = torch.sqrt(
        (xs[None, None, :] - c[:, 0, None, None]) ** 2 + (ys[None, :, None] - c[:, 1, None, None]) ** 2
    )
    alpha = (radius + 0.5 - dist).clamp(0.0, 1.0)  # (F, H, W): a one-pixel anti-aliased edge
    colour = torch.tensor(RGB[attrs.colour], dtype=torch.float64).view(1, 3, 1, 1)
    video = BACKGROUND + alpha[:, None] * (colour - BACKGROUND)  # (F, 3, H, W)
    return video.float()


def render_prompt(prompt: str, seed: int) -> torch.Tensor:
    """``render(parse_prompt(prompt), seed)``."""
    return render(parse_prompt(prompt), seed)
