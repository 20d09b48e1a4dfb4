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


def result_line(run_dir: Path, rollouts: int, step: int) -> str:
    """The finished run in one line (see the module docstring)."""
    parts = [f"{rollouts} rollouts, {step} steps"]
    rewards = [r["reward/mean"] for r in _rows(run_dir / "metrics.jsonl") if "reward/mean" in r]
    if rewards:
        parts.append(f"reward mean {rewards[0]:.4f} -> {rewards[-1]:.4f} (first and last rollout)")
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


# Flags of a fresh start, dropped from the resume command printed after a stop or a failure.
_FRESH_START_FLAGS = ("--train.no-resume", "--train.overwrite")


def resume_command(argv: list[str], script: str = "train_grpo.py") -> str:
    """The command that resumes the launch of ``argv`` (the script's flags, less those of a fresh
    start), as the user typed it: ``torchrun --nproc-per-node 4 train_grpo.py ...`` under torchrun
    (miles/launch.py: ``launch_prefix``)."""
    words = [*launch_prefix([script]), *(a for a in argv if a not in _FRESH_START_FLAGS)]
    return " ".join(shlex.quote(w) for w in words)


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
