"""What the CPU world benches (``clip_calibration.py``, ``overopt_guard.py``) share: one
``train_grpo.py`` run of a world config in one process (deterministic mode, no wandb, no progress
bar, a fresh run directory ``OUT/NAME``), its log beside it, and its JSON-lines files read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (``metrics.jsonl``, ``eval.jsonl``); none if it is absent."""
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def world_command(config: str, out: Path, name: str) -> list[str]:
    """``train_grpo.py --config CONFIG`` in deterministic mode writing a fresh run ``OUT/NAME``."""
    cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / config)]
    cmd += ["--deterministic-mode", "--run.wandb-mode", "disabled", "--run.no-progress"]
    cmd += ["--run.output-dir", str(out), "--run.name", name, "--train.no-resume", "--train.overwrite"]
    return cmd


def run_logged(cmd: list[str], port: int, log: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` from the checkout on ``MASTER_PORT`` ``port`` with one thread, its output kept
    in ``log``; returns the finished process (``stdout`` holds both streams) and its wall seconds."""
    env = {**os.environ, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(out.stdout)
    return out, time.time() - t0
