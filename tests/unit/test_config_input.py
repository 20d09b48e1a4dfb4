"""What a user can write into a recipe or a flag is refused early, in one line that names it.

- YAML the strict loader did not expect: a list, a mapping or a number as a key (a TypeError before),
  nesting deeper than any recipe (a RecursionError), an alias bomb ("billion laughs": 133 s, then an
  object address as the message), an integer of thousands of digits, a recipe path that is a
  directory or a file far larger than a recipe; each a ``ConfigError`` naming the file and the line.
- Upper bounds: every numeric field (a dataclass walk, reward options included) refuses a huge value
  of either sign with its range, so a new field whose ``RANGES`` row has no upper bound fails here.
- Values legal but pointless: an AdamW step that zeroes every weight is refused; options the chosen
  setting never reads are warned about.
- The prompt file: a directory, too many lines, a line longer than any prompt; each refused before
  anything is tokenized.
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from pathlib import Path

import pytest

from miles.config import RANGES, Config, ConfigError, config_warnings, load_config_file, parse_args

REPO = Path(__file__).resolve().parents[2]

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)
)

YAML_CASES = {
    "list_key": ("train:\n  ? [1, 2]\n  : 3\n", "r.yaml:2:5: a key must be a name, got a list"),
    "mapping_key": ("{{a: 1}: 2}\n", "r.yaml:1:2: a key must be a name, got a mapping"),
    "number_key": ("train:\n  1: 3\n", "r.yaml:2:3: a key must be a name, got int 1"),
    "bool_key": ("reward:\n  weights:\n    on: 1.0\n", "r.yaml:3:5: a key must be a name, got bool True"),
    "deep_flow": ("train: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 16 levels deep"),
    "deep_block": (
        "".join("  " * i + f"k{i}:\n" for i in range(400)) + "  " * 400 + "x: 1\n",
        "r.yaml:16:31: nested more than 16 levels deep",
    ),
    "alias_bomb": (BOMB, "r.yaml:2:8: YAML aliases (*a, of an anchor &a) are not read in a recipe"),
    "alias_to_a_section": ("x: &t {num_rollouts: 2}\ntrain: *t\n", "YAML aliases (*t, of an anchor &t)"),
    "huge_integer": (
        "train:\n  num_rollouts: " + "9" * 5000 + "\n",
        "r.yaml:2:17: an integer of 5000 digits",
    ),
}


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_yaml_a_user_can_write_is_refused_in_one_line(tmp_path, case):
    text, message = YAML_CASES[case]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(recipe)])
    assert time.perf_counter() - start < 10  # the alias bomb took 133 s before
    assert message in str(info.value)
    assert "\n" not in str(info.value) and "0x" not in str(info.value)


def test_a_recipe_path_that_is_not_a_recipe(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory: give the path of a YAML"):
        load_config_file(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "nowhere.yaml")
    big = tmp_path / "big.yaml"
    big.write_text("train:\n  num_rollouts: 2\n" + "# padding\n" * 200_000)
    with pytest.raises(ConfigError, match=r"is 2000025 bytes; a recipe is a few KB \(at most 1048576\)"):
        load_config_file(big)


def _numeric_leaves(cls: type, prefix: str = "") -> dict[str, tuple[type, typing.Any]]:
    """dotted key -> (the number type, the field's container origin: None, list or dict)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            found.update(_numeric_leaves(tp, f"{key}."))
            continue
        container, stack = None, [tp]
        while stack:
            t = stack.pop()
            origin, args = typing.get_origin(t), typing.get_args(t)
            if origin in (list, dict):
                container = origin
            if origin in (typing.Union, types.UnionType, list, dict, typing.Annotated):
                stack += list(args[:1] if origin is typing.Annotated else args)
            elif t in (int, float):
                found[key] = (t, container)
    return found


LEAVES = _numeric_leaves(Config)


def test_every_range_is_bounded_on_both_sides():
    assert set(LEAVES) == set(RANGES)
    for key, (rule, _) in RANGES.items():
        assert rule[0] in "[(" and rule[-1] in "])", (key, rule)
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        assert -1e7 <= lo < hi <= 2**63, (key, rule)


@pytest.mark.parametrize("key", sorted(LEAVES))
@pytest.mark.parametrize("sign", [1, -1])
def test_every_numeric_field_refuses_a_huge_value_with_its_range(tmp_path, key, sign):
    tp, container = LEAVES[key]
    huge = sign * (10**30 if tp is int else 1e30)
    value = {None: huge, list: [huge, huge], dict: {"jpeg_incompressibility": huge}}[container]
    *sections, leaf = key.split(".")
    data: dict = {leaf: value}
    for section in reversed(sections):
        data = {section: data}
    recipe = tmp_path / "r.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config_file(recipe)
    message = str(info.value)
    rule = RANGES[key][0]
    assert f"{key}" in message and "must be" in message and rule in message, message
    assert len(message) < 400, message


def test_a_flag_with_a_huge_value_names_the_range():
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    with pytest.raises(
        ConfigError, match=r"rollout.height must be <= 4096 .*, got 1600000; its range is \(0, 4096\]"
    ):
        parse_args(["--config", tiny, "--rollout.height", "1600000"])
    with pytest.raises(
        ConfigError, match=r"train.num_rollouts must be <= 1e7, got 1000000000000000000000000000000"
    ):
        parse_args(["--config", tiny, "--train.num-rollouts", str(10**30)])
    with pytest.raises(
        ConfigError, match=r"train.learning_rate must be <= 1 .*, got 1e\+30; its range is \[0, 1\]$"
    ):
        parse_args(["--config", tiny, "--train.learning-rate", "1e30"])


def test_an_update_that_zeroes_every_weight_is_refused():
    with pytest.raises(ConfigError, match=r"train.learning_rate \* train.weight_decay = 1: AdamW multiplies"):
        parse_args(["--train.learning-rate", "0.1", "--train.weight-decay", "10"])
    parse_args(["--train.learning-rate", "0.1", "--train.weight-decay", "1"])


def test_options_the_chosen_setting_never_reads_are_warned_about():
    cfg, _ = parse_args(["--nft.beta", "0.5", "--model.lora-alpha", "8", "--rollout.tis-cap", "3"])
    warnings = config_warnings(cfg)
    assert (
        "nft.beta is set but never read: algorithm.name is flow_grpo; only diffusion_nft reads the nft section"
        in warnings
    )
    assert "model.lora_alpha is set but never read: model.lora_rank is 0 (a full fine-tune)" in warnings
    assert (
        "rollout.tis_cap is set but never read: rollout.precision and rollout.attention_precision are bf16 (no drift to correct)"
        in warnings
    )
    cfg, _ = parse_args(["--reward.pickscore.model-path", "/x"])
    assert config_warnings(cfg) == [
        "reward.pickscore.model_path is set but never read: pickscore is in neither reward.weights nor reward.gold"
    ]
    cfg, _ = parse_args(["--algorithm.name", "diffusion_nft", "--nft.beta", "0.5", "--model.lora-rank", "4"])
    assert config_warnings(cfg) == []
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        assert config_warnings(load_config_file(recipe)) == [], recipe


def test_a_prompt_file_that_is_not_one_is_refused_before_tokenizing(tmp_path):
    from miles.data.prompts import MAX_PROMPT_LINE_BYTES, MAX_PROMPTS, load_prompts

    with pytest.raises(ValueError, match=f"prompt file {tmp_path} is a directory: give a .txt"):
        load_prompts(tmp_path)
    many = tmp_path / "many.txt"
    many.write_bytes(b"a cat\n" * (MAX_PROMPTS + 1))
    with pytest.raises(ValueError, match=f"{many}: {MAX_PROMPTS + 1} lines; a prompt file may hold at most"):
        load_prompts(many)
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "a cat"}\n' + '{"prompt": "' + "x" * MAX_PROMPT_LINE_BYTES + '"}\n')
    with pytest.raises(ValueError, match=rf"{long}:2: a line of {MAX_PROMPT_LINE_BYTES + 14} bytes"):
        load_prompts(long)
    assert len(load_prompts(_write(tmp_path / "ok.txt", "a cat\n" * 1000))) == 1000


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_dry_run_world_size_is_bounded():
    for size in ("0", "100000000"):
        with pytest.raises(ConfigError, match=rf"--world-size must be in \[1, 65536\] ranks, got {size}"):
            parse_args(["--dry-run", "--world-size", size])
    parse_args(["--dry-run", "--world-size", "8"])


def test_a_video_jsonl_that_is_a_directory_says_so(tmp_path):
    from miles.data.videos import read_video_jsonl

    with pytest.raises(ValueError, match=f"video JSONL {tmp_path} is a directory"):
        read_video_jsonl(tmp_path)
