"""How a run reads at its ends (issue 46): SFT's rollout line and result line state its loss (it has
no reward: ``reward mean=0.0000 std=0.0000`` read as a broken run); a relaunch of a finished run
says so before building anything (no model, no process group, no wandb run); transformers' notice
that CLIPImageProcessor falls back to PIL without torchvision is not printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_rollout_line_of_an_algorithm_without_rewards_shows_its_loss():
    from miles.train.logging import rollout_line

    first = {"loss": 0.125, "grad_norm": 2.0}
    line = rollout_line(3, 6, None, first, 1.5)
    assert line == "[rollout 3] step 6 loss=1.250e-01 grad_norm=2.000e+00 step_time=1.50s"
    with_rewards = rollout_line(3, 6, torch.tensor([0.25, 0.75]), first, 1.5)
    assert with_rewards.startswith(
        "[rollout 3] step 6 reward mean=0.5000 std=0.3536 min=0.2500 max=0.7500 loss="
    )


def test_result_line_of_sft_states_the_loss(tmp_path):
    from miles.train.outcome import result_line

    rows = [
        {"step": 1, "reward/mean": 0.0, "train/loss": 0.5},
        {"step": 2, "reward/mean": 0.0, "train/loss": 0.25},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = result_line(tmp_path, 1, 2, uses_rewards=False)
    assert "loss 5.0000e-01 -> 2.5000e-01 (first and last step)" in line and "reward" not in line


def _finished_run(root: Path, rollouts: int, step: int) -> None:
    ckpt = root / "done" / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(f"{step}\n")
    (ckpt / "trainer.json").write_text(json.dumps({"step": step, "rollout_index": rollouts}))


@pytest.mark.parametrize(("rollouts_done", "finished"), [(2, True), (1, False)])
def test_a_finished_run_is_said_before_anything_is_built(
    tmp_path, monkeypatch, capsys, rollouts_done, finished
):
    import miles.files
    import train_grpo

    _finished_run(tmp_path, rollouts_done, 2 * rollouts_done)
    monkeypatch.setattr(
        miles.files, "verify_checkpoint", lambda path: None
    )  # (its digests: tested elsewhere)

    class Built(Exception):
        pass

    def trap(cfg):
        raise Built

    import miles.train.trainer

    monkeypatch.setattr(miles.train.trainer, "Trainer", trap)
    argv = ["--config", "configs/tiny_cpu.yaml", "--run.output-dir", str(tmp_path), "--run.name", "done"]
    argv += ["--train.num-rollouts", "2", "--train.no-export", "--run.wandb-mode", "offline"]
    if finished:
        assert train_grpo.main(argv) == 0
        out = capsys.readouterr().out
        assert (
            out.strip()
            .splitlines()[-1]
            .startswith(f"[miles] {tmp_path / 'done'} is finished (2 of 2 rollouts")
        )
        assert not (tmp_path / "done" / "wandb").exists()
    else:
        with pytest.raises(Built):  # work left: the trainer is built as always
            train_grpo.main(argv)


def test_no_torchvision_notice():
    pytest.importorskip("transformers")
    if __import__("importlib").util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: there is no fallback to announce")
    code = "import miles, transformers; transformers.CLIPImageProcessor"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "requires torchvision" not in got.stderr, got.stderr


def test_every_recipe_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in readme.splitlines()
        if line.startswith("| `configs/")
    }
    assert {f"configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")} <= rows


def test_the_makefile_names_the_eval_files_the_trainer_writes():
    makefile = (REPO / "Makefile").read_text()
    assert "eval/step_N.gif" not in makefile and "eval/step_N.{json,mp4}" in makefile
