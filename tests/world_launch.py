"""One torchrun launch of the tiny-world recipe (``configs/world_cpu.yaml``) at dp2, deterministic:
what the world tests (learning, held-out evaluation) share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch_world(root: Path, name: str, *flags: str, timeout_s: float = 900) -> Path:
    """Train ``configs/world_cpu.yaml`` on 2 processes with ``flags``; returns the run directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "0", "train_grpo.py", "--config", "configs/world_cpu.yaml"]
    cmd += ["--run.output-dir", str(root), "--run.name", name, "--run.wandb-mode", "disabled"]
    cmd += ["--run.no-progress", "--deterministic-mode", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / name
