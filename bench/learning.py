"""The learning benchmark: the RL algorithms on the tiny world, CPU, through torchrun, in two
layouts, with negative controls.

    python bench/learning.py --out bench/results/learning            # ~the table in docs/learning.md
    python bench/learning.py --out /tmp/l --num-rollouts 10 --runs dp4 dp4-negated

Each run is ``train_grpo.py --config configs/world_cpu.yaml`` (the pretrained world pipeline, the
``world_adherence`` reward, held-out evaluation: 8 prompts the training never sees x 4 fixed
seeds, ODE sampling) in deterministic mode with 4 CPU processes:

- ``dp4``: 4 data-parallel ranks;
- ``dp2xsp2``: 2 dp ranks x sp 2 (Ulysses) — the same global batch (prompts-per-rank 2 at dp4 is
  8 prompt groups; at dp2 x sp2 prompts-per-rank 4), so its curve must coincide with dp4's;
- ``dp4-negated``: dp4 with ``grpo.negate_advantages`` — the same run pushed away from the
  reward, which must not rise;
- ``nft-dp4``, ``nft-dp2xsp2``, ``nft-dp4-negated``: the same three with DiffusionNFT
  (``algorithm.name diffusion_nft``), CFG-free as the method is (rollout and eval at guidance 1);
- ``guard-dp4``: GRPO-Guard; ``cps-dp4``: Flow-GRPO with CPS sampling; ``nocfg-dp4``: Flow-GRPO
  trained and rolled out without CFG (``grpo.train_cfg false``, guidance 1: NFT's setting).

Every run keeps the recipe's optimizer, learning rate, batch and evaluation: nothing is tuned per
method.

Writes ``learning.json`` (per run: per-step training reward, every held-out evaluation with its
step and wall time, the run's wall time), ``learning.png`` (held-out adherence against optimizer
steps and against wall time; training reward) and ``learning.md`` (a table). ``--target`` states
the goal the table checks: held-out error 1 − adherence at most half the baseline's.
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
REWARD = "world_adherence"
RUNS = {
    "dp4": ["--data.prompts-per-rank", "2"],
    "dp2xsp2": ["--data.prompts-per-rank", "4", "--sequence-parallel-size", "2", "--ulysses-degree", "2"],
    "dp4-negated": ["--data.prompts-per-rank", "2", "--grpo.negate-advantages"],
}
_NFT = ["--algorithm.name", "diffusion_nft", "--rollout.guidance-scale", "1.0"]
RUNS.update(
    {
        "nft-dp4": [*RUNS["dp4"], *_NFT],
        "nft-dp2xsp2": [*RUNS["dp2xsp2"], *_NFT],
        "nft-dp4-negated": [*RUNS["dp4-negated"], *_NFT],
        "guard-dp4": [*RUNS["dp4"], "--algorithm.name", "grpo_guard"],
        "cps-dp4": [*RUNS["dp4"], "--rollout.sde-type", "cps"],
        "nocfg-dp4": [*RUNS["dp4"], "--grpo.no-train-cfg", "--rollout.guidance-scale", "1.0"],
    }
)
DEFAULT_RUNS = ["dp4", "dp2xsp2", "dp4-negated"]


def command(out: Path, name: str, flags: list[str], num_rollouts: int, extra: list[str]) -> list[str]:
    """One 4-process torchrun launch of the world recipe."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["train_grpo.py", "--config", "configs/world_cpu.yaml", "--run.output-dir", str(out)]
    cmd += ["--run.name", name, "--run.no-progress", "--deterministic-mode", "--train.no-export"]
    cmd += ["--train.no-resume", "--train.overwrite", "--train.num-rollouts", str(num_rollouts)]
    return [*cmd, *flags, *extra]


def launch_all(
    out: Path, names: list[str], num_rollouts: int, extra: list[str], parallel: bool
) -> dict[str, float]:
    """Run the launches one after another, or all at once (on a machine with cores to spare);
    returns each one's wall time in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    walls, procs = {}, {}
    for name in names:
        log = open(out / f"{name}.log", "w")
        t0 = time.monotonic()
        cmd = command(out, name, RUNS[name], num_rollouts, extra)
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), t0)
        if not parallel:
            procs[name][0].wait()
            walls[name] = time.monotonic() - t0
    for name, (proc, t0) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"run {name} failed (rc {proc.returncode}); see {out / (name + '.log')}")
        walls.setdefault(name, time.monotonic() - t0)
    return walls


def read_run(run_dir: Path, wall_s: float) -> dict:
    """Training reward per optimizer step and every evaluation, times relative to the first row."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    t0 = evals[0]["time"] - evals[0]["time/eval_s"]
    return {
        "wall_s": wall_s,
        "train": [
            {"step": r["step"], "reward": r[f"reward/{REWARD}/mean"]} for r in rows if "reward/mean" in r
        ],
        "eval": [
            {
                "step": e["step"],
                "rollout": e["rollout"],
                "time_s": e["time"] - t0,
                "adherence": e[f"eval/{REWARD}/mean"],
            }
            for e in evals
        ],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, res in results.items():
        steps = [e["step"] for e in res["eval"]]
        adherence = [e["adherence"] for e in res["eval"]]
        axes[0].plot(steps, adherence, marker="o", label=name)
        axes[1].plot([e["time_s"] for e in res["eval"]], adherence, marker="o", label=name)
        axes[2].plot([t["step"] for t in res["train"]], [t["reward"] for t in res["train"]], label=name)
    for ax, (xlabel, ylabel) in zip(
        axes,
        [
            ("optimizer step", "held-out adherence"),
            ("wall time (s, 4 CPU processes)", "held-out adherence"),
            ("optimizer step", "training reward (rollout mean)"),
        ],
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("RL on the tiny world (configs/world_cpu.yaml): held-out prompts, ODE, fixed seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict, target: float) -> str:
    lines = [
        "| run | baseline held-out | final held-out | error 1 − adherence | best held-out | steps | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        ev = res["eval"]
        base, final, best = ev[0]["adherence"], ev[-1]["adherence"], max(e["adherence"] for e in ev)
        ratio = (1 - final) / max(1 - base, 1e-9)
        lines.append(
            f"| {name} | {base:.3f} | {final:.3f} | {1 - base:.3f} → {1 - final:.3f} (×{ratio:.2f}) | "
            f"{best:.3f} | {ev[-1]['step']} | {res['wall_s']:.0f} s |"
        )
    lines.append("")
    lines.append(
        f"Target: the error of the trained runs at most ×{target:.2f} of the baseline's; the negated runs must not rise."
    )
    if "dp4" in results and "nft-dp4" in results:
        lines.append("")
        lines.append(nft_vs_grpo(results["dp4"], results["nft-dp4"]))
    return "\n".join(lines)


def nft_vs_grpo(grpo: dict, nft: dict) -> str:
    """The issue's efficiency target: DiffusionNFT reaching Flow-GRPO's final held-out adherence in
    at most a third of Flow-GRPO's wall time."""
    goal, budget = grpo["eval"][-1]["adherence"], grpo["eval"][-1]["time_s"] / 3
    reached = next((e for e in nft["eval"] if e["adherence"] >= goal), None)
    when = f"at {reached['time_s']:.0f} s (step {reached['step']})" if reached else "never"
    ok = reached is not None and reached["time_s"] <= budget
    return (
        f"DiffusionNFT vs Flow-GRPO (dp4): Flow-GRPO's final held-out adherence {goal:.3f}; NFT reaches it "
        f"{when}; a third of Flow-GRPO's time is {budget:.0f} s: target {'met' if ok else 'missed'}."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-rollouts", type=int, default=20)
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    p.add_argument("--target", type=float, default=0.5, help="final held-out error / baseline error")
    p.add_argument("--parallel", action="store_true", help="run the launches at once (needs >= 12 cores)")
    p.add_argument("extra", nargs="*", help="further train_grpo.py flags (after --)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    walls = launch_all(args.out, args.runs, args.num_rollouts, args.extra, args.parallel)
    results = {}
    for name in args.runs:
        results[name] = read_run(args.out / name, walls[name])
        ev = results[name]["eval"]
        print(
            f"{name}: held-out {ev[0]['adherence']:.3f} -> {ev[-1]['adherence']:.3f} in {walls[name]:.0f} s"
        )
    (args.out / "learning.json").write_text(json.dumps(results, indent=1))
    md = table(results, args.target)
    (args.out / "learning.md").write_text(md + "\n")
    print(md)
    try:
        plot(results, args.out / "learning.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")


if __name__ == "__main__":
    main()
