"""The README as a newcomer runs it, and what a run tells at its start and end.

- The README says to activate ``.venv``; its ``miles.eval --checkpoint`` example names the checkpoint
  ``make e2e`` writes (the Makefile's rollouts × the recipe's optimizer steps per rollout).
- Its config-only-folders block, copied as written (the folder moved under ``tmp_path``), writes the
  folder and the dry run of the 1.3B recipe on it succeeds at 8 ranks.
- A dry run with three bad inputs (a missing prompt file, a missing held-out file, PickScore without
  its folder) lists all three in one refusal; one bad input reads as the real run's message.
- The dry run leaves diffusers' and transformers' progress bars off when stderr is not a terminal.
- The closing line of a run and the note for a relaunch of a finished one, from a planted run
  directory (values written by hand).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_says_to_activate_the_venv():
    assert "source .venv/bin/activate" in README


def test_readme_eval_example_names_the_checkpoint_make_e2e_writes():
    from miles.config import parse_args

    recipe = re.search(r"^e2e:.*?\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    flags = shlex.split(recipe.replace("\\\n", " "))
    flags = flags[flags.index("train_grpo.py") + 1 :]
    cfg, _ = parse_args(flags)
    step = cfg.train.num_rollouts * cfg.train.steps_per_rollout
    named = re.findall(r"miles\.eval .*--checkpoint \S+/step_(\d+)", README)
    assert named and all(int(n) == step for n in named), (named, step)


def _readme_block(marker: str) -> list[list[str]]:
    """The commands of the README's fenced block holding ``marker`` (continuations joined)."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if marker in b)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_readme_config_only_folders_then_dry_run(tmp_path, monkeypatch, capsys):
    import train_grpo
    from miles.models import config_folders

    write, dry = _readme_block("miles.models.config_folders")
    write = [str(tmp_path / a[5:]) if a.startswith("/tmp/") else a for a in write]
    dry = [str(tmp_path / a[5:]) if a.startswith("/tmp/") else a for a in dry]
    assert write[:3] == ["python", "-m", "miles.models.config_folders"] and dry[:2] == [
        "python",
        "train_grpo.py",
    ]
    monkeypatch.setattr(sys, "argv", write[2:])
    config_folders.main()
    monkeypatch.chdir(REPO)
    # As written: the recipe's prompt file and PickScore folders (model, processor) are missing here; each listed.
    assert train_grpo.main(dry[2:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 inputs the run would refuse") and "/data/prompts.txt" in err, err
    assert "reward.pickscore.model_path='/models/PickScore_v1' is not a folder" in err
    assert "reward.pickscore.processor_path='/models/CLIP-ViT-H-14-laion2B-s32B-b79K' is not a folder" in err
    # With them given as the README says: the plan.
    from miles.rewards.tiny_clip import tiny_clip

    # The dry run checks the reward folders as the reward loads them (stubs are refused): a whole one.
    pickscore = tiny_clip(tmp_path / "pickscore")
    given = ["--data.prompt-file", str(REPO / "miles" / "data" / "tiny_prompts.txt")]
    given += [
        "--reward.pickscore.model-path",
        str(pickscore),
        "--reward.pickscore.processor-path",
        str(pickscore),
    ]
    assert train_grpo.main([*dry[2:], *given]) == 0, capsys.readouterr().err
    assert "miles dry run" in capsys.readouterr().out


def test_dry_run_lists_every_refused_input_at_once(tmp_path, capsys):
    import train_grpo

    argv = ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--dry-run", "--world-size", "1"]
    argv += ["--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan"), "--run.output-dir", str(tmp_path)]
    missing = ["--data.prompt-file", str(tmp_path / "p.txt"), "--eval.prompt-file", str(tmp_path / "h.txt")]
    assert train_grpo.main([*argv, *missing, "--reward.weights.pickscore", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 inputs the run would refuse"), err
    for text in (
        f"{tmp_path}/p.txt",
        f"{tmp_path}/h.txt",
        "set reward.pickscore.model_path to a local folder",
    ):
        assert sum(text in line for line in err.splitlines() if line.startswith("  - ")) == 1, (text, err)
    assert train_grpo.main([*argv, "--data.prompt-file", str(tmp_path / "p.txt")]) == 2
    assert capsys.readouterr().err == f"error: prompt file not found: {tmp_path}/p.txt\n"


def test_dry_run_draws_no_library_bars_into_a_log(tmp_path, capsys):
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    import train_grpo

    diffusers_logging.enable_progress_bar()
    transformers_logging.enable_progress_bar()
    argv = ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--dry-run", "--world-size", "1"]
    assert train_grpo.main([*argv, "--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan")]) == 0
    assert not diffusers_logging.is_progress_bar_enabled()
    assert not transformers_logging.is_progress_bar_enabled()


def _plant_run(run_dir: Path) -> None:
    rows = [{"step": 1, "reward/mean": 0.25}, {"step": 2, "train/loss": 0.1}, {"step": 3, "reward/mean": 0.5}]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": 0, "eval/adherence/mean": 0.125}, {"step": 4, "eval/adherence/mean": 0.375}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000004" / "COMPLETE").write_text("4\n")
    (run_dir / "export" / "pipeline").mkdir(parents=True)


def test_result_line_and_finished_note(tmp_path):
    from miles.train.outcome import finished_note, result_line

    run_dir = tmp_path / "run"
    _plant_run(run_dir)
    assert result_line(run_dir, 2, 4) == (
        f"[miles] finished {run_dir}: 2 rollouts, 4 steps; reward mean 0.2500 -> 0.5000 (first and last "
        f"rollout); held-out adherence 0.1250 -> 0.3750; checkpoint {run_dir}/checkpoints/step_000004; "
        f"export {run_dir}/export/pipeline"
    )
    note = finished_note(run_dir, num_rollouts=2, export=True, rollouts_done=2, step=4)
    assert note.startswith(
        f"[miles] {run_dir} is finished (2 of 2 rollouts, step 4, exported): nothing to do"
    )
    assert finished_note(run_dir, num_rollouts=3, export=True, rollouts_done=2, step=4) is None
    (run_dir / "export" / "pipeline").rename(run_dir / "export" / "pipeline.partial")
    assert (
        finished_note(run_dir, num_rollouts=2, export=True, rollouts_done=2, step=4) is None
    )  # export again
    assert finished_note(run_dir, num_rollouts=2, export=False, rollouts_done=2, step=4) is not None


@pytest.mark.parametrize("flag", ["--train.no-resume"])
def test_the_resume_command_drops_the_fresh_start_flags(flag):
    from miles.train.reward_failure import reward_failed

    sys_argv = sys.argv
    sys.argv = ["train_grpo.py", "--config", "c.yaml", flag, "--train.overwrite"]
    try:
        message = str(reward_failed("down", 3, Path("runs/x/checkpoints/step_000003")))
    finally:
        sys.argv = sys_argv
    assert message.endswith("resume with the same command: python train_grpo.py --config c.yaml")
