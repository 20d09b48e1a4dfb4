"""Config loading: strict YAML, CLI overrides, the seed's flag names."""

import re
from pathlib import Path

import pytest

from miles.config import Config, ConfigError, config_warnings, load_config_file, parse_args

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_every_recipe_loads():
    recipes = sorted((ROOT / "configs").glob("*.yaml"))
    assert recipes, "no recipes in configs/"
    for path in recipes:
        assert isinstance(load_config_file(path), Config), path


def test_unknown_key_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.learning_rat'"):
        load_config_file(_write(tmp_path, "train:\n  learning_rat: 0.1\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'"):
        load_config_file(_write(tmp_path, "trian:\n  learning_rate: 0.1\n"))


def test_wrong_type_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data.group_size: expected an integer, got float"):
        load_config_file(_write(tmp_path, "data:\n  group_size: 2.5\n"))
    with pytest.raises(ConfigError, match=r"parallel.deterministic_mode: expected true or false"):
        load_config_file(_write(tmp_path, "parallel:\n  deterministic_mode: 1\n"))
    with pytest.raises(ConfigError, match=r"model.dtype: 'fp17' is not one of"):
        load_config_file(_write(tmp_path, "model:\n  dtype: fp17\n"))


def test_number_as_string_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"train.learning_rate: expected a number, got str '3e-5'.*3.0e-5"):
        load_config_file(_write(tmp_path, "train:\n  learning_rate: 3e-5\n"))
    cfg = load_config_file(_write(tmp_path, "train:\n  learning_rate: 3.0e-5\n  max_grad_norm: 2\n"))
    assert cfg.train.learning_rate == 3.0e-5 and isinstance(cfg.train.max_grad_norm, float)


def test_semantic_validation(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_config_file(_write(tmp_path, "data:\n  group_size: 1\n"))
    with pytest.raises(ConfigError, match="reward.weights.x must be a finite"):
        load_config_file(_write(tmp_path, "reward:\n  weights: {x: .nan}\n"))


def test_cli_overrides_file_and_seed_flags(tmp_path):
    path = _write(tmp_path, "train:\n  learning_rate: 0.5\ndata:\n  group_size: 6\n")
    cfg, opts = parse_args(
        [
            "--config",
            str(path),
            "--train.learning-rate",
            "3e-5",
            "--sequence-parallel-size",
            "4",
            "--ulysses-degree",
            "2",
            "--fsdp-attention-backend",
            "_native_cudnn",
            "--deterministic-mode",
        ]
    )
    assert cfg.train.learning_rate == 3e-5  # the flag wins, and argparse-style 3e-5 is a float
    assert cfg.data.group_size == 6  # the file value survives
    p = cfg.parallel
    assert (p.sequence_parallel_size, p.ulysses_degree, p.fsdp_attention_backend, p.deterministic_mode) == (
        4,
        2,
        "_native_cudnn",
        True,
    )
    assert opts.config == str(path) and not opts.dry_run


def test_bad_cli_value_fails(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--sequence-parallel-size", "two"])


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--grpo.clip-range", "0", "grpo.clip_range must be > 0"),
        ("--grpo.clip-range", "-1e-4", "grpo.clip_range must be > 0"),
        ("--grpo.kl-beta", "-0.1", "grpo.kl_beta must be >= 0"),
        ("--grpo.adv-clip-max", "0", "grpo.adv_clip_max must be > 0"),
        ("--nft.kl-beta", "-0.1", "nft.kl_beta must be >= 0"),
        ("--train.learning-rate", "-1e-5", "train.learning_rate must be >= 0"),
        ("--train.max-grad-norm", "0", "train.max_grad_norm must be > 0"),
        ("--train.ema-decay", "1.0", "train.ema_decay must be < 1"),
        ("--eval.num-seeds", "0", "eval.num_seeds must be >= 1"),
    ],
)
def test_nonsense_numbers_are_refused(flag, value, message):
    # validated after tyro has built the config: a ConfigError like every other refusal
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([flag, value])


def test_world_size_needs_dry_run(capsys):
    import train_grpo

    assert train_grpo.main(["--world-size", "8"]) == 2
    assert "--world-size is for --dry-run only" in capsys.readouterr().err


def test_learning_rate_zero_is_a_warning_not_an_error():
    cfg, _ = parse_args(["--train.learning-rate", "0"])
    assert config_warnings(cfg) == ["learning rate 0: the weights will not change (train.learning_rate)"]
    assert config_warnings(parse_args([])[0]) == []


@pytest.mark.parametrize(
    "text,where",
    [
        ("train:\n  learning_rate: 1.0\n num_rollouts: 2\n", ":3:2: not valid YAML"),
        ("train: [1, 2\n", ":2:1: not valid YAML (while parsing a flow sequence"),
        ("train:\n\tnum_rollouts: 2\n", ":2:1: not valid YAML"),
    ],
)
def test_malformed_yaml_names_file_line_and_column(tmp_path, text, where):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert str(e.value).startswith(f"{path}{where}"), str(e.value)


def test_reward_weight_flags_add_and_change_rewards(tmp_path):
    recipe = _write(tmp_path, "reward:\n  weights: {world_adherence: 1.0}\n")
    cfg, _ = parse_args(["--config", str(recipe), "--reward.weights.sharpness", "0.5"])
    assert cfg.reward.weights == {"world_adherence": 1.0, "sharpness": 0.5}  # added to the recipe's
    cfg, _ = parse_args(
        [
            "--config",
            str(recipe),
            "--reward.weights.world-adherence=0",
            "--reward.weights.jpeg_compressibility",
            "-2",
        ]
    )
    assert cfg.reward.weights == {"world_adherence": 0.0, "jpeg_compressibility": -2.0}


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--reward.weights.sharpnes", "1"],
            "reward.weights names an unknown reward 'sharpnes'; registered rewards: [",
        ),
        (["--reward.weights.sharpness", "x"], "--reward.weights.sharpness: expected a number, got 'x'"),
        (["--reward.weights.sharpness"], "--reward.weights.sharpness needs a weight"),
        (["--reward.weights.sharpness", "inf"], "reward.weights.sharpness must be a finite number"),
    ],
)
def test_bad_reward_weight_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value), str(e.value)


def test_help_lists_launcher_flags_and_registered_rewards(capsys):
    from miles.rewards import registered_rewards

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = " ".join(re.sub(r"[│╭╮╰╯─]+", " ", capsys.readouterr().out).split())
    for flag in ("--config FILE", "--dry-run", "--world-size N", "--reward.weights.NAME WEIGHT"):
        assert flag in out, flag
    assert f"Registered rewards: {', '.join(registered_rewards())}." in out
    assert "Reward name -> weight" in out  # the field's own docstring is kept


def test_help_says_what_the_kl_beta_means(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(re.sub(r"[│╭╮╰╯─]+", " ", capsys.readouterr().out).split())
    for text in ("policy loss + β·KL", "(2σ_t²|dt|)", "its β is this β / |dt|", "β·mean((v − v_ref)²)"):
        assert text in out, text
