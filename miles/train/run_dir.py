"""What a launch may do with its run directory: resume it, refuse to overwrite it, or replace it.

A run directory that holds a previous run's results (checkpoints, ``metrics.jsonl`` rows, an
export) is resumed with ``train.resume`` (the default). With ``--train.no-resume`` the launch
refuses such a directory, naming it and the ways out — a fresh start would otherwise mix two runs:
its keep-last-K cleanup would delete the new checkpoints (the old run's steps are higher), its
metrics would follow the old ones, its export would overwrite the old one, and the next resume
would restart the old run. ``--train.overwrite`` (with ``--train.no-resume``) deletes what the
previous run wrote and starts afresh. Every rank runs :func:`check_run_dir` (it only reads), so
all of them refuse together before any weights load; rank 0 alone deletes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# What a run writes into its directory (docs/reliability.md); overwrite removes these only.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "export",
    "samples",
    "eval",
    "wandb",
    "wandb_run_id",
    "config.yaml",
)


def previous_run(run_dir: Path) -> list[str]:
    """The results of a previous run in ``run_dir``, described for a message (empty: none)."""
    found = []
    ckpts = run_dir / "checkpoints"
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) if ckpts.is_dir() else []
    if steps:
        found.append(f"checkpoints {', '.join(steps)}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and (rows := sum(1 for line in metrics.open() if line.strip())):
        found.append(f"metrics.jsonl with {rows} rows")
    if (run_dir / "export").exists():
        found.append("export/")
    return found


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Raise ``ValueError`` unless this launch may use ``run_dir`` as configured."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"the run directory {run_dir} is a file; choose another --run.name or --run.output-dir"
        )
    for parent in run_dir.parents:  # run.output_dir (or a folder above it) is a file: mkdir would fail
        if parent.exists() and not parent.is_dir():
            raise ValueError(
                f"{parent} is a file, so the run directory {run_dir} cannot be created; set "
                "--run.output-dir to a folder (or a path that does not exist yet)"
            )
    check_writable(run_dir)
    if resume or overwrite:
        return
    found = previous_run(run_dir)
    if found:
        raise ValueError(
            f"the run directory {run_dir} holds a previous run ({'; '.join(found)}) and "
            "--train.no-resume would mix a fresh run into it. Either resume it (drop --train.no-resume), "
            "start the new run in its own directory (--run.name NEW_NAME), or replace the previous run "
            "(--train.overwrite deletes its checkpoints, metrics, export, samples, eval and wandb files)"
        )


def check_writable(run_dir: Path) -> None:
    """Raise ``ValueError`` unless this process may write into ``run_dir`` (or create it): a read-only
    disk found now costs nothing, found at the first checkpoint it costs the training until then."""
    targets = [p for p in (run_dir, run_dir / "checkpoints") if p.is_dir()]
    if not targets:  # not created yet: the nearest folder above it must take it
        targets = [next(p for p in run_dir.absolute().parents if p.exists())]
    for path in targets:
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"{path} is not writable (a read-only disk or folder), so the run cannot save its "
                "checkpoints: set --run.output-dir to a writable folder, or fix the permissions"
            )


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete what a previous run wrote into ``run_dir`` (rank 0, with ``--train.overwrite``)."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
