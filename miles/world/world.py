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

**Shapes.** The same world renders at any ``Shape`` (frames, height, width): lengths (radius,
margin) scale with the short side (``Shape.scale`` = min(H, W) / 64) and the speed so that a ball
travels the same fraction of the frame over the clip (``Shape.speed_scale``). ``SHAPE_9`` (9 x 64 x
64) is the world every 9-frame result uses, bitwise as before shapes existed; ``SHAPE_81`` (81 x 480
x 832) is Wan2.1's: 21 x 60 x 104 latents after a 4x temporal / 8x spatial VAE, 32,760 tokens
after the 1 x 2 x 2 patch. ``miles.rewards.world`` reads the shape from the videos it scores.
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


@dataclass(frozen=True)
class Shape:
    """A video size of the world: its lengths and speeds scale with the frame (module docstring)."""

    num_frames: int = NUM_FRAMES
    height: int = HEIGHT
    width: int = WIDTH

    def __post_init__(self) -> None:
        if min(self.num_frames, self.height, self.width) < 1:
            raise ValueError(f"a world video needs >= 1 frame and sides >= 1 px, got {self}")

    @property
    def scale(self) -> float:
        """Pixels of this shape per pixel of the 64 x 64 world (the short side's ratio)."""
        return min(self.height, self.width) / min(HEIGHT, WIDTH)

    @property
    def speed_scale(self) -> float:
        """Speed factor: the ball crosses the same fraction of the frame over the whole clip."""
        return self.scale * (NUM_FRAMES - 1) / max(self.num_frames - 1, 1)


SHAPE_9 = Shape()
"""The 9-frame 64 x 64 world (every 9-frame result)."""
SHAPE_81 = Shape(81, 480, 832)
"""Wan2.1's 480p shape: 21 x 60 x 104 latents, 32,760 tokens a sample."""

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


def trajectory(attrs: Attributes, seed: int, shape: Shape = SHAPE_9) -> tuple[np.ndarray, float]:
    """Disc centres (F, 2) as (x, y) in pixels, and the radius, for ``attrs`` and ``seed``.

    The seed draws the exact radius (within +-6%), the speed (2.5-3.5 px a frame at ``SHAPE_9``,
    times ``shape.speed_scale``) and the start, uniformly among the starts that keep the disc
    ``MARGIN`` px (times ``shape.scale``) inside the frame on every frame.
    """
    rng = np.random.default_rng(seed)
    radius = RADIUS[attrs.size] * shape.scale * (1.0 + rng.uniform(-RADIUS_JITTER, RADIUS_JITTER))
    speed = rng.uniform(*SPEED_RANGE) * shape.speed_scale
    travel = speed * (shape.num_frames - 1)
    direction = np.array(DIRECTION[attrs.motion])
    start = np.empty(2)
    for axis, extent in enumerate((shape.width, shape.height)):
        lo, hi = radius + MARGIN * shape.scale, extent - radius - MARGIN * shape.scale
        d = direction[axis]
        # the moving axis must fit the whole travel; the other axis is free within [lo, hi]
        a, b = (lo + travel, hi) if d < 0 else (lo, hi - travel) if d > 0 else (lo, hi)
        start[axis] = rng.uniform(a, b)
    steps = np.arange(shape.num_frames)[:, None]
    return start + steps * speed * direction, float(radius)


def render(attrs: Attributes, seed: int, shape: Shape = SHAPE_9, device="cpu") -> torch.Tensor:
    """The video of ``attrs`` for ``seed``: (F, 3, H, W) float32 in [0, 1], deterministic, on ``device``
    (a GPU renders an 81-frame 480 x 832 video in milliseconds, a CPU in about a second)."""
    centres, radius = trajectory(attrs, seed, shape)
    ys = torch.arange(shape.height, dtype=torch.float64, device=device) + 0.5  # pixel centres
    xs = torch.arange(shape.width, dtype=torch.float64, device=device) + 0.5
    c = torch.from_numpy(centres).to(device)  # (F, 2)
    dist = torch.sqrt(
        (xs[None, None, :] - c[:, 0, None, None]) ** 2 + (ys[None, :, None] - c[:, 1, None, None]) ** 2
    )
    alpha = (radius + 0.5 - dist).clamp(0.0, 1.0)  # (F, H, W): a one-pixel anti-aliased edge
    colour = torch.tensor(RGB[attrs.colour], dtype=torch.float64, device=device).view(1, 3, 1, 1)
    video = BACKGROUND + alpha[:, None] * (colour - BACKGROUND)  # (F, 3, H, W)
    return video.float()


def render_prompt(prompt: str, seed: int, shape: Shape = SHAPE_9) -> torch.Tensor:
    """``render(parse_prompt(prompt), seed, shape)``."""
    return render(parse_prompt(prompt), seed, shape)
