"""Every numeric config field is checked where it is read: finite and in range, by one table.

- every int/float field (also inside Optional, lists, mappings) has a row in ``miles.config.RANGES``,
  and every row names a field: a new numeric field without a range fails here;
- each value the issue found accepted (height 0, num_frames -3, NaN guidance, inf learning rate, ...)
  is refused with ``KEY must be RULE (why), got VALUE``, whether it comes from a flag or a recipe;
- a key given twice in a recipe, an empty recipe, reward weights all 0, run names that leave the
  output folder are refused; every shipped recipe still loads.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest

from miles.config import RANGES, Config, ConfigError, load_config_file, parse_args

REPO = Path(__file__).resolve().parents[2]


def _numeric_keys(cls: type, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    found = set()
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            found |= _numeric_keys(tp, f"{key}.")
            continue
        stack, leaves = [tp], set()
        while stack:
            t = stack.pop()
            args = typing.get_args(t)
            if typing.get_origin(t) in (typing.Union, types.UnionType, list, dict, typing.Annotated):
                stack += list(args[:1] if typing.get_origin(t) is typing.Annotated else args)
            else:
                leaves.add(t)
        if leaves & {int, float}:
            found.add(key)
    return found


def test_every_numeric_field_has_a_range_row():
    numeric = _numeric_keys(Config)
    assert numeric - set(RANGES) == set(), "numeric config fields without a RANGES row"
    assert set(RANGES) - numeric == set(), "RANGES rows that name no numeric field"


BAD_FLAGS = {
    "height_0": (["--rollout.height", "0"], "rollout.height must be > 0 (pixels, a multiple of 16), got 0"),
    "num_frames_negative": (["--rollout.num-frames", "-3"], "rollout.num_frames must be >= 1"),
    "max_sequence_length_0": (["--data.max-sequence-length", "0"], "data.max_sequence_length must be >= 1"),
    "shift_negative": (["--rollout.shift", "-3"], "rollout.shift must be > 0"),
    "noise_level_0": (["--rollout.noise-level", "0"], "rollout.noise_level must be > 0 with algorithm.name flow_grpo"),
    "adam_beta_1_5": (["--train.adam-betas", "0.9", "1.5"], "train.adam_betas[1] must be < 1 (AdamW's moment decays), got 1.5; its range is [0, 1)"),
    "weight_decay_negative": (["--train.weight-decay", "-1"], "train.weight_decay must be >= 0"),
    "collective_timeout_0": (["--run.collective-timeout-s", "0"], "run.collective_timeout_s must be > 0"),
    "lr_inf": (["--train.learning-rate", "inf"], "train.learning_rate must be a finite number, got inf"),
    "guidance_nan": (["--rollout.guidance-scale", "nan"], "rollout.guidance_scale must be a finite number, got nan"),
    "reward_num_frames_0": (["--reward.num-frames", "0"], "reward.num_frames must be >= 1"),
    "keep_checkpoints_negative": (["--train.keep-checkpoints", "-1"], "train.keep_checkpoints must be >= 0"),
    "checkpoint_every_negative": (["--train.checkpoint-every", "-1"], "train.checkpoint_every must be >= 0"),
    "reward_weight_nan": (["--reward.weights.jpeg_incompressibility", "nan"], "reward.weights.jpeg_incompressibility must be a finite number"),
    "all_reward_weights_0": (["--reward.weights.jpeg_incompressibility", "0"], "every reward weight is 0"),
    "run_name_leaves_output_dir": (["--run.name", "../elsewhere"], "run.name '../elsewhere' would put the run directory outside"),
    "run_name_absolute": (["--run.name", "/tmp/x"], "would put the run directory outside"),
    "ema_decay_1": (["--train.ema-decay", "1"], "train.ema_decay must be < 1 (0 turns the EMA off), got 1.0; its range is [0, 1)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_values_are_refused_naming_key_rule_and_value(case):
    flags, message = BAD_FLAGS[case]
    with pytest.raises((ConfigError, SystemExit)) as info:
        parse_args(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), *flags])
    assert info.type is ConfigError, "tyro exited instead of raising the config error"
    assert message in str(info.value)


def test_bad_values_in_a_recipe_too(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  guidance_scale: .nan\n")
    with pytest.raises(
        ConfigError, match=f"{recipe}: rollout.guidance_scale must be a finite number, got nan"
    ):
        load_config_file(recipe)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  learning_rate: 1.0e-4\n  num_rollouts: 2\n  learning_rate: 1.0\n")
    with pytest.raises(
        ConfigError, match=rf"{recipe}:4:3: the key 'learning_rate' is given twice .*first on line 2"
    ):
        load_config_file(recipe)
    recipe.write_text("train:\n  num_rollouts: 2\ntrain:\n  num_rollouts: 3\n")
    with pytest.raises(ConfigError, match="the key 'train' is given twice"):
        load_config_file(recipe)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_recipe_is_refused(tmp_path, text):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match="the recipe is empty"):
        load_config_file(recipe)


def test_every_shipped_recipe_loads_and_a_zero_weight_beside_a_trained_one_is_fine():
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        load_config_file(recipe)
    parse_args(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--reward.weights.sharpness", "0"])
    parse_args(["--run.name", "group/run_1"])
