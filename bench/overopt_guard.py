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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from world_cpu_runs import read_jsonl, run_logged, world_command  # noqa: E402


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
        cmd = world_command(args.config, args.out, name)
        cmd += ["--algorithm.name", "diffusion_nft", "--train.learning-rate", "3e-4"]
        cmd += ["--train.num-rollouts", str(args.num_rollouts), "--eval.every", "2", "--eval.num-seeds", "1"]
        cmd += ["--train.checkpoint-every", "2", "--train.keep-checkpoints", "0", "--train.no-export"]
        cmd += ["--train.guard", action, *extra]
        out, wall_s = run_logged(cmd, 29750 + i, args.out / f"{name}.log")
        lines = out.stdout.splitlines()
        run_dir = args.out / name
        runs[action] = {
            "exit": out.returncode,
            "wall_s": wall_s,
            "training_reward": [
                r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r
            ],
            "evaluations": [
                {"step": r["step"], **{k[5:-5]: v for k, v in r.items() if k.endswith("/mean")}}
                for r in read_jsonl(run_dir / "eval.jsonl")
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
