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
The script's 10 launches are made here as 2 (``tests/e2e/multi_run.py``): the first runs of every
band in the session's shared launch (``tests/e2e/conftest.py``), the second runs in one of their
own; the script's own analysis and report run unchanged on their outputs.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import pytest

import bench.e2e_bands as B
from tests.e2e.multi_run import launch_runs

pytestmark = pytest.mark.e2e

BANDS = {"sp1", "u4r1", "u2r2", "u1r4", "dp2xu2"}
NPROC = 4


def _train_flags(
    args, band: str, sp: int, ulysses: int, name: str, rollouts: int, ckpt_every: int
) -> list[str]:
    """The train_grpo.py flags of e2e_bands' launch of ``name``, recorded from its own ``launch``
    (without the output folder and run name, which ``launch_runs`` sets)."""
    recorded = []

    def record(cmd, **kwargs):
        recorded.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    with mock.patch.object(B.subprocess, "run", record):
        B.launch(args, band, sp, ulysses, name, rollouts, ckpt_every)
    (cmd,) = recorded
    flags = cmd[cmd.index("train_grpo.py") + 1 :]
    for key in ("--run.output-dir", "--run.name"):
        at = flags.index(key)
        del flags[at : at + 2]
    return flags


ARGV = ["--rollouts", "5", "--double-run", "--rerun-rollouts", "2"]


def _launches() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """e2e_bands' first runs and second runs (name: flags), as ``e2e_bands.run_band`` makes them
    (recorded into a scratch folder: ``launch`` clears the run folder it is about to fill)."""
    with tempfile.TemporaryDirectory() as scratch:
        args = B.parse_args(["--out", scratch, *ARGV])
        args.out = Path(scratch).resolve()
        # as run_band: the first run checkpoints where the second one ends
        ckpt_every = args.rerun_rollouts if args.rerun_rollouts < args.rollouts else 0
        firsts = {b: _train_flags(args, b, sp, u, b, args.rollouts, ckpt_every) for b, sp, u in B.BANDS}
        reruns = {
            f"{b}_rerun": _train_flags(args, b, sp, u, f"{b}_rerun", args.rerun_rollouts, 0)
            for b, sp, u in B.BANDS
        }
    return firsts, reruns


def SHARED_RUNS() -> dict[int, dict[str, list[str]]]:  # noqa: N802 (tests/e2e/conftest.py)
    """The first runs go into the session's shared 4-process launch."""
    return {NPROC: _launches()[0]}


def test_e2e_bands_double_run(shared_runs, shared_root):
    """``bench/e2e_bands.py --double-run``, its launches made as two torchrun launches: every band's
    first run in the session's shared launch, every second run in one launch of its own (so each
    double run still compares two processes); the script's analysis and report run unchanged."""
    out = shared_root.parent
    firsts, reruns = _launches()
    runs = {name: shared_runs[name] for name in firsts}
    runs.update(launch_runs(shared_root, reruns, nproc=NPROC, env={"WANDB_MODE": "disabled"}))

    def replay(args, band, sp, ulysses, name, rollouts, ckpt_every):
        assert runs[name].run_dir == args.out / "runs" / name
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
        (args.out / "logs" / f"{name}.log").write_text(runs[name].output)
        return 0, runs[name].output, runs[name].seconds

    with mock.patch.object(B, "launch", replay):
        code = B.main(["--out", str(out), *ARGV])
    report = (out / "bands.md").read_text() if (out / "bands.md").exists() else ""
    assert code == 0, f"e2e_bands failed:\n{report}"

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
