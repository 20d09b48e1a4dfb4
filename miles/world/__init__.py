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
    SHAPE_9,
    SHAPE_81,
    SIZES,
    Attributes,
    Shape,
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
PIPELINE_81_DIR = Path(__file__).with_name("pipeline_81")
"""The 81-frame world's pipeline: configs committed, weights from ``make world-model-81``."""

__all__ = [
    "COLOURS",
    "MOTIONS",
    "PIPELINE_81_DIR",
    "PIPELINE_DIR",
    "SHAPE_81",
    "SHAPE_9",
    "SIZES",
    "Attributes",
    "Shape",
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
