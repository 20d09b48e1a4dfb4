"""The dry run and the real run refuse a bad input alike: the same ``error: ...`` line, exit code 2.

One table of bad inputs — the values the issue found accepted or diagnosed wrongly, a recipe with a
key given twice, an empty recipe, reward weights all 0, a misspelled reward option, a run name that leaves the output folder, a
broken ``transformer/config.json``, a truncated transformer safetensors — each fed to
``train_grpo.main`` twice in this process: with ``--dry-run``, and as the real run's startup (one gloo
rank, ``Trainer`` construction: it stops at the refusal, before any weights load or rollout). The two
``error:`` lines must be equal and name the key or the file. About 15 s on 2 cores.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "single_expert"


def _model_copy(root: Path, broken: str) -> Path:
    """The tiny single-expert folder with ``broken`` (a file inside it) damaged; the rest linked."""
    folder = root / "model"
    shutil.copytree(TINY, folder, copy_function=lambda src, dst: Path(dst).symlink_to(src))
    target = folder / broken
    data = target.read_bytes()
    target.unlink()
    target.write_bytes(data[: len(data) // 2] if broken.endswith(".safetensors") else b'{"num_layers": 2,')
    return folder


def _case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(flags, text the error line must hold)."""
    recipe = tmp_path / "r.yaml"
    if case == "height_0":
        return ["--rollout.height", "0"], "rollout.height must be > 0"
    if case == "num_frames_negative":
        return ["--rollout.num-frames", "-3"], "rollout.num_frames must be >= 1"
    if case == "guidance_nan":
        return ["--rollout.guidance-scale", "nan"], "rollout.guidance_scale must be a finite number, got nan"
    if case == "lr_inf":
        return ["--train.learning-rate", "inf"], "train.learning_rate must be a finite number, got inf"
    if case == "collective_timeout_0":
        return ["--run.collective-timeout-s", "0"], "run.collective_timeout_s must be > 0"
    if case == "keep_checkpoints_negative":
        return ["--train.keep-checkpoints", "-1"], "train.keep_checkpoints must be >= 0"
    if case == "all_reward_weights_0":
        return ["--reward.weights.jpeg_incompressibility", "0"], "every reward weight is 0"
    if case == "run_name_leaves_output_dir":
        return ["--run.name", "../../escaped"], "would put the run directory outside run.output_dir"
    if case == "key_given_twice":
        recipe.write_text("train:\n  learning_rate: 1.0e-4\n  learning_rate: 1.0\n")
        return ["--config", str(recipe)], f"{recipe}:3:3: the key 'learning_rate' is given twice"
    if case == "empty_recipe":
        recipe.write_text("# nothing yet\n")
        return ["--config", str(recipe)], f"{recipe}: the recipe is empty"
    if case == "reward_option_misspelled":
        recipe.write_text("reward:\n  weights: {pickscore: 1.0}\n  pickscore:\n    modle_path: /x\n")
        return ["--config", str(recipe)], (
            "unknown config key 'reward.pickscore.modle_path'; valid keys here: ['model_path', 'processor_path']"
        )
    if case == "list_as_a_key":
        recipe.write_text("train:\n  [1, 2]: 3\n")
        return ["--config", str(recipe)], f"{recipe}:2:3: a key must be a name, got a list"
    if case == "alias_bomb":
        lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
        lines += [f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")]
        recipe.write_text("\n".join(lines) + "\n")
        return ["--config", str(recipe)], f"{recipe}:2:8: YAML aliases (*a, of an anchor &a) are not read"
    if case == "config_is_a_directory":
        return ["--config", str(tmp_path)], f"config file {tmp_path} is a directory"
    if case == "height_1e6":
        return ["--rollout.height", "1000000"], "rollout.height must be <= 4096"
    if case == "prompt_file_is_a_directory":
        return ["--data.prompt-file", str(tmp_path)], f"prompt file {tmp_path} is a directory"
    if case == "broken_transformer_config":
        model = _model_copy(tmp_path, "transformer/config.json")
        return ["--model.path", str(model)], f"{model}/transformer/config.json is not valid JSON"
    if case == "truncated_safetensors":
        model = _model_copy(tmp_path, "transformer/diffusion_pytorch_model.safetensors")
        return [
            "--model.path",
            str(model),
        ], f"{model}/transformer/diffusion_pytorch_model.safetensors is truncated"
    raise AssertionError(case)


CASES = [
    "height_0",
    "num_frames_negative",
    "guidance_nan",
    "lr_inf",
    "collective_timeout_0",
    "keep_checkpoints_negative",
    "all_reward_weights_0",
    "run_name_leaves_output_dir",
    "key_given_twice",
    "empty_recipe",
    "reward_option_misspelled",
    "broken_transformer_config",
    "truncated_safetensors",
    "list_as_a_key",
    "alias_bomb",
    "config_is_a_directory",
    "height_1e6",
    "prompt_file_is_a_directory",
]


def _error_line(main, argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, err
    return code, lines[0]


@pytest.mark.parametrize("case", CASES)
def test_dry_run_and_real_run_refuse_alike(tmp_path, capsys, monkeypatch, case):
    import torch.distributed as dist

    import train_grpo

    flags, message = _case(tmp_path, case)
    base = ["--config", "configs/tiny_cpu.yaml", "--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan")]
    base += ["--run.output-dir", str(tmp_path / "runs"), "--run.name", "bad", "--run.wandb-mode", "disabled"]
    argv = [*base, "--run.no-progress", *flags]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dry_code, dry = _error_line(train_grpo.main, [*argv, "--dry-run", "--world-size", "1"], capsys)
    real_code, real = _error_line(train_grpo.main, argv, capsys)
    assert not dist.is_initialized()
    assert (dry_code, real_code) == (2, 2)
    assert dry == real and message in real, (dry, real)
    assert not (tmp_path / "runs").exists()  # refused before anything was written
