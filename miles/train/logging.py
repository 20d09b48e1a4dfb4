"""Rank-aware output: ``print0``, the run directory, and the metrics logger (wandb + JSONL, and
TensorBoard with ``run.tensorboard``: ``miles.train.tensorboard``).

Only rank 0 prints and logs; other ranks get a logger whose methods do nothing. wandb runs
offline by default (its files land in the run directory; ``wandb sync <run>/wandb/offline-run-*``
uploads them later) and online when the user sets ``--run.wandb-mode online``.
"""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

# rank-aware console helpers live a floor down (``python -m miles.eval`` uses them too); re-exported here
from miles.console import configure_library_progress, rank, show_progress  # noqa: F401


def print0(*args, sep: str = " ", file=None) -> None:
    """Print on rank 0 only, above any progress bar."""
    if rank() == 0:
        from tqdm import tqdm

        tqdm.write(sep.join(str(a) for a in args), file=file or sys.stdout)
        (file or sys.stdout).flush()


def _scalar(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    return float(v) if isinstance(v, (int, float, np.floating, np.integer)) else v


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's wandb run id: read from ``<run>/wandb_run_id``, or made and written there
    on the first launch, so that every resume logs into the same wandb run."""
    path = Path(run_dir) / WANDB_ID_FILE
    if path.is_file() and (run_id := path.read_text().strip()):
        return run_id
    run_id = secrets.token_hex(4)  # wandb's ids are lowercase letters and digits
    path.write_text(run_id + "\n")
    return run_id


class MetricsLogger:
    """Per-step metrics to ``metrics.jsonl`` in the run directory and to wandb (rank 0 only)."""

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        mode: str,
        project: str,
        name: str,
        enabled: bool,
        tensorboard: bool = False,
        secrets: Sequence[str] = (),
    ):
        """``config``: as saved (its secrets already redacted); ``secrets``: values kept out of the
        command line wandb records in its run metadata; ``tensorboard``: event files beside wandb."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        if tensorboard:
            from miles.train.tensorboard import TensorBoardLog

            self._tb = TensorBoardLog(self.run_dir / "tensorboard")
        if mode != "disabled":
            import wandb

            from miles.train.redact import argv_redacted

            with argv_redacted(secrets):  # wandb keeps sys.argv in its run files
                self._wandb = wandb.init(
                    project=project,
                    name=name,
                    dir=str(self.run_dir),
                    mode=mode,
                    config=config,
                    id=wandb_run_id(self.run_dir),
                    resume="allow",
                    # no history/summary panel at the end: the run's own result line is its last line
                    settings=wandb.Settings(quiet=True),
                )

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (a resumed run repeats those steps), evaluations too."""
        if not self.enabled:
            return
        self._jsonl.close()
        for path in (self.run_dir / "metrics.jsonl", self.run_dir / "eval.jsonl"):
            if path.is_file():
                lines = path.read_text().splitlines()
                rows = [line for line in lines if line and json.loads(line)["step"] <= step]
                path.write_text("".join(r + "\n" for r in rows))
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def log_eval(self, metrics: dict, step: int, grid: Path | None = None, caption: str = "") -> None:
        """One evaluation: a row of ``eval.jsonl`` and, in wandb, its metrics and video grid."""
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **{k: _scalar(v) for k, v in metrics.items()}}
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row, allow_nan=True) + "\n")
        if self._tb is not None:
            self._tb.scalars(row, step)
            if grid is not None:
                self._tb.video("eval/grid", grid, step, caption)
        if self._wandb is not None:
            import wandb

            extra = {"eval/grid": wandb.Video(str(grid), caption=caption)} if grid is not None else {}
            self._wandb.log(
                {**{k: v for k, v in row.items() if k not in ("step", "time")}, **extra}, step=step
            )

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **{k: _scalar(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row, allow_nan=True) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.scalars(row, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k not in ("step", "time")}, step=step)

    def log_videos(self, videos, prompts: list[str], rewards: list[float], step: int) -> None:
        """Videos — (B, F, 3, H, W) in [0, 1], or (F, H, W, 3) uint8 arrays (``to_uint8``'s) — as mp4
        files (GIF without an encoder) under ``samples/step_N`` with ``captions.json`` (prompt and
        reward of each), and in wandb."""
        if not self.enabled:
            return
        from miles.eval.videos import to_uint8, write_video

        out_dir = self.run_dir / "samples" / f"step_{step:06d}"
        out_dir.mkdir(parents=True, exist_ok=True)
        entries = []
        for i, (video, prompt, reward) in enumerate(zip(videos, prompts, rewards)):
            frames = video if isinstance(video, np.ndarray) else to_uint8(video)
            path = write_video(frames, out_dir / f"{i:02d}")
            entries.append((path, prompt, reward))
        with open(out_dir / "captions.json", "w") as f:
            json.dump([{"file": p.name, "prompt": pr, "reward": r} for p, pr, r in entries], f, indent=1)
        if self._tb is not None:
            for i, (p, pr, r) in enumerate(entries):
                self._tb.video(f"samples/{i:02d}", p, step, f"{pr} | {r:.4f}")
        if self._wandb is not None:
            import wandb

            self._wandb.log(
                {"samples": [wandb.Video(str(p), caption=f"{pr} | {r:.4f}") for p, pr, r in entries]},
                step=step,
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def is_finite(x: float) -> bool:
    return math.isfinite(x)


def rollout_line(
    rollout_index: int, step: int, rewards: torch.Tensor | None, first: dict, step_s: float
) -> str:
    """The console line of one rollout: its reward statistics (none for an algorithm without
    rewards: SFT) and its first optimizer step's loss, canaries and grad norm (``bench/e2e_bands.py``
    and the e2e tests read it)."""
    shown = [k for k in ("clipfrac", "old_deviation", "log_prob_mean_abs_diff", "tis_logp_gap") if k in first]
    stats = (
        ""
        if rewards is None
        else f"reward mean={float(rewards.mean()):.4f} std={float(rewards.std()):.4f} "
        f"min={float(rewards.min()):.4f} max={float(rewards.max()):.4f} "
    )
    return (
        f"[rollout {rollout_index}] step {step} {stats}"
        f"loss={first['loss']:.3e} "
        + "".join(f"{k}={first[k]:.3e} " for k in shown)
        + f"grad_norm={first['grad_norm']:.3e} step_time={step_s:.2f}s"
    )


def layout_line(trainer) -> str:
    """The run's layout, model and directory (the trainer prints it once)."""
    d, model, tokens = trainer.dims, trainer.model, trainer.num_tokens
    return (
        f"[miles] world {trainer.world_size} = dp {d.dp} x sp {d.sp} (ulysses {d.ulysses} x ring {d.ring}); "
        f"model {model.path} ({len(model.transformers)} expert(s), "
        f"{model.num_attention_heads} heads); {tokens} tokens/sample "
        f"({-(-tokens // d.sp)} per sp rank); attention backend "
        f"{trainer.attention_backend or 'default'}; run dir {trainer.run_dir}"
    )


def eval_line(step: int, metrics: dict, samples: int) -> str:
    """The console line of one held-out evaluation: every reward's mean."""
    means = " ".join(f"{k[5:-5]}={v:.4f}" for k, v in metrics.items() if k.endswith("/mean"))
    return f"[eval] step {step}: {means} ({samples} samples, {metrics['time/eval_s']:.1f}s)"
