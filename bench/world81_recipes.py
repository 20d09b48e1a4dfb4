"""The shipped Wan recipes, run as shipped, on the 81-frame world (issue 42, item 2).

    python bench/world81_recipes.py --out OUT                      # write OUT/recipes/*.yaml, print the commands
    python bench/world81_recipes.py --out OUT --dry-run            # and plan each one (CPU is enough)
    python bench/world81_recipes.py --out OUT --run --recipes nft --seeds 0 1 2 --negated --time-limit 590

Each real recipe (``configs/wan2_1_t2v_1_3b*.yaml``) keeps everything that makes it that recipe —
its algorithm section, LoRA, KL, CFG mode (``grpo.train_cfg``, the reference guidance), guidance,
denoising steps, SDE window, clip range, activation-checkpoint budget, micro-batch, learning rate,
steps per rollout, group size, the 81 x 480 x 832 video — and swaps only:

- the model: ``miles/world/pipeline_81`` (the 81-frame world's prior, ``make world-model-81``);
- the prompts: the world's 24 training prompts, the negative prompt "" and 64 text tokens (as the
  prior was pretrained), the held-out evaluation on the 8 held-out prompts x ``EVAL_SEEDS`` seeds
  (``eval.seed`` 0: every run and seed on the same noise);
- the reward: ``world_adherence`` at weight 1;
- the batch, scaled to one GPU: no sequence parallelism (``parallel.sequence_parallel_size`` 1)
  and ``PROMPTS_PER_RANK`` prompt groups per rollout (16 samples at the recipes' group size 8),
  where the recipes run 8 GPUs at dp2 x sp4 with 4 groups per dp rank (64 samples);
- the length: ``train.num_rollouts`` = 300 optimizer steps / the recipe's steps per rollout.

``--negated`` adds each run's twin with ``grpo.negate_advantages`` (the reward's sign flipped: a
run blind to the reward moves both alike). ``--run`` launches the runs side by side on the one GPU
(one process each) and writes ``world81.json`` / ``world81.md`` / ``world81.png`` with
``bench/learning.py``'s readers. ``estimate`` gives each recipe's estimated H200 seconds per 300-step
curve by part (the prior's forwards, the VAE's decodes, the evaluations; not a measurement), which
``bench/world81_plan.py`` packs into the GPU session plan. ``--model`` points the recipes at another
prior folder (``bench/world81_gpu.sh`` uses its work folder's).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "flow_grpo_cfg": "configs/wan2_1_t2v_1_3b.yaml",
    "nft": "configs/wan2_1_t2v_1_3b_nft.yaml",
    "awm": "configs/wan2_1_t2v_1_3b_awm.yaml",
    "dgpo": "configs/wan2_1_t2v_1_3b_dgpo.yaml",
    "dpo": "configs/wan2_1_t2v_1_3b_dpo.yaml",
    "guard": "configs/wan2_1_t2v_1_3b_guard.yaml",
}
MODEL = "miles/world/pipeline_81"
PROMPTS_PER_RANK = 2
EVAL_SEEDS = 16
EVAL_EVERY = 15
STEPS = 300
VAE16_DECODE_FLOPS = 5_599_694_929_920
"""FLOPs of one decode of the 16-channel world VAE (``VAE_16``) at 81 x 480 x 832, counted by
``torch.utils.flop_counter`` on meta tensors (``bench/world81_plan.py --count``)."""
_SWAPPED = "model.path, data (prompts, negative prompt, text length, groups per rollout), reward, eval, parallel, run.name, train.num_rollouts"


def world81_recipe(
    recipe: str | Path, steps: int = STEPS, model: str = MODEL, eval_every: int = EVAL_EVERY
) -> dict:
    """The recipe file's sections with only the model, the prompts, the reward and the batch swapped
    (module docstring); every other key as shipped."""
    raw = yaml.safe_load((ROOT / recipe).read_text())
    out = copy.deepcopy(raw)
    name = Path(recipe).stem
    out["run"] = {**raw.get("run", {}), "name": f"world81_{name}"}
    out["model"] = {**raw.get("model", {}), "path": str(model)}
    out["parallel"] = {**raw.get("parallel", {}), "sequence_parallel_size": 1, "ulysses_degree": 0}
    data = {k: v for k, v in raw.get("data", {}).items() if k not in ("prompt_file", "negative_prompt")}
    out["data"] = {
        **data,
        "prompt_file": "miles/world/prompts_train.txt",
        "negative_prompt": "",
        "max_sequence_length": 64,
        "prompts_per_rank": PROMPTS_PER_RANK,
    }
    out["reward"] = {"weights": {"world_adherence": 1.0}}
    out["eval"] = {
        **raw.get("eval", {}),
        "prompt_file": "miles/world/prompts_heldout.txt",
        "every": eval_every,
        "num_seeds": EVAL_SEEDS,
        "seed": 0,
    }
    train = raw.get("train", {})
    out["train"] = {**train, "num_rollouts": steps // train.get("steps_per_rollout", 2)}
    return out


def header(recipe: str) -> str:
    return (
        f"# {recipe} on the 81-frame world (bench/world81_recipes.py wrote it; do not edit by hand).\n"
        f"# As shipped but for: {_SWAPPED}.\n"
        f"# The batch is scaled to one GPU: {PROMPTS_PER_RANK} prompt groups a rollout at sp 1 (the recipe: 8 GPUs, dp2 x sp4).\n"
    )


def write_recipes(
    out: Path, names: list[str], model: str = MODEL, eval_every: int = EVAL_EVERY
) -> dict[str, Path]:
    """``OUT/recipes/<name>.yaml`` for each recipe name of ``RECIPES`` (``model``: the prior's folder)."""
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        path = out / "recipes" / f"{name}.yaml"
        path.write_text(
            header(RECIPES[name])
            + yaml.safe_dump(world81_recipe(RECIPES[name], STEPS, model, eval_every), sort_keys=False)
        )
        paths[name] = path
    return paths


def run_names(
    names: list[str], seeds: list[int], negated: bool, twin_seeds: list[int] | None = None
) -> list[tuple[str, str, int, bool]]:
    """(run name, recipe name, seed, negated) for every run: each recipe at each seed, and with
    ``negated`` its twin at each of ``twin_seeds`` (default: every seed)."""
    runs = []
    for name in names:
        for seed in seeds:
            runs.append((f"{name}-s{seed}", name, seed, False))
            if negated and (twin_seeds is None or seed in twin_seeds):
                runs.append((f"{name}-s{seed}-negated", name, seed, True))
    return runs


def command(
    out: Path, recipe_path: Path, run: str, seed: int, negated: bool, resume: bool = False
) -> list[str]:
    """One launch on the one GPU: torchrun with one process, the recipe as written, its seed.
    ``resume``: continue from the run's latest checkpoint (a chain of time-limited commands)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["train_grpo.py", "--config", str(recipe_path), "--run.output-dir", str(out), "--run.name", run]
    cmd += ["--run.seed", str(seed), "--run.no-progress", "--run.wandb-mode", "disabled", "--train.no-export"]
    cmd += [] if resume else ["--train.no-resume", "--train.overwrite"]
    return cmd + (["--grpo.negate-advantages"] if negated else [])


def _forwards(cfg) -> tuple[int, int, int, int]:
    """(rollout forwards, trained levels, forward-equivalents of a trained level's fwd+bwd, its extra
    no-grad forwards) a sample for a parsed recipe: a rollout runs ``num_steps`` forwards (x2 with
    CFG); a trained level costs 3 forwards (x2 when trained through CFG) plus, without a gradient,
    the reference's forward with a KL (x2 with DGPO's guided reference), DiffusionNFT's old policy,
    online DPO's reference. Trained levels: the SDE window (Flow-GRPO, Guard), ``int(fraction x
    steps)`` (DiffusionNFT), the section's ``num_levels`` (AWM, DGPO, online DPO)."""
    r, algo = cfg.rollout, cfg.algorithm.name
    guided = r.guidance_scale > 1
    if algo in ("flow_grpo", "grpo_guard"):
        levels = r.sde_window_size or int(r.timestep_fraction * r.num_steps)
        cfg_train, extra = cfg.grpo.train_cfg and guided, int(cfg.grpo.kl_beta > 0)
    elif algo == "diffusion_nft":
        levels, cfg_train = max(1, int(cfg.nft.timestep_fraction * r.num_steps)), False
        extra = 1 + int(cfg.nft.kl_beta > 0)  # the old policy, the reference
    else:
        section = {"awm": cfg.awm, "dgpo": cfg.dgpo, "online_dpo": cfg.dpo}[algo]
        levels, cfg_train = section.num_levels, False
        extra = int(getattr(section, "kl_beta", 0) > 0)
        if algo == "dgpo":
            extra = max(extra, 1) * (2 if section.reference_guidance_scale > 1 else 1)
        elif algo == "online_dpo":
            extra = 1
    return r.num_steps * (2 if guided else 1), levels, 3 * (2 if cfg_train else 1), extra


def estimate(recipe_path: Path, blocks: int = 2, vae_dtype: str | None = None) -> dict:
    """Estimated H200 seconds of one 300-step curve of a written recipe, alone on the GPU, by part:
    the prior's forwards (``_forwards``) at ``miles.pretrain_world_81.RATES`` (542 TFLOP/s without
    a gradient, 449 with), the world VAE's decodes (rollouts and evaluations) at its measured fp32
    rate (bf16 1.47x faster, ``vae_dtype``, default the recipe's), the evaluations (``eval.every``,
    held-out prompts x ``eval.num_seeds``, the rollout's steps and CFG). Left out: the reward, the
    optimizer, the checkpoints, the start-up (``bench/world81_plan.py`` adds it). An estimate."""
    from miles.config import parse_args
    from miles.pretrain_world_81 import PRIOR, RATES, forward_flops

    cfg, _ = parse_args(["--config", str(recipe_path)])
    forward = forward_flops(
        (cfg.rollout.num_frames, cfg.rollout.height, cfg.rollout.width), dict(PRIOR, num_layers=blocks)
    )
    rollout, levels, trained, extra = _forwards(cfg)
    samples = cfg.data.prompts_per_rank * cfg.data.group_size * cfg.train.num_rollouts
    evals = cfg.train.num_rollouts // cfg.eval.every + 1 + int(cfg.train.num_rollouts % cfg.eval.every > 0)
    eval_samples = evals * 8 * cfg.eval.num_seeds
    decode_rate = RATES["vae_fp32"] * (1.47 if (vae_dtype or cfg.model.vae_dtype) == "bfloat16" else 1.0)
    decode_s = VAE16_DECODE_FLOPS / (decode_rate * 1e12)
    parts = {
        "rollout_s": samples * rollout * forward / (RATES["forward"] * 1e12),
        "train_s": samples * levels * trained * forward / (RATES["train"] * 1e12),
        "no_grad_s": samples * levels * extra * forward / (RATES["forward"] * 1e12),
        "decode_s": samples * decode_s,
        "eval_s": eval_samples
        * (
            cfg.rollout.num_steps
            * (2 if cfg.rollout.guidance_scale > 1 else 1)
            * forward
            / (RATES["forward"] * 1e12)
            + decode_s
        ),
    }
    return {
        "forwards_per_sample": rollout + levels * (trained + extra),
        "samples_per_curve": samples,
        "eval_samples": eval_samples,
        "curve_flops": samples * (rollout + levels * (trained + extra)) * forward,
        **{k: round(v) for k, v in parts.items()},
        "curve_s_alone": round(sum(parts.values())),
    }


def dry_run_all(paths: dict[str, Path]) -> dict[str, dict]:
    """Each written recipe through the run plan (``train_grpo.py --dry-run``'s), one CUDA rank."""
    from miles.config import parse_args
    from miles.train.dry_run import dry_run

    reports = {}
    for name, path in paths.items():
        cfg, _ = parse_args(["--config", str(path)])
        reports[name] = dry_run(cfg, world_size=1, verbose=False, device_type="cuda")
    return reports


KILL_GRACE_S = 30.0
"""Seconds a run stopped at the time limit has to checkpoint and exit before it is killed."""


def launch(
    out: Path, paths: dict[str, Path], runs: list, time_limit: float | None, resume: bool
) -> dict[str, float]:
    """Every run side by side on the one GPU; stops runs still going after ``time_limit`` s (SIGTERM:
    a stopped run finishes the update it is in, checkpoints and exits; ``resume`` continues it) and
    kills any still there ``KILL_GRACE_S`` later, so a stage ends within its command's limit."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    procs, walls, start = {}, {}, time.monotonic()
    for run, name, seed, negated in runs:
        log = open(out / f"{run}.log", "a")
        cmd = command(out, paths[name], run, seed, negated, resume)
        procs[run] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    stopping: set[str] = set()
    while len(walls) < len(procs):
        elapsed = time.monotonic() - start
        for run, proc in procs.items():
            if run in walls:
                continue
            if proc.poll() is not None:
                walls[run] = elapsed
            elif time_limit and elapsed > time_limit + KILL_GRACE_S:
                proc.kill()
            elif time_limit and elapsed > time_limit and run not in stopping:
                proc.terminate()
                stopping.add(run)
        time.sleep(1.0)
    return walls


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--negated", action="store_true", help="each run's twin with grpo.negate_advantages")
    p.add_argument(
        "--twin-seeds", nargs="+", type=int, default=None, help="the seeds given a twin (default: all)"
    )
    p.add_argument("--dry-run", action="store_true", help="plan each recipe (one CUDA rank); no GPU needed")
    p.add_argument("--run", action="store_true", help="launch the runs side by side on this machine's GPU")
    p.add_argument("--time-limit", type=float, default=None)
    p.add_argument("--resume", action="store_true", help="continue each run from its latest checkpoint")
    p.add_argument("--report", action="store_true", help="only read the runs in OUT and write the JSON/PNG")
    p.add_argument("--model", default=MODEL, help=f"the 81-frame prior's folder (default {MODEL})")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="rollouts between held-out evaluations")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = write_recipes(args.out, args.recipes, args.model, args.eval_every)
    runs = run_names(args.recipes, args.seeds, args.negated, args.twin_seeds)
    plan = {
        "recipes": {n: str(RECIPES[n]) for n in args.recipes},
        "estimate": {n: estimate(paths[n]) for n in args.recipes},
        "commands": {
            run: command(args.out, paths[name], run, seed, neg, args.resume) for run, name, seed, neg in runs
        },
    }
    if args.dry_run:
        reports = dry_run_all(paths)
        plan["dry_run"] = {
            n: {"tokens_per_sample": r["sequence"]["tokens_per_sample"]} for n, r in reports.items()
        }
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
    for run, cmd in plan["commands"].items():
        print(f"{run}: {' '.join(cmd)}")
    for name, est in plan["estimate"].items():
        print(f"{name}: ~{est['curve_s_alone'] / 60:.1f} min a curve alone on one H200 (estimate)")
    if not (args.run or args.report):
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import plot, read_run, table

    walls = launch(args.out, paths, runs, args.time_limit, args.resume) if args.run else {}
    results = {}
    for run, *_ in runs:
        try:
            results[run] = read_run(args.out / run, walls.get(run, float("nan")))
        except (FileNotFoundError, IndexError, KeyError) as e:
            print(f"run {run}: no curve ({e}); see {args.out / (run + '.log')}")
    (args.out / "world81.json").write_text(json.dumps({"plan": plan, "runs": results}, indent=1))
    (args.out / "world81.md").write_text(table(results, 0.5) + "\n")
    plot(results, args.out / "world81.png")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
