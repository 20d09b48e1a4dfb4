"""``grpo.clip_range: auto`` against fixed clip ranges on the tiny world (CPU): the clip range each
run trains with, its clipped fraction on the steps with moved weights, training reward, held-out.

    python bench/clip_calibration.py --out docs/learning/clip --num-rollouts 5
    python bench/clip_calibration.py --out OUT --runs auto 1e-4 1e-3 --target 0.2 -- --data.prompts-per-rank 4

Each run is ``train_grpo.py --config configs/world_cpu.yaml`` (Flow-GRPO, CFG-free), one process,
deterministic mode, 2 optimizer steps per rollout, run one after another. A rollout's first step has
ratio 1 (the weights that sampled it), so the clipped fraction is read on each rollout's second
step. Writes ``OUT/clip_calibration.json`` (runs already in it are kept, the ones run replaced) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from world_cpu_runs import read_jsonl, run_logged, world_command  # noqa: E402


def summarize(run_dir: Path) -> dict:
    """The run's clip range, clipped fraction per step, training reward and held-out evaluations."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    moved = [r for r in metrics if r["step"] % 2 == 0 and "train/clipfrac" in r]  # each rollout's 2nd step
    rewards = [r["reward/mean"] for r in metrics if "reward/mean" in r]
    return {
        "clip_range": [r.get("train/clip_range") for r in moved],
        "clipfrac_moved_steps": [r["train/clipfrac"] for r in moved],
        "clipfrac_mean": sum(r["train/clipfrac"] for r in moved) / max(len(moved), 1),
        "approx_kl_moved_steps": [r["train/approx_kl"] for r in moved],
        "training_reward": rewards,
        "heldout": [
            {"step": r["step"], "world_adherence": r.get("eval/world_adherence/mean")} for r in evals
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", default=["auto", "1e-4", "1e-3"])
    ap.add_argument("--target", type=float, default=0.2)
    ap.add_argument("--num-rollouts", type=int, default=5)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "clip_calibration.json"
    results = json.loads(saved.read_text())["runs"] if saved.is_file() else {}  # other runs of OUT kept
    for i, clip in enumerate(args.runs):
        name = f"clip_{clip}"
        cmd = world_command("configs/world_cpu.yaml", args.out, name)
        cmd += ["--train.num-rollouts", str(args.num_rollouts), "--data.prompts-per-rank", "2"]
        cmd += ["--eval.num-seeds", "1", "--train.no-export", "--train.checkpoint-every", "0"]
        cmd += ["--grpo.clip-range", clip, "--grpo.target-clipfrac", str(args.target), *extra]
        out, wall_s = run_logged(cmd, 29700 + i, args.out / f"{name}.log")
        code = out.returncode
        results[clip] = {"exit": code, "wall_s": wall_s, **summarize(args.out / name)}
        print(f"{clip}: exit {code}, {results[clip]['wall_s']:.0f} s", flush=True)
    report = {
        "target_clipfrac": args.target,
        "num_rollouts": args.num_rollouts,
        "extra": extra,
        "runs": results,
    }
    (args.out / "clip_calibration.json").write_text(json.dumps(report, indent=1))
    print(
        "| clip range | clip used | clipped fraction (moved steps, mean) | training reward first → last | held-out first → last |"
    )
    print("|---|---|---|---|---|")
    for clip, r in results.items():
        used = (
            r["clip_range"][-1] if r["clip_range"] and r["clip_range"][-1] is not None else clip
        )  # the last
        tr = r["training_reward"]
        ho = [h["world_adherence"] for h in r["heldout"]]
        print(
            f"| {clip} | {float(used):.3g} | {r['clipfrac_mean']:.3f} | "
            f"{tr[0]:.3f} → {tr[-1]:.3f} | {ho[0]:.3f} → {ho[-1]:.3f} |"
            if tr and ho
            else f"| {clip} | {used} | — | — | — |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
