"""The over-optimisation guard on a world built to over-optimise (CPU): ``configs/world_overopt_cpu.yaml``
trains on JPEG compressibility with ``world_adherence`` as the gold reward on the held-out prompts.

    python bench/overopt_guard.py --out docs/learning/guard --actions stop warn --num-rollouts 10
    python bench/overopt_guard.py --out OUT --config configs/world_cpu.yaml --actions warn --num-rollouts 10  # control

Each action is one run of ``train_grpo.py`` (one process, deterministic mode): DiffusionNFT at lr 3e-4,
held-out evaluation every 2 rollouts (8 prompts x 1 seed), a checkpoint at each. ``stop`` ends at the
guard's firing; ``warn`` trains on to ``--num-rollouts`` (the same run up to the firing: same seeds).
Writes ``OUT/overopt_guard.json``: per run the training reward per rollout, every evaluation (trained
and gold held-out means), the guard's line, the outcome line, the steps trained.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--actions", nargs="+", default=["stop"])
    ap.add_argument("--num-rollouts", type=int, default=12)
    ap.add_argument(
        "--config", default="configs/world_overopt_cpu.yaml", help="the control: configs/world_cpu.yaml"
    )
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "overopt_guard.json"
    runs = json.loads(saved.read_text())["runs"] if saved.is_file() else {}
    for i, action in enumerate(args.actions):
        name = f"guard_{action}"
        cmd = [
            sys.executable,
            str(ROOT / "train_grpo.py"),
            "--config",
            str(ROOT / args.config),
        ]
        cmd += ["--deterministic-mode", "--run.wandb-mode", "disabled", "--run.no-progress"]
        cmd += [
            "--run.output-dir",
            str(args.out),
            "--run.name",
            name,
            "--train.no-resume",
            "--train.overwrite",
        ]
        cmd += ["--algorithm.name", "diffusion_nft", "--train.learning-rate", "3e-4"]
        cmd += ["--train.num-rollouts", str(args.num_rollouts), "--eval.every", "2", "--eval.num-seeds", "1"]
        cmd += ["--train.checkpoint-every", "2", "--train.keep-checkpoints", "0", "--train.no-export"]
        cmd += ["--train.guard", action, *extra]
        env = {**os.environ, "MASTER_PORT": str(29750 + i), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        t0 = time.time()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        (args.out / f"{name}.log").write_text(out.stdout + out.stderr)
        lines = out.stdout.splitlines()
        run_dir = args.out / name
        runs[action] = {
            "exit": out.returncode,
            "wall_s": time.time() - t0,
            "training_reward": [
                r["reward/mean"] for r in _rows(run_dir / "metrics.jsonl") if "reward/mean" in r
            ],
            "evaluations": [
                {"step": r["step"], **{k[5:-5]: v for k, v in r.items() if k.endswith("/mean")}}
                for r in _rows(run_dir / "eval.jsonl")
            ],
            "guard_lines": [
                line for line in lines if "over-optimisation guard" in line and "finished" not in line
            ],
            "outcome": next((line for line in lines if line.startswith("[miles] finished")), None),
        }
        print(f"{action}: exit {out.returncode}, {runs[action]['wall_s']:.0f} s", flush=True)
        for line in runs[action]["guard_lines"]:
            print("  " + line)
    saved.write_text(json.dumps({"config": args.config, "extra": extra, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
