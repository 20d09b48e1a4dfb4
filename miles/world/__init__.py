"""The tiny learnable world: procedural videos of one ball, a prompt grammar and a fixed split.

``miles.world.world`` renders the videos and holds the vocabulary and the train/held-out
split; ``miles.rewards.world`` scores decoded videos against prompts (``world_adherence``);
``python -m miles.pretrain_world OUT_DIR`` trains the tiny VAE and Wan prior on this world
(the committed result is ``miles/world/pipeline``).
"""

from pathlib import Path

from miles.world.world import (
    COLOURS,
    MOTIONS,
    SIZES,
    Attributes,
    all_attributes,
    heldout_prompts,
    is_heldout,
    parse_prompt,
    prompt_for,
    read_prompt_file,
    render,
    render_prompt,
    train_prompts,
)

PIPELINE_DIR = Path(__file__).with_name("pipeline")
"""The committed pretrained world pipeline (a diffusers Wan folder)."""

__all__ = [
    "COLOURS",
    "MOTIONS",
    "PIPELINE_DIR",
    "SIZES",
    "Attributes",
    "all_attributes",
    "heldout_prompts",
    "is_heldout",
    "parse_prompt",
    "prompt_for",
    "read_prompt_file",
    "render",
    "render_prompt",
    "train_prompts",
]
