"""Config loading: strict YAML, CLI overrides, the seed's flag names."""

from pathlib import Path

import pytest

from miles.config import Config, ConfigError, load_config_file, parse_args

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
        ("--train.learning-rate", "0", "train.learning_rate must be > 0"),
        ("--train.learning-rate", "-1e-5", "train.learning_rate must be > 0"),
        ("--train.max-grad-norm", "0", "train.max_grad_norm must be > 0"),
        ("--train.ema-decay", "1.0", "train.ema_decay must be in"),
        ("--eval.num-seeds", "0", "eval.num_seeds must be >= 1"),
    ],
)
def test_nonsense_numbers_are_refused(flag, value, message, capsys):
    # tyro reports the validation error of the config it builds and exits with 2
    with pytest.raises((ConfigError, SystemExit)):
        parse_args([flag, value])
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


def test_world_size_needs_dry_run(capsys):
    import train_grpo

    assert train_grpo.main(["--world-size", "8"]) == 2
    assert "--world-size is for --dry-run only" in capsys.readouterr().err
