"""How a run ends, in one line: the result of a finished run, or that a relaunch has nothing to do.

:func:`result_line` reads what the run wrote (``metrics.jsonl``, ``eval.jsonl``, the checkpoints,
``export/``) and states it in one line, the last one of the log::

    [miles] finished runs/world_cpu: 10 rollouts, 20 steps; reward mean 0.3012 -> 0.4120 (first and last
    rollout); held-out world_adherence 0.2950 -> 0.3360; checkpoint runs/world_cpu/checkpoints/step_000020;
    export runs/world_cpu/export/pipeline

:func:`finished_note` tells a relaunch of a finished run (every rollout done, the export written when
asked for) that there is nothing to do, instead of evaluating again and appending a duplicate row.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from miles.launch import launch_prefix
from miles.train.checkpoint import latest_checkpoint


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _exported(run_dir: Path) -> list[Path]:
    root = run_dir / "export"
    return sorted(p for p in root.iterdir() if not p.name.endswith(".partial")) if root.is_dir() else []


def result_line(run_dir: Path, rollouts: int, step: int, uses_rewards: bool = True) -> str:
    """The finished run in one line (see the module docstring); an algorithm without rewards (SFT)
    states its loss instead."""
    parts = [f"{rollouts} rollouts, {step} steps"]
    rows = _rows(run_dir / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    if uses_rewards and rewards:
        parts.append(f"reward mean {rewards[0]:.4f} -> {rewards[-1]:.4f} (first and last rollout)")
    elif not uses_rewards and losses:
        parts.append(f"loss {losses[0]:.4e} -> {losses[-1]:.4e} (first and last step)")
    evals = _rows(run_dir / "eval.jsonl")
    if evals:
        first, last = evals[0], evals[-1]
        names = [k for k in last if k.startswith("eval/") and k.endswith("/mean")]
        shown = [f"{k[5:-5]} {first.get(k, float('nan')):.4f} -> {last[k]:.4f}" for k in names]
        if shown:
            parts.append("held-out " + ", ".join(shown))
    parts.append(f"checkpoint {latest_checkpoint(run_dir) or 'none'}")
    if exported := _exported(run_dir):
        parts.append("export " + ", ".join(map(str, exported)))
    return f"[miles] finished {run_dir}: " + "; ".join(parts)


def finished_note(
    run_dir: Path, num_rollouts: int, export: bool, rollouts_done: int, step: int
) -> str | None:
    """A relaunch of a finished run: the line that says so (None: there is work left)."""
    if rollouts_done < num_rollouts or (export and not _exported(run_dir)):
        return None
    return (
        f"[miles] {run_dir} is finished ({rollouts_done} of {num_rollouts} rollouts, step {step}"
        + (", exported" if export else "")
        + "): nothing to do. To train longer, relaunch with a larger --train.num-rollouts; to start "
        "afresh, use a new --run.name (or --train.no-resume --train.overwrite)"
    )


def finished_at_launch(cfg) -> str | None:
    """The :func:`finished_note` of a relaunch of a finished run, from its latest checkpoint's
    ``trainer.json`` before anything is built (no process group, no model, no wandb run: a relaunch
    says so in a second or two). None when there is work left, or the checkpoint is not whole (the
    trainer then resumes from the last good one, as always). A run directory another launch holds
    is refused first (``ValueError`` naming it), as the trainer refuses it."""
    from miles.files import verify_checkpoint
    from miles.train.run_dir import check_not_in_use

    if not cfg.train.resume or cfg.train.overwrite:
        return None
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    path = latest_checkpoint(run_dir)
    if path is None:
        return None
    check_not_in_use(run_dir)
    try:
        verify_checkpoint(path)  # the counters are read from a checkpoint whose bytes are as saved
        state = json.loads((path / "trainer.json").read_text())
        rollouts, step = int(state["rollout_index"]), int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return finished_note(run_dir, cfg.train.num_rollouts, cfg.train.export, rollouts, step)


# Flags of a fresh start, dropped from the resume command printed after a stop or a failure.
_FRESH_START_FLAGS = ("--train.no-resume", "--train.overwrite")


def resume_command(argv: list[str], script: str = "train_grpo.py") -> str:
    """The command that resumes the launch of ``argv`` (the script's flags, less those of a fresh
    start), as the user typed it: ``torchrun --nproc-per-node 4 train_grpo.py ...`` under torchrun
    (miles/launch.py: ``launch_prefix``). A secret never shows: a secret flag (the reward server's
    token) is left out, with a note to give the token through ``$MILES_REWARD_TOKEN`` (which the reward
    client reads) or that flag again, and any other occurrence of a known secret reads ``<redacted>``."""
    from miles.rewards.remote import TOKEN_ENV
    from miles.train.redact import redact_argv, secret_values, without_secret_flags

    kept, dropped = without_secret_flags([a for a in argv if a not in _FRESH_START_FLAGS])
    words = redact_argv([*launch_prefix([script]), *kept], secret_values())
    command = " ".join(shlex.quote(w) for w in words)
    if dropped:
        flags = ", ".join(dict.fromkeys(dropped))
        command += (
            f" (the reward server's token is not shown: export {TOKEN_ENV}=<token> before it, "
            f"or add {flags} <token> again)"
        )
    return command


def stopped_line(
    run_dir: Path, signal: str, step: int, rollouts: int, num_rollouts: int, argv: list[str]
) -> str:
    """What a stop request (``signal``) leaves: the latest checkpoint and the command that resumes."""
    path = latest_checkpoint(run_dir)
    return (
        f"[miles] stopped by {signal} after step {step} ({rollouts} of {num_rollouts} rollouts done); "
        f"the checkpoint is {path or 'none (nothing trained yet)'}. To resume, relaunch the same "
        f"command: {resume_command(argv)}"
    )
