"""E2E topology bands: the GRPO trainer through torchrun in every dp x sp layout, same global batch.

    python bench/e2e_bands.py --out runs/bands                 # 5 bands, 5 rollouts (10 steps) each
    python bench/e2e_bands.py --out runs/bands --double-run    # + a second run per band, compared bitwise
    python bench/e2e_bands.py --out runs/bands_nft --double-run --algorithm diffusion_nft
    python bench/e2e_bands.py --out runs/bands_dgpo --double-run --algorithm dgpo   # also awm, online_dpo
    python bench/e2e_bands.py --out runs/bands_cps --double-run -- --rollout.sde-type cps

Reproduces the seed's E2E validation on CPU (4 gloo processes, ``configs/tiny_bands.yaml``: the
tiny two-expert Wan, continuous ``sharpness`` reward, ``--deterministic-mode``). Bands:

    sp1 (dp4) · u4r1, u2r2, u1r4 (dp1 x sp4) · dp2xu2 (dp2 x sp2)

Every band trains on the same global batch (``--prompts`` prompt groups: prompts-per-rank =
prompts / dp), and the trainer keys each sample's noise by its global index, so every band
samples the same rollout 0. Checks (the exit code is nonzero if one fails):

- **rollout-0 reward statistics** (mean/std/min/max as the trainer prints them, 4 digits)
  identical across all bands;
- **training trajectories** agree across bands: reward mean of every rollout and grad norm of
  every optimizer step within 1e-3 relative (fp32 rounding measures ~1e-6). This holds because
  each rank's prompt groups are dealt strided by dp and split into consecutive optimizer steps:
  keep prompts-per-rank a multiple of ``train.steps_per_rollout`` in every band, or a group's
  samples are split over steps differently at dp4 than at dp1 (then ~15% apart after step 1);
- **canary** ``log_prob_mean_abs_diff`` (train recompute vs rollout log-probs, first step of each
  rollout) flat in every band: every value <= 1e-4 and tail <= 10 x head + 1e-6 (no
  accumulation). The seed measured ~1e-5 in bf16 on H200; fp32 on CPU gives exactly 0;
- with ``--double-run``: a second run of each band, of ``--rerun-rollouts`` rollouts (default:
  all of them), gives bitwise identical metrics (every metrics.jsonl value except wall-clock
  times, throughput and memory) for its steps and a bitwise identical checkpoint (model and
  optimizer state, every tensor ``torch.equal``). With fewer rerun rollouts the first run keeps
  a checkpoint at that step (``--train.checkpoint-every``), so the comparison is exact too.

Writes ``OUT/bands.md`` (the table) and ``OUT/bands.json`` (the numbers and the checks); run
directories and launcher logs go under ``OUT/runs`` and ``OUT/logs``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (band, sequence_parallel_size, ulysses_degree) at 4 processes
BANDS = [
    ("sp1", 1, 1),
    ("u4r1", 4, 4),
    ("u2r2", 4, 2),
    ("u1r4", 4, 1),
    ("dp2xu2", 2, 2),
]
CANARY_MAX = 1e-4
CANARY_GROWTH = 10.0
CANARY_FLOOR = 1e-6
# Reward means and grad norms of every rollout/step across bands, relative (fp32 rounding only).
TRAJECTORY_RTOL = 1e-3
# Wall-clock and machine-dependent metrics, left out of the bitwise double-run comparison.
VOLATILE_PREFIXES = ("time/", "perf/", "memory/")
ROLLOUT_LINE = re.compile(
    r"\[rollout (\d+)\] step (\d+) (?:reward mean=(\S+) std=(\S+) min=(\S+) max=(\S+))?"  # SFT: none
    r"(?: .*log_prob_mean_abs_diff=(\S+))?"  # Flow-GRPO's canary; DiffusionNFT has none
)


# Flags of the flow-matching algorithms on the bands' 4-step recipe: their levels come from a
# prefix of the grid (2 of 3), and DGPO's group weights and DPO's pairs need whole groups in a step.
FORWARD_PROCESS = {
    "awm": ["--awm.num-levels", "2", "--train.steps-per-rollout", "1"],
    "dgpo": ["--dgpo.num-levels", "2", "--train.steps-per-rollout", "1"],
    "online_dpo": ["--dpo.num-levels", "2", "--train.steps-per-rollout", "1"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, required=True, help="output directory (bands.md, bands.json, runs, logs)"
    )
    p.add_argument("--rollouts", type=int, default=5, help="rollouts per band (2 optimizer steps each)")
    p.add_argument("--double-run", action="store_true", help="run every band twice and compare bitwise")
    p.add_argument(
        "--rerun-rollouts",
        type=int,
        default=None,
        help="rollouts of the second run (default: --rollouts); fewer compares that prefix exactly",
    )
    p.add_argument("--prompts", type=int, default=8, help="global prompt groups per rollout (divisible by 4)")
    p.add_argument("--config", default="configs/tiny_bands.yaml")
    p.add_argument(
        "--algorithm",
        default="flow_grpo",
        choices=["flow_grpo", "grpo_guard", "diffusion_nft", *FORWARD_PROCESS, "sft"],
        help="algorithm.name of every band (the forward-process ones: CFG-free, guidance 1, no canary; "
        "awm, dgpo, online_dpo: 2 trained levels of the 4-step grid, one optimizer step per rollout "
        "so that a step holds whole groups; sft: on world renders, OUT/sft_data, cut to the recipe's "
        "frames; no reward, no canary)",
    )
    p.add_argument("--bands", default=",".join(b[0] for b in BANDS), help="comma-separated subset of bands")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("extra", nargs="*", help="further train_grpo.py flags for every band (after --)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = p.parse_args(argv)
    known = {b[0] for b in BANDS}
    if unknown := set(args.bands.split(",")) - known:
        p.error(f"unknown bands {sorted(unknown)}; known: {sorted(known)}")
    if args.rerun_rollouts is None:
        args.rerun_rollouts = args.rollouts
    if not 1 <= args.rerun_rollouts <= args.rollouts:
        p.error("--rerun-rollouts must be between 1 and --rollouts")
    return args


# ----------------------------------------------------------------------------------------------
# launching


def launch(
    args: argparse.Namespace, band: str, sp: int, ulysses: int, name: str, rollouts: int, ckpt_every: int
):
    """One torchrun launch of train_grpo.py; returns (returncode, stdout+stderr, wall seconds)."""
    dp = args.nproc // sp
    run_dir = args.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start clean
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        "train_grpo.py", "--config", args.config,
        "--sequence-parallel-size", str(sp), "--ulysses-degree", str(ulysses),
        "--data.prompts-per-rank", str(args.prompts // dp),
        "--train.num-rollouts", str(rollouts),
        "--train.checkpoint-every", str(ckpt_every), "--train.keep-checkpoints", "0",
        "--train.no-resume", "--deterministic-mode",
        "--run.output-dir", str(args.out / "runs"), "--run.name", name,
        "--run.wandb-mode", "disabled", "--run.no-progress",
        "--algorithm.name", args.algorithm,
    ]  # fmt: skip
    if args.algorithm == "diffusion_nft" or args.algorithm in FORWARD_PROCESS:
        cmd += ["--rollout.guidance-scale", "1.0", *FORWARD_PROCESS.get(args.algorithm, [])]
    if args.algorithm == "sft":  # its videos: renders of the world's training prompts (main writes them)
        cmd += ["--data.prompt-file", str(args.out / "sft_data" / "train.jsonl")]
    cmd += args.extra
    finished = args.out / "runs" / f"{name}.finished"  # train_grpo.py: rank<R> once its work returned 0
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONFAULTHANDLER": "1",
        "MILES_FINISHED_DIR": str(finished),
    }
    for attempt in range(2):
        shutil.rmtree(finished, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = -1, f"{e.stdout or ''}{e.stderr or ''}\n[e2e_bands] timed out after {args.timeout}s"
        wall = time.perf_counter() - t0
        done = len(list(finished.glob("rank*"))) if finished.is_dir() else 0
        shutil.rmtree(finished, ignore_errors=True)
        if rc == 0 or attempt or not teardown_failure(rc, done, args.nproc):
            break
        print(
            f"[e2e_bands] {name}: failed (rc {rc}) after every rank had finished; retrying once", flush=True
        )
        shutil.rmtree(run_dir, ignore_errors=True)
    log = args.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(" ".join(cmd) + "\n\n" + output)
    return rc, output, wall


def teardown_failure(rc: int, ranks_finished: int, nproc: int) -> bool:
    """Whether a failed launch failed only after every rank's work had returned (a process teardown
    failure), the one failure worth a retry. A rank that died mid-run, also by a native abort with no
    Python traceback (a heap check's SIGABRT: the crash of issue 46), is a real failure, never retried."""
    return rc != 0 and ranks_finished == nproc


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


# ----------------------------------------------------------------------------------------------
# bitwise comparisons


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "time" and not k.startswith(VOLATILE_PREFIXES)}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare_metrics(first: list[dict], second: list[dict], max_step: int) -> list[str]:
    """Differences between the stable metrics of two runs over steps 1..max_step (empty: identical)."""
    a = [_stable(r) for r in first if r["step"] <= max_step]
    b = [_stable(r) for r in second if r["step"] <= max_step]
    if len(a) != len(b) or not a:
        return [f"{len(a)} vs {len(b)} metric rows up to step {max_step}"]
    diffs = []
    for ra, rb in zip(a, b):
        if ra.keys() != rb.keys():
            diffs.append(f"step {ra['step']}: keys differ {sorted(ra.keys() ^ rb.keys())}")
        diffs += [
            f"step {ra['step']} {k}: {ra[k]!r} vs {rb.get(k)!r}" for k in ra if not _same(ra[k], rb.get(k))
        ]
    return diffs


def _load_dcp(path: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=False)


def _leaves(x, prefix: str = ""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, x


def compare_checkpoints(a: Path, b: Path) -> tuple[int, list[str]]:
    """(number of tensors, differences) between two DCP checkpoints: model and optimizer state."""
    import torch

    if not (a / "COMPLETE").is_file() or not (b / "COMPLETE").is_file():
        return 0, [f"missing checkpoint: {a if not (a / 'COMPLETE').is_file() else b}"]
    la, lb = dict(_leaves(_load_dcp(a))), dict(_leaves(_load_dcp(b)))
    if la.keys() != lb.keys():
        return 0, [f"checkpoint keys differ: {sorted(la.keys() ^ lb.keys())[:5]}"]
    diffs, tensors = [], 0
    for k, va in la.items():
        vb = lb[k]
        if torch.is_tensor(va):
            tensors += 1
            same = (
                torch.is_tensor(vb) and va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb)
            )
            if not same:
                diffs.append(f"{k}: tensors differ")
        elif not _same(va, vb):
            diffs.append(f"{k}: {va!r} vs {vb!r}")
    return tensors, diffs


# ----------------------------------------------------------------------------------------------
# one band


def run_band(args: argparse.Namespace, band: str, sp: int, ulysses: int) -> dict:
    dp, ring = args.nproc // sp, sp // ulysses
    ckpt_every = args.rerun_rollouts if args.double_run and args.rerun_rollouts < args.rollouts else 0
    print(
        f"[e2e_bands] {band}: dp{dp} x sp{sp} (u{ulysses}r{ring}), {args.rollouts} rollouts ...", flush=True
    )
    rc, output, wall = launch(args, band, sp, ulysses, band, args.rollouts, ckpt_every)
    result = {
        "band": band,
        "dp": dp,
        "sp": sp,
        "ulysses": ulysses,
        "ring": ring,
        "prompts_per_rank": args.prompts // dp,
        "returncode": rc,
        "wall_s": round(wall, 1),
        "errors": [],
    }
    if rc != 0:
        result["errors"].append(f"launch failed (rc {rc}); log {args.out / 'logs' / band}.log")
        print(output[-3000:], file=sys.stderr)
        return result
    lines = {int(m.group(1)): m.groups() for m in map(ROLLOUT_LINE.search, output.splitlines()) if m}
    metrics = read_metrics(args.out / "runs" / band)
    firsts = [r for r in metrics if "reward/mean" in r]  # each rollout's first optimizer step
    if 0 not in lines or len(firsts) != args.rollouts:
        result["errors"].append(
            f"expected {args.rollouts} rollouts, got lines {sorted(lines)} / rows {len(firsts)}"
        )
        return result
    _, _, *stats, _ = lines[0]
    result["reward0"] = dict(zip(("mean", "std", "min", "max"), stats))
    result["reward0_raw"] = {k: firsts[0][f"reward/{k}"] for k in ("mean", "std", "min", "max")}
    result["optimizer_steps"] = max(r["step"] for r in metrics)
    canary = [r.get("train/log_prob_mean_abs_diff", 0.0) for r in firsts]  # DiffusionNFT has none: 0
    result["canary"] = canary
    steps = [r["time/step_s"] for r in firsts]
    result["step_time_mean_s"] = sum(steps) / len(steps)
    result["trajectory"] = {
        "reward_mean": [r["reward/mean"] for r in firsts],
        "grad_norm": [r["train/grad_norm"] for r in metrics],
    }

    head, tail = canary[0], canary[-1]
    if not all(math.isfinite(c) and c <= CANARY_MAX for c in canary):
        result["errors"].append(f"canary above {CANARY_MAX:g}: {canary}")
    if tail > CANARY_GROWTH * head + CANARY_FLOOR:
        result["errors"].append(f"canary grows: head {head:.3g} -> tail {tail:.3g}")

    if args.double_run:
        name = f"{band}_rerun"
        print(f"[e2e_bands] {band}: second run, {args.rerun_rollouts} rollouts ...", flush=True)
        rc2, output2, wall2 = launch(args, band, sp, ulysses, name, args.rerun_rollouts, 0)
        double = {"rollouts": args.rerun_rollouts, "wall_s": round(wall2, 1)}
        result["double_run"] = double
        if rc2 != 0:
            result["errors"].append(f"second run failed (rc {rc2}); log {args.out / 'logs' / name}.log")
            print(output2[-3000:], file=sys.stderr)
            return result
        second = read_metrics(args.out / "runs" / name)
        step = max((r["step"] for r in second), default=0)
        double["steps"] = step
        metric_diffs = compare_metrics(metrics, second, step)
        ckpt = f"checkpoints/step_{step:06d}"
        tensors, ckpt_diffs = compare_checkpoints(
            args.out / "runs" / band / ckpt, args.out / "runs" / name / ckpt
        )
        double.update(
            metrics_equal=not metric_diffs,
            weights_equal=not ckpt_diffs and tensors > 0,
            tensors=tensors,
            diffs=(metric_diffs + ckpt_diffs)[:20],
        )
        if metric_diffs:
            result["errors"].append(
                f"double run: metrics differ ({len(metric_diffs)}), e.g. {metric_diffs[0]}"
            )
        if ckpt_diffs or not tensors:
            result["errors"].append(
                f"double run: checkpoints differ ({len(ckpt_diffs)}), e.g. {ckpt_diffs[:1]}"
            )
    return result


# ----------------------------------------------------------------------------------------------
# report


def trajectory_spread(done: list[dict]) -> dict[str, float]:
    """Max over rollouts/steps of (max - min) / max|.| across bands, per trajectory metric."""
    spread = {}
    for key in ("reward_mean", "grad_norm"):
        series = [r["trajectory"][key] for r in done]
        if not series or len({len(s) for s in series}) != 1:
            spread[key] = math.inf
            continue
        spread[key] = max(
            (max(col) - min(col)) / max(max(abs(v) for v in col), 1e-30) for col in zip(*series)
        )
    return spread


def summarize(args: argparse.Namespace, results: list[dict]) -> dict:
    checks = {}
    done = [r for r in results if "reward0" in r]
    stats = {json.dumps(r["reward0"], sort_keys=True) for r in done}
    checks["rollout0_rewards_identical"] = {
        "ok": len(done) == len(results) and len(stats) == 1,
        "detail": "identical to every printed digit"
        if len(stats) == 1
        else f"{len(stats)} distinct: {sorted(stats)}",
    }
    # Informational (the requirement is the printed digits): which bands agree bit for bit.
    # Ulysses is bitwise equal to sp1; ring bands round the attention differently (~1e-7).
    groups: dict[str, list[str]] = {}
    for r in done:
        groups.setdefault(json.dumps(r["reward0_raw"], sort_keys=True), []).append(r["band"])
    spread = (
        {
            k: max(r["reward0_raw"][k] for r in done) - min(r["reward0_raw"][k] for r in done)
            for k in ("mean", "std", "min", "max")
        }
        if done
        else {}
    )
    checks["rollout0_rewards_bitwise"] = {
        "ok": True,
        "detail": "bitwise equal groups "
        + " | ".join("/".join(g) for g in groups.values())
        + "; max spread "
        + ", ".join(f"{k} {v:.1e}" for k, v in spread.items()),
    }
    # The same global groups in every optimizer step: the bands' training agrees to rounding,
    # which grows over the steps but stays orders of magnitude below a change of batch.
    spread = trajectory_spread(done)
    checks["trajectories_agree"] = {
        "ok": len(done) == len(results) and all(v <= TRAJECTORY_RTOL for v in spread.values()),
        "detail": ", ".join(f"{k} max rel spread {v:.1e}" for k, v in spread.items())
        + f" (bound {TRAJECTORY_RTOL:g})",
    }
    for r in results:
        checks[f"band_{r['band']}"] = {"ok": not r["errors"], "detail": "; ".join(r["errors"]) or "pass"}
    ok = all(c["ok"] for c in checks.values())
    return {
        "ok": ok,
        "config": args.config,
        "nproc": args.nproc,
        "global_prompts": args.prompts,
        "rollouts": args.rollouts,
        "double_run": args.double_run,
        "rerun_rollouts": args.rerun_rollouts if args.double_run else None,
        "canary_bound": {"max": CANARY_MAX, "tail_le": f"{CANARY_GROWTH:g} * head + {CANARY_FLOOR:g}"},
        "bands": results,
        "checks": checks,
    }


def render(summary: dict) -> str:
    double = summary["double_run"]
    head = "| band | dp x sp | reward@0 mean | std | min | max | canary head → tail | opt-step (s) | steps |"
    if double:
        head += " double run |"
    lines = [
        f"# E2E bands ({summary['config']}, {summary['nproc']} processes, {summary['global_prompts']} prompts "
        f"per rollout, {summary['rollouts']} rollouts)",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in summary["bands"]:
        layout = (
            f"dp{r['dp']}" if r["sp"] == 1 else f"dp{r['dp']} x sp{r['sp']} (u{r['ulysses']}r{r['ring']})"
        )
        if "reward0" not in r:
            lines.append(f"| {r['band']} | {layout} | FAILED: {'; '.join(r['errors'])} |")
            continue
        rw, c = {k: v or "—" for k, v in r["reward0"].items()}, r["canary"]  # SFT: no reward
        row = (
            f"| {r['band']} | {layout} | {rw['mean']} | {rw['std']} | {rw['min']} | {rw['max']} | "
            f"{c[0]:.1e} → {c[-1]:.1e} | {r['step_time_mean_s']:.2f} | {r['optimizer_steps']} |"
        )
        if double:
            d = r.get("double_run", {})
            verdict = (
                f"bitwise ({d['steps']} steps, {d['tensors']} tensors)"
                if d.get("metrics_equal") and d.get("weights_equal")
                else "DIFFERS"
            )
            row += f" {verdict} |"
        lines.append(row)
    lines += ["", "Checks:", ""]
    lines += [
        f"- {'PASS' if c['ok'] else 'FAIL'} {name}: {c['detail']}" for name, c in summary["checks"].items()
    ]
    lines += [
        "",
        f"Canary bound: every value <= {CANARY_MAX:g}, tail <= {CANARY_GROWTH:g} x head + {CANARY_FLOOR:g}. "
        "opt-step = mean over rollouts of the trainer's time/step_s (wall clock, shared CPU: indicative only).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.algorithm == "sft":
        data = ["-m", "miles.world.sft_data", str(args.out / "sft_data"), "--videos-per-prompt", "1"]
        subprocess.run([sys.executable, *data], cwd=REPO, check=True)
    t0 = time.perf_counter()
    selected = [b for b in BANDS if b[0] in args.bands.split(",")]
    results = [run_band(args, *b) for b in selected]
    summary = summarize(args, results)
    summary["total_wall_s"] = round(time.perf_counter() - t0, 1)
    table = render(summary)
    (args.out / "bands.md").write_text(table)
    (args.out / "bands.json").write_text(json.dumps(summary, indent=1))
    print(table, flush=True)
    print(
        f"[e2e_bands] {'PASS' if summary['ok'] else 'FAIL'} in {summary['total_wall_s']}s; {args.out}/bands.md"
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
