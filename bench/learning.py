"""The learning benchmark: the RL algorithms on the tiny world, CPU, through torchrun, in two
layouts, with negative controls.

    python bench/learning.py --out bench/results/learning            # ~the table in docs/learning.md
    python bench/learning.py --out /tmp/l --num-rollouts 10 --runs dp4 dp4-negated

Each run is ``train_grpo.py --config configs/world_cpu.yaml`` (the pretrained world pipeline, the
``world_adherence`` reward, held-out evaluation: 8 prompts the training never sees x 4 fixed
seeds, ODE sampling) in deterministic mode with 4 CPU processes:

- ``dp4``: Flow-GRPO, 4 data-parallel ranks, CFG-free as the recipe is (``grpo.train_cfg false``,
  rollouts and evaluation at guidance 1);
- ``dp2xsp2``: 2 dp ranks x sp 2 (Ulysses) — the same global batch (prompts-per-rank 2 at dp4 is
  8 prompt groups; at dp2 x sp2 prompts-per-rank 4), so its curve must coincide with dp4's;
- ``dp4-negated``: dp4 with ``grpo.negate_advantages`` — the same run pushed away from the
  reward, which must not rise;
- ``nft-dp4``, ``nft-dp2xsp2``, ``nft-dp4-negated``: the same three with DiffusionNFT
  (``algorithm.name diffusion_nft``);
- ``cfg-*``: Flow-GRPO as its paper runs it, rolled out and trained with CFG (guidance 4), in
  the same layouts and control, and with GRPO-Guard (``cfg-guard-dp4``) and CPS sampling
  (``cfg-cps-dp4``); ``guard-dp4``, ``cps-dp4``: the same two CFG-free;
- ``*-1step``: the whole rollout (64 samples) in one optimizer step instead of two steps of 32;
- the recipe search of issue 31: ``kl-dp4`` (CFG-free with a KL), ``cfg-clip4-dp4`` (CFG, clip
  range x 4), ``nft-cfgroll-dp4`` (DiffusionNFT on CFG rollouts, trained CFG-free), the negated
  twins of Guard, CPS and ``nft-cfgroll``, and ``<run>-lr1e-4`` / ``-lr3e-4`` (the shared lr);
- ``awm-*``, ``dgpo-*``, ``dpo-*`` (dp4, dp2xsp2, dp4-negated): Advantage Weighted Matching, DGPO
  in its fully CFG-free mode (rollouts at guidance 1, the frozen reference's velocity with CFG 4,
  clip 1e-5: its paper's mode 2) and online DPO (best vs worst of each group's half in a step), each
  with its section's defaults (the references' recipes); ``cfg-dgpo-dp4`` (and ``-negated``):
  DGPO's "rollout with CFG, train without" mode (rollouts at guidance 4, reference without CFG).
- ``sft-dp4``, ``sft-dp2xsp2``: supervised fine-tuning (``algorithm.name sft``) on renders of the
  training prompts (``python -m miles.world.sft_data``, written before the launch), the supervised
  reference: 32 videos x 2 noise draws, dp4's 64 samples per batch; no negated twin (no reward);
  ``sft-*-lr1e-4`` at the GPU path's shared learning rate.

``--gpu`` runs each on the GPU path instead: one process, bf16, compiled blocks, not deterministic,
the same global batch (docs/learning.md, "The GPU path"); ``--time-limit`` stops runs still going.

Every run keeps the recipe's optimizer, batch and evaluation, and the learning rate unless its name
says otherwise: nothing is tuned per method.

``--config configs/world_i2v_cpu.yaml`` runs the same on the image-to-video world (its reward
``world_i2v``; ``make world-i2v-model`` first). The curves are of the weighted reward of the
recipe (its one reward at weight 1).

Writes ``learning.json`` (per run: per-step training reward, every held-out evaluation with its
step and wall time, the run's wall time), ``learning.png`` (held-out adherence against optimizer
steps and against wall time; training reward) and ``learning.md`` (a table). ``--target`` states
the goal the table checks: held-out error 1 − adherence at most half the baseline's. The table
ends with the time targets against Flow-GRPO and, for every run whose negated twin ran in the same
invocation, their final held-out separation in paired standard errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/world_cpu.yaml"
_DP4 = ["--data.prompts-per-rank", "2"]
_DP2XSP2 = ["--data.prompts-per-rank", "4", "--sequence-parallel-size", "2", "--ulysses-degree", "2"]
_NEGATED = ["--grpo.negate-advantages"]
_CFG = ["--grpo.train-cfg", "--rollout.guidance-scale", "4.0"]
_NFT = ["--algorithm.name", "diffusion_nft"]
_ONE_STEP = ["--train.steps-per-rollout", "1"]
RUNS = {"dp4": _DP4, "dp2xsp2": _DP2XSP2, "dp4-negated": [*_DP4, *_NEGATED]}
RUNS.update({f"nft-{name}": [*flags, *_NFT] for name, flags in list(RUNS.items())})
RUNS.update({f"cfg-{name}": [*RUNS[name], *_CFG] for name in ("dp4", "dp2xsp2", "dp4-negated")})
RUNS.update(
    {
        "guard-dp4": [*_DP4, "--algorithm.name", "grpo_guard"],
        "cps-dp4": [*_DP4, "--rollout.sde-type", "cps"],
        "dp4-1step": [*_DP4, *_ONE_STEP],
    }
)
RUNS.update({f"cfg-{name}": [*RUNS[name], *_CFG] for name in ("guard-dp4", "cps-dp4", "dp4-1step")})
# AWM, DGPO and online DPO (issue 32), each with its section's defaults
_DGPO = ["--algorithm.name", "dgpo"]
_MATCHING = {
    "awm": ["--algorithm.name", "awm"],
    "dgpo": [*_DGPO, "--dgpo.reference-guidance-scale", "4.0", "--dgpo.clip-range", "1e-5"],
    "dpo": ["--algorithm.name", "online_dpo"],
}
for _algo, _flags in _MATCHING.items():
    RUNS.update({f"{_algo}-{name}": [*RUNS[name], *_flags] for name in ("dp4", "dp2xsp2", "dp4-negated")})
RUNS.update(
    {
        f"cfg-dgpo-{name}": [*RUNS[name], *_DGPO, "--rollout.guidance-scale", "4.0"]
        for name in ("dp4", "dp4-negated")
    }
)
# recipe search (issue 31): CFG-mode candidates and shared-setting changes, at dp4's global batch
_LR1E4 = ["--train.learning-rate", "1e-4"]
_CFG_ROLL = ["--rollout.guidance-scale", "4.0"]  # CFG rollouts and evaluation; NFT trains CFG-free
RUNS.update(
    {
        "guard-dp4-negated": [*RUNS["guard-dp4"], *_NEGATED],
        "cps-dp4-negated": [*RUNS["cps-dp4"], *_NEGATED],
        "kl-dp4": [*_DP4, "--grpo.kl-beta", "1e-3"],  # CFG-free with a KL to the initial policy
        "cfg-clip4-dp4": [*RUNS["cfg-dp4"], "--grpo.clip-range", "4e-4"],  # clip scaled to guidance 4
        "nft-cfgroll-dp4": [*RUNS["nft-dp4"], *_CFG_ROLL],  # CFG rollouts, CFG-free training
        "nft-cfgroll-dp4-negated": [*RUNS["nft-dp4"], *_CFG_ROLL, *_NEGATED],
    }
)
RUNS.update({f"{name}-lr1e-4": [*RUNS[name], *_LR1E4] for name in list(RUNS)})
RUNS.update(
    {
        f"{name}-lr3e-4": [*RUNS[name], "--train.learning-rate", "3e-4"]
        for name in ("nft-dp4", "nft-dp4-negated", "nft-cfgroll-dp4")
    }
)
# SFT (issue 32): flow matching on renders of the training prompts, the same global batch of 64 samples
WORLD_SFT = ROOT / ".cache" / "world_sft"
_SFT = [
    "--algorithm.name",
    "sft",
    "--data.prompt-file",
    str(WORLD_SFT / "train.jsonl"),
    "--data.group-size",
    "2",
]
RUNS.update(
    {
        "sft-dp4": ["--data.prompts-per-rank", "8", *_SFT],
        "sft-dp2xsp2": ["--data.prompts-per-rank", "16", *_DP2XSP2[2:], *_SFT],
    }
)
RUNS.update({f"{name}-lr1e-4": [*RUNS[name], *_LR1E4] for name in ("sft-dp4", "sft-dp2xsp2")})
DEFAULT_RUNS = ["dp4", "dp2xsp2", "dp4-negated"]
# The GPU path (``--gpu``): one process per run on one CUDA device, bf16, compiled blocks, not in
# deterministic mode (as a user runs it), micro-batches of 16; dp4's 2 prompt groups per rank become 8,
# the same global batch. Runs launched together share the device.
_GPU = ["--model.dtype", "bfloat16", "--train.micro-batch-size", "16"]


def gpu_flags(flags: list[str]) -> list[str]:
    """A run's flags for the GPU path: dp4's prompt groups all on the one rank, bf16."""
    if "--sequence-parallel-size" in flags:
        raise SystemExit("--gpu runs one process per run: choose the dp4 runs")
    out = list(flags)
    i = out.index("--data.prompts-per-rank")
    out[i + 1] = str(int(out[i + 1]) * 4)
    return [*out, *_GPU]


def command(
    out: Path,
    name: str,
    flags: list[str],
    num_rollouts: int,
    extra: list[str],
    config: str = DEFAULT_CONFIG,
    gpu: bool = False,
) -> list[str]:
    """One torchrun launch of the world recipe ``config``: 4 CPU processes in deterministic mode,
    or (``gpu``) one process on the GPU."""
    procs = "1" if gpu else "4"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", procs]
    cmd += ["train_grpo.py", "--config", config, "--run.output-dir", str(out)]
    cmd += ["--run.name", name, "--run.no-progress", "--train.no-export"]
    cmd += [] if gpu else ["--deterministic-mode"]
    cmd += ["--train.no-resume", "--train.overwrite", "--train.num-rollouts", str(num_rollouts)]
    return [*cmd, *(gpu_flags(flags) if gpu else flags), *extra]


def launch_all(
    out: Path,
    names: list[str],
    num_rollouts: int,
    extra: list[str],
    parallel: bool,
    config: str = DEFAULT_CONFIG,
    gpu: bool = False,
    time_limit: float | None = None,
) -> dict[str, float]:
    """Run the launches one after another, or all at once (on a machine with cores to spare);
    returns each one's wall time in seconds. ``time_limit``: stop every run still going after that
    many seconds (its logged steps and evaluations are kept)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    if gpu:
        env["OMP_NUM_THREADS"] = "2"
    start = time.monotonic()
    walls, procs = {}, {}
    for name in names:
        log = open(out / f"{name}.log", "w")
        t0 = time.monotonic()
        cmd = command(out, name, RUNS[name], num_rollouts, extra, config, gpu)
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), t0)
        if not parallel:
            procs[name][0].wait()
            walls[name] = time.monotonic() - t0
    stopped = set()
    while len(walls) < len(procs):  # each run's own wall time, also when they run at once
        for name, (proc, t0) in procs.items():
            if name not in walls and proc.poll() is not None:
                walls[name] = time.monotonic() - t0
            elif name not in walls and time_limit and time.monotonic() - start > time_limit:
                proc.terminate()
                stopped.add(name)
        time.sleep(0.5)
    for name, (proc, _) in procs.items():
        if proc.returncode != 0 and name in stopped:
            print(f"run {name} stopped at the time limit; its logged rows are kept")
        elif proc.returncode != 0:
            raise SystemExit(f"run {name} failed (rc {proc.returncode}); see {out / (name + '.log')}")
    return walls


def read_run(run_dir: Path, wall_s: float) -> dict:
    """Training reward per optimizer step and every evaluation, times relative to the first row."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    t0 = evals[0]["time"] - evals[0]["time/eval_s"]
    final = json.loads((run_dir / "eval" / f"step_{evals[-1]['step']:06d}.json").read_text())["samples"]
    return {
        "wall_s": wall_s,
        # the final evaluation's weighted reward per (prompt, seed), for paired comparisons
        "final_scores": [r["reward"] for r in sorted(final, key=lambda r: (r["prompt"], r["seed"]))],
        "train": [
            {"step": r["step"], "reward": r["reward/mean"], "time_s": r["time"] - t0}
            for r in rows
            if "reward/mean" in r
        ],
        "eval": [
            {
                "step": e["step"],
                "rollout": e["rollout"],
                "time_s": e["time"] - t0,
                "adherence": e["eval/reward/mean"],
            }
            for e in evals
        ],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (name, res) in enumerate(results.items()):
        # negated controls dashed; the dp2 x sp2 twins dotted, over their dp4 curves
        style = dict(color=colors[i % len(colors)], label=name)
        style["linestyle"] = "--" if "negated" in name else ":" if "sp2" in name else "-"
        steps = [e["step"] for e in res["eval"]]
        adherence = [e["adherence"] for e in res["eval"]]
        axes[0].plot(steps, adherence, marker="o", markersize=3, **style)
        axes[1].plot([e["time_s"] for e in res["eval"]], adherence, marker="o", markersize=3, **style)
        axes[2].plot([t["step"] for t in res["train"]], [t["reward"] for t in res["train"]], **style)
    for ax, (xlabel, ylabel) in zip(
        axes,
        [
            ("optimizer step", "held-out adherence"),
            ("wall time (s, from setup end)", "held-out adherence"),
            ("optimizer step", "training reward (rollout mean)"),
        ],
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("RL on the tiny world: held-out prompts, ODE, fixed seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict, target: float) -> str:
    """One row per run; times are to the end of the final evaluation, from the end of the
    launch's setup (so runs that shared a machine compare by their own progress)."""
    lines = [
        "| run | baseline held-out | final held-out | error 1 − adherence | best held-out | steps | time "
        "| training reward, first → last 5 rollouts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        ev = res["eval"]
        base, final, best = ev[0]["adherence"], ev[-1]["adherence"], max(e["adherence"] for e in ev)
        ratio = (1 - final) / max(1 - base, 1e-9)
        lines.append(
            f"| {name} | {base:.3f} | {final:.3f} | {1 - base:.3f} → {1 - final:.3f} (×{ratio:.2f}) | "
            f"{best:.3f} | {ev[-1]['step']} | {ev[-1]['time_s']:.0f} s | {train_change(res['train'])} |"
        )
    lines.append("")
    lines.append(
        f"Target: the error of the trained runs at most ×{target:.2f} of the baseline's; the negated runs must not rise."
    )
    # The efficiency targets: DiffusionNFT within a third of Flow-GRPO's time (issue 14), AWM and
    # DGPO within a fifth (issue 32), against Flow-GRPO CFG-free and with CFG (guidance 4).
    # Runs compare at the same learning rate: "awm-dp4-lr1e-4" against "dp4-lr1e-4".
    for label, run, divisor in (
        ("DiffusionNFT", "nft-dp4", 3),
        ("AWM", "awm-dp4", 5),
        ("DGPO", "dgpo-dp4", 5),
        ("DGPO", "cfg-dgpo-dp4", 5),
    ):
        for grpo, lr in itertools.product(("dp4", "cfg-dp4"), ("", "-lr1e-4", "-lr3e-4")):
            if grpo + lr in results and run + lr in results:
                lines.append("")
                lines.append(
                    speedup_vs_grpo(
                        grpo + lr, results[grpo + lr], label, run + lr, results[run + lr], divisor
                    )
                )
    for name in results:
        if "-negated" in name and name.replace("-negated", "") in results:
            lines.append("")
            lines.append(versus_negated(name.replace("-negated", ""), name, results))
    return "\n".join(lines)


def train_change(train: list[dict], n: int = 5) -> str:
    """Mean training reward of the first and the last ``n`` rollouts (one row per rollout)."""
    by_rollout = {}
    for t in train:  # a rollout's steps log the same reward: keep its first
        by_rollout.setdefault(round(t["reward"], 12), t["reward"])
    rewards = list(by_rollout.values())
    if len(rewards) < 2 * n:
        return "—"
    return f"{sum(rewards[:n]) / n:.3f} → {sum(rewards[-n:]) / n:.3f}"


def versus_negated(name: str, negated: str, results: dict, z: float = 3.0) -> str:
    """The trained run against its negated twin on the same held-out samples: the mean paired
    separation of the final evaluation and its standard error (the learning test's criterion)."""
    a, b = results[name]["final_scores"], results[negated]["final_scores"]
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else float("nan")
    ok = mean > z * se
    return (
        f"{name} vs {negated}: final held-out separation {mean:+.3f} (paired SE {se:.3f}, "
        f"{mean / se if se else float('inf'):.1f} SE over {n} samples): target > {z:g} SE {'met' if ok else 'missed'}."
    )


def speedup_vs_grpo(name: str, grpo: dict, label: str, run: str, other: dict, divisor: int) -> str:
    """Whether ``other`` reaches Flow-GRPO's final held-out adherence in at most 1/divisor of
    Flow-GRPO's time."""
    goal, budget = grpo["eval"][-1]["adherence"], grpo["eval"][-1]["time_s"] / divisor
    reached = next((e for e in other["eval"] if e["adherence"] >= goal), None)
    when = f"at {reached['time_s']:.0f} s (step {reached['step']})" if reached else "never"
    ok = reached is not None and reached["time_s"] <= budget
    return (
        f"{label} ({run}) vs Flow-GRPO ({name}): Flow-GRPO's final held-out adherence {goal:.3f}; "
        f"{label} reaches it {when}; 1/{divisor} of Flow-GRPO's time is {budget:.0f} s: "
        f"target {'met' if ok else 'missed'}."
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-rollouts", type=int, default=20)
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="the world recipe: configs/world_cpu.yaml, or configs/world_i2v_cpu.yaml (make world-i2v-model)",
    )
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    p.add_argument("--target", type=float, default=0.5, help="final held-out error / baseline error")
    p.add_argument("--parallel", action="store_true", help="run the launches at once (needs >= 12 cores)")
    p.add_argument("--gpu", action="store_true", help="one process per run on the GPU, bf16 (see _GPU)")
    p.add_argument("--time-limit", type=float, default=None, help="stop runs still going after this many s")
    p.add_argument("extra", nargs="*", help="further train_grpo.py flags (after --)")
    return p


def main() -> None:
    args = parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if any(name.startswith("sft-") for name in args.runs):  # the SFT runs' data
        subprocess.run([sys.executable, "-m", "miles.world.sft_data", str(WORLD_SFT)], cwd=ROOT, check=True)
    walls = launch_all(
        args.out,
        args.runs,
        args.num_rollouts,
        args.extra,
        args.parallel,
        args.config,
        args.gpu,
        args.time_limit,
    )
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
