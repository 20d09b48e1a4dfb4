"""E2E topology bands through the real launcher: ``bench/e2e_bands.py --double-run`` into a tmp dir.

Five bands of the GRPO trainer (torchrun, 4 CPU processes, ``configs/tiny_bands.yaml``: sharpness
reward, deterministic mode), same global batch (8 prompt groups x 2 samples), 5 rollouts = 10
optimizer steps each: sp1 (dp4), u4r1 / u2r2 / u1r4 (dp1 x sp4), dp2xu2 (dp2 x sp2). Each band
runs a second time for 2 rollouts (4 steps), compared with the first run's step-4 checkpoint.

Asserted here from the script's exit code and its ``bands.json``:
- rollout-0 reward mean/std/min/max identical to every printed digit (4) across all bands —
  the bands sample the same rollouts; ring bands differ only by ~1e-7 rounding in fp32;
- the training trajectories agree across bands (every optimizer step trains the same global
  groups): reward mean of every rollout and grad norm of every step within 1e-3 relative
  (measured <= 2.4e-6: fp32 rounding; a change of a step's batch moves them by ~15%);
- the canary ``log_prob_mean_abs_diff`` flat in every band: every value <= 1e-4 and tail <=
  10 x head + 1e-6 (measured: exactly 0 on CPU fp32 in every band);
- deterministic double run: every metrics.jsonl value except wall-clock times, throughput and
  memory, and every tensor of the checkpoint (model and AdamW state), bitwise equal.
About 5 minutes on 2 cores (10 launches at ~12 s start-up each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BANDS = {"sp1", "u4r1", "u2r2", "u1r4", "dp2xu2"}


def test_e2e_bands_double_run(tmp_path):
    out = tmp_path / "bands"
    cmd = [sys.executable, "bench/e2e_bands.py", "--out", str(out), "--rollouts", "5"]
    cmd += ["--double-run", "--rerun-rollouts", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500, check=False)
    report = (out / "bands.md").read_text() if (out / "bands.md").exists() else proc.stdout[-5000:]
    assert proc.returncode == 0, f"e2e_bands failed (rc {proc.returncode}):\n{report}\n{proc.stderr[-5000:]}"

    summary = json.loads((out / "bands.json").read_text())
    assert summary["ok"] and all(c["ok"] for c in summary["checks"].values()), report
    assert summary["checks"]["trajectories_agree"]["ok"], report
    bands = {b["band"]: b for b in summary["bands"]}
    assert bands.keys() == BANDS and summary["global_prompts"] == 8
    reward0 = {json.dumps(b["reward0"], sort_keys=True) for b in bands.values()}
    assert len(reward0) == 1, f"rollout-0 reward statistics differ across bands: {reward0}"
    for name, b in bands.items():
        assert not b["errors"], f"{name}: {b['errors']}"
        assert b["optimizer_steps"] >= 10 and len(b["canary"]) == 5, name
        assert max(b["canary"]) <= 1e-4 and b["canary"][-1] <= 10 * b["canary"][0] + 1e-6, (name, b["canary"])
        d = b["double_run"]
        assert d["steps"] == 4 and d["metrics_equal"] and d["weights_equal"] and d["tensors"] > 0, (name, d)
        assert b["dp"] * b["sp"] == 4 and b["dp"] * b["prompts_per_rank"] == 8, name
    print(report)
