"""Bad input fails early, with a message that names the fix, and writes nothing.

Through the entry point (``train_grpo.main``; one case of each kind through a fresh ``python
train_grpo.py`` process, the others on the session's pooled gloo rank to spare a start-up each):

- config errors (unknown or mistyped key, wrong type, malformed YAML, group size < 2, a batch that
  does not split into micro-batches, a clip range <= 0, a negative KL weight or learning rate,
  ``--world-size`` without ``--dry-run``, an unknown reward or a bad weight in
  ``--reward.weights.NAME W``) exit with code 2 before torch.distributed starts;
- errors found while building the trainer (a model path that is not a diffusers Wan folder, a
  reward without its weights, an image-to-video reward for a text-to-video model, an empty, malformed or non-UTF-8 prompt file, fewer prompts than
  one rollout needs, a run path that is a file) exit with code 2 and the message, before the
  model is sharded or a rollout runs.

Neither leaves a run directory behind. Then, in-process on one gloo rank (``run_pooled``), a
NaN reward, a NaN loss and a NaN gradient each stop the run with ``NonFiniteError`` naming the
step and the last good checkpoint, and no checkpoint is written after it.
About 90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port, run_pooled

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = REPO / ".cache" / "tiny-wan"


# The cases that go through a fresh ``python train_grpo.py`` (one of each kind: the process's exit
# status and output); the others call its ``main`` on the session's pooled rank (``_main_body``),
# which is the same code minus the ~2-8 s start-up of a process.
THROUGH_A_PROCESS = {"unknown_flag", "model_path_missing", "every_checkpoint_corrupt"}


def _train(tmp_path: Path, case: str, *flags: str, config: str | Path = "configs/tiny_cpu.yaml"):
    """``train_grpo.py`` into ``tmp_path/runs/bad``; returns (exit status, flattened output)."""
    argv = ["--config", str(config), "--run.output-dir", str(tmp_path / "runs"), "--run.name", "bad"]
    argv += ["--run.wandb-mode", "disabled", "--run.no-progress", "--model.tiny-model-dir", str(TINY_DIR)]
    argv += flags
    if case in THROUGH_A_PROCESS:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MASTER_PORT": str(free_port())}
        cmd = [sys.executable, "train_grpo.py", *argv]
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        code, text = proc.returncode, proc.stdout + proc.stderr
    else:
        result = tmp_path / "main.json"
        run_pooled(_main_body, 1, argv, str(result))
        code, text = json.loads(result.read_text())
    # tyro draws its errors in a box and wraps them: drop the frame, join the lines.
    text = re.sub(r"[│╭╮╰╯─]+", " ", text)
    return code, " ".join(text.split())


def _main_body(rank: int, world_size: int, argv: list[str], result: str) -> None:
    """``train_grpo.main(argv)`` on this rank, its group kept: writes [exit status, output] to ``result``."""
    import contextlib
    import io

    import torch.distributed

    import train_grpo
    from tests.dist_utils import KeepGroup

    output = io.StringIO()
    train_grpo.dist = KeepGroup()
    cwd = os.getcwd()
    os.chdir(REPO)  # as the process runs: from the repository (relative recipe paths)
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                code = train_grpo.main(argv)
            except SystemExit as e:  # tyro's exit on a bad flag
                code = e.code
    finally:
        train_grpo.dist = torch.distributed
        os.chdir(cwd)
    Path(result).write_text(json.dumps([code, output.getvalue()]))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


CONFIG_ERRORS = {
    "unknown_key_in_file": (
        "train:\n  learning_rat: 1.0e-4\n",
        [],
        ["unknown config key 'train.learning_rat'", "learning_rate"],
    ),
    "unknown_flag": (
        None,
        ["--train.learning-rat", "1e-4"],
        ["--train.learning-rat", "--train.learning-rate"],
    ),
    "wrong_type_in_file": (
        "train:\n  num_rollouts: two\n",
        [],
        ["train.num_rollouts: expected an integer, got str 'two'"],
    ),
    "wrong_type_flag": (None, ["--train.num-rollouts", "two"], ["--train.num-rollouts", "'two'"]),
    "number_as_string": ("train:\n  learning_rate: 3e-5\n", [], ["write 3.0e-5"]),
    "group_size_1": (None, ["--data.group-size", "1"], ["data.group_size must be >= 2"]),
    "micro_batch_does_not_divide": (
        None,
        ["--train.micro-batch-size", "3"],
        ["8 samples per rank", "train.micro_batch_size = 3"],
    ),
    "clip_range_0": (None, ["--grpo.clip-range", "0"], ["grpo.clip_range must be > 0"]),
    "grpo_kl_beta_negative": (None, ["--grpo.kl-beta", "-0.01"], ["grpo.kl_beta must be >= 0"]),
    "nft_kl_beta_negative": (None, ["--nft.kl-beta", "-0.01"], ["nft.kl_beta must be >= 0"]),
    "learning_rate_negative": (
        None,
        ["--train.learning-rate", "-1e-5"],
        ["train.learning_rate must be >= 0"],
    ),
    "world_size_without_dry_run": (None, ["--world-size", "2"], ["--world-size is for --dry-run only"]),
    "malformed_yaml": (
        "train:\n  learning_rate: 1.0e-4\n num_rollouts: 2\n",
        [],
        ["{recipe}:3:2: not valid YAML (while parsing a block mapping"],
    ),
    "unknown_reward_flag": (
        None,
        ["--reward.weights.sharpnes", "1"],
        ["reward.weights names an unknown reward 'sharpnes'", "'sharpness'"],
    ),
    "reward_weight_flag_not_a_number": (
        None,
        ["--reward.weights.sharpness", "high"],
        ["--reward.weights.sharpness: expected a number, got 'high'"],
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_error_exits_2_naming_the_key(tmp_path, case):
    recipe, flags, messages = CONFIG_ERRORS[case]
    config = _write(tmp_path, "recipe.yaml", recipe) if recipe else "configs/tiny_cpu.yaml"
    code, out = _train(tmp_path, case, *flags, config=config)
    assert code == 2, out
    for message in messages:
        assert message.replace("{recipe}", str(config)) in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()


def _trainer_error(tmp_path: Path, case: str) -> tuple[list[str], list[str]]:
    """(flags, messages) of each error the trainer raises at construction."""
    if case == "model_path_not_wan":
        (tmp_path / "empty").mkdir()
        return ["--model.path", str(tmp_path / "empty")], ["has no model_index.json", "-Diffusers"]
    if case == "model_path_missing":
        return ["--model.path", str(tmp_path / "nowhere")], ["is not a folder", "diffusers Wan folder"]
    if case == "reward_weights_missing":
        # The flag adds pickscore to the recipe's rewards; there is no reward.pickscore.model_path.
        return ["--reward.weights.pickscore", "1"], ["set reward.pickscore.model_path to a local folder"]
    if case == "image_reward_for_text_model":
        return ["--reward.weights.world_i2v", "1"], ["given first frame", "model is text-to-video"]
    if case == "empty_prompt_file":
        prompts = _write(tmp_path, "prompts.txt", "\n  \n")
        return ["--data.prompt-file", str(prompts)], [f"{prompts}: no prompts in file"]
    if case == "malformed_prompt_file":
        prompts = _write(tmp_path, "prompts.jsonl", '{"prompt": "a cat"}\n{"prompt": \n')
        return ["--data.prompt-file", str(prompts)], [f"{prompts}:2: not valid JSON"]
    if case == "non_utf8_prompt_file":
        prompts = tmp_path / "prompts.txt"
        prompts.write_bytes("a cat\na caf\xe9 at night\n".encode("latin-1"))
        return ["--data.prompt-file", str(prompts)], [f"{prompts}:2: not UTF-8 text (byte 0xe9 at column 6)"]
    if case == "run_output_dir_is_a_file":
        output_dir = _write(tmp_path, "outputs", "not a folder")
        message = f"{output_dir} is a file, so the run directory {output_dir}/bad cannot be created"
        return ["--run.output-dir", str(output_dir)], [message]
    if case == "run_name_is_a_file":
        (tmp_path / "outputs").mkdir()
        run_dir = _write(tmp_path, "outputs/bad", "not a folder")
        return ["--run.output-dir", str(tmp_path / "outputs")], [f"the run directory {run_dir} is a file"]
    if case == "fewer_prompts_than_a_rollout":
        prompts = _write(tmp_path, "prompts.txt", "a cat\na dog\n")
        flags = ["--data.prompt-file", str(prompts), "--data.prompts-per-rank", "4"]
        return flags, ["2 prompts are fewer than one rollout needs", "add prompts to data.prompt_file"]
    raise AssertionError(case)


TRAINER_ERRORS = [
    "model_path_not_wan",
    "model_path_missing",
    "reward_weights_missing",
    "image_reward_for_text_model",
    "empty_prompt_file",
    "malformed_prompt_file",
    "non_utf8_prompt_file",
    "fewer_prompts_than_a_rollout",
    "run_output_dir_is_a_file",
    "run_name_is_a_file",
]


@pytest.mark.parametrize("case", TRAINER_ERRORS)
def test_trainer_error_exits_2_before_any_rollout(tmp_path, case):
    flags, messages = _trainer_error(tmp_path, case)
    code, out = _train(tmp_path, case, *flags)  # a later --config or --run.output-dir replaces the first
    assert code == 2, out
    for message in messages:
        assert message in out, out
    assert "[rollout" not in out and "checkpoint saved" not in out
    assert not (tmp_path / "runs").exists(), "a failed start left a run directory"


# ---------------------------------------------------------------------------------------------
# Resuming a checkpoint saved with another configuration: refused before any weights load (every
# key of RESUME_MUST_MATCH is compared in tests/unit/test_resume_checks.py; here, through the entry point).

# case -> (the saved config's changes as (dotted key, value), this launch's flags, messages)
RESUME_ERRORS = {
    "two_expert_checkpoint_resumed_single_expert": (
        [],
        ["--model.tiny-variant", "single_expert"],
        ["model.tiny_variant", "'two_expert'", "[--model.tiny-variant two_expert]"],
    ),
    "lora_checkpoint_resumed_as_full_fine_tune": (
        [("model.lora_rank", 4)],
        [],
        ["model.lora_rank (the LoRA adapters' shapes", "has 4, this launch 0", "[--model.lora-rank 4]"],
    ),
    "every_checkpoint_corrupt": (
        None,
        [],
        [
            "the checkpoint",
            "step_000002 is corrupt: its .metadata is not a DCP checkpoint index",
            "every checkpoint in",
        ],
    ),
}


def _plant_checkpoint(run_dir: Path, changes: list | None) -> None:
    """A complete-looking ``step_000002`` whose trainer.json holds this launch's config with ``changes``
    (its shards are never read: the config is compared first); None: garbage metadata instead."""
    import dataclasses
    import json

    from miles.config import parse_args

    cfg, _ = parse_args(["--config", str(REPO / "configs" / "tiny_cpu.yaml")])
    config = dataclasses.asdict(cfg)
    for key, value in changes or []:
        section, name = key.split(".")
        config[section][name] = value
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 2, "config": config}))
    (ckpt / ".metadata").write_bytes(b"not DCP metadata" if changes is None else b"")
    names = sorted(p.name for p in ckpt.iterdir())  # its SHA256SUMS, as every checkpoint has one
    sums = subprocess.run(["sha256sum", *names], cwd=ckpt, check=True, capture_output=True, text=True)
    (ckpt / "SHA256SUMS").write_text(sums.stdout)
    (ckpt / "COMPLETE").write_text("2\n")


@pytest.mark.parametrize("case", list(RESUME_ERRORS))
def test_resume_with_another_config_exits_2_naming_the_difference(tmp_path, case):
    changes, flags, messages = RESUME_ERRORS[case]
    run_dir = tmp_path / "runs" / "bad"
    _plant_checkpoint(run_dir, changes)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, out = _train(tmp_path, case, *flags)
    assert code == 2, out
    for message in messages:
        assert message in out, out
    assert "Traceback" not in out and "[rollout" not in out
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# ---------------------------------------------------------------------------------------------
# NaN / inf during training: one gloo rank, the real Trainer, one thing made non-finite.


def _config(out_dir: str):
    from miles.config import parse_args

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", "nan", "--run.wandb-mode", "disabled", "--run.no-progress"]
        + ["--model.tiny-model-dir", str(TINY_DIR), "--train.num-rollouts", "3"]
        + ["--train.steps-per-rollout", "2", "--train.checkpoint-every", "1", "--train.no-export"]
    )
    return cfg


def _nonfinite_body(rank, world_size, out_dir, where, bad_step, expect_step):
    """Train with ``where`` made non-finite during optimizer step ``bad_step`` (1-based)."""
    import torch

    import miles.algorithms.flow_grpo as A  # the algorithm forms the loss and the log-probs
    import miles.train.trainer as T

    trainer = T.Trainer(_config(out_dir))
    # Put back on exit: the body runs on ranks that serve later tests too (run_pooled).
    patched = {"grpo_policy_loss": A.grpo_policy_loss, "compute_log_prob": A.compute_log_prob}
    if where == "reward":
        score = trainer.rewards.inner  # the reward mix inside the trainer's failure guard

        def rewards(videos, prompts):
            combined, per_reward = score(videos, prompts)
            if trainer.step + 1 == bad_step:
                combined = combined.clone()
                combined[0] = float("nan")
            return combined, per_reward

        rewards.names = score.names
        trainer.rewards.inner = rewards
    elif where == "loss":
        loss_fn = A.grpo_policy_loss

        def loss(*args, **kwargs):
            out = loss_fn(*args, **kwargs)
            if trainer.step + 1 == bad_step:
                out.loss = out.loss + float("inf")
            return out

        A.grpo_policy_loss = loss
    elif where == "grad":
        log_prob_fn = A.compute_log_prob

        def log_prob(*args, **kwargs):
            lp, mean, std = log_prob_fn(*args, **kwargs)
            if trainer.step + 1 == bad_step and lp.requires_grad:
                lp.register_hook(lambda g: g * float("nan"))  # the loss stays finite
            return lp, mean, std

        A.compute_log_prob = log_prob
    try:
        trainer.train()
    except T.NonFiniteError as e:
        message = str(e)
    else:
        raise AssertionError(f"a non-finite {where} at step {bad_step} did not stop the run")
    finally:
        trainer.close()
        for name, fn in patched.items():
            setattr(A, name, fn)
    checkpoints = Path(out_dir) / "nan" / "checkpoints"
    good = f"step_{2 * ((bad_step - 1) // 2):06d}"  # the last rollout boundary before bad_step
    assert f"step {expect_step}" in message, message
    assert str(checkpoints / good) in message, message
    assert sorted(p.name for p in checkpoints.iterdir()) == [good], sorted(checkpoints.iterdir())
    # The kept checkpoint is finite.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoints / good, Path(out_dir) / "good.pt")
    model = torch.load(Path(out_dir) / "good.pt", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in model.values())


@pytest.mark.distributed
@pytest.mark.parametrize(
    "where, bad_step, expect_step",
    [
        ("reward", 3, 3),  # the rollout before optimizer step 3 scores a NaN
        ("loss", 4, 4),  # the second step of rollout 1
    ],
)
def test_nonfinite_stops_and_keeps_the_last_good_checkpoint(tmp_path, where, bad_step, expect_step):
    run_pooled(_nonfinite_body, 1, str(tmp_path), where, bad_step, expect_step)


@pytest.mark.distributed
def test_nonfinite_gradient_is_not_checkpointed(tmp_path):
    run_pooled(_nonfinite_body, 1, str(tmp_path), "grad", 4, 4)
