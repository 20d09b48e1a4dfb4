"""The compiled canary on the world: does training's forward recompute the rollout's log-probs bit for bit?

    python bench/canary_compile.py --out OUT                       # every variant, one after another (GPU)
    python bench/canary_compile.py --out OUT --variants fp32 fp32-no-patterns --parallel

The trainer logs ``log_prob_mean_abs_diff`` on the first optimizer step of every rollout: the
training forward's log-probs of the rollout's transitions minus the rollout's own, with the same
weights (docs: BENCHMARKS.md, "Numerics of the compiled step"). Compiled, it is 0 for the bf16 1.3B
recipe but ~1e-6 on the world, whose recipe computes in fp32. The explanation written down from
Inductor's source (issue 35): in fp32, Inductor's post-grad pattern ``unfuse_bias_add_to_pointwise``
splits ``addmm`` into ``mm`` + a fused bias add when every use of the output is pointwise, which holds
in the rollout's no-grad graph but not in training's (which saves those outputs for backward), so the
two graphs round differently; in bf16 the pass keeps ``addmm`` whole. Each variant tests one part:

- ``fp32``: the world recipe as it ships (compiled, fp32): expected non-zero.
- ``fp32-no-patterns``: the same with ``torch._inductor.config.pattern_matcher = False`` (no post-grad
  pattern rewrites at all): expected 0 if the unfused bias add is the cause.
- ``bf16``: ``--model.dtype bfloat16``: expected 0 by that explanation; measured 1.5e-6 to 3.4e-6 on the
  H200 in one call and 0 in the next (BENCHMARKS.md): the bf16 gap varies from run to run.
- ``bf16-ckpt-full``: bf16 with ``--model.activation-checkpointing full`` (training's graph then saves
  only block inputs, as the 1.3B recipe's mostly does, whose canary is 0): expected 0 if the kernels
  cut differently around saved tensors are the cause.
- ``fp32-eager``: ``--model.compile off``: expected 0.
- ``bf16-det``: bf16 with ``--deterministic-mode`` (Inductor's deterministic mode: no autotuning of
  kernel configs, flash attention): expected 0 in every call if run-to-run autotuning is the cause.
- ``bf16-flash``: bf16 with flash attention and no deterministic mode: tells the attention kernel
  apart from Inductor's deterministic reduction configs in ``bf16-det``.
- ``fp32-det``: the fp32 world under ``--deterministic-mode``.

Each variant is one process (world 1, the GPU path's batch: 8 prompt groups of 8 samples, micro-batches
of 16), ``--rollouts`` rollouts; the wall time is reported so the cost of a variant shows.
Writes ``canary.json`` and ``canary.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "fp32": [],
    "fp32-no-patterns": [],
    "bf16": ["--model.dtype", "bfloat16"],
    "bf16-ckpt-full": ["--model.dtype", "bfloat16", "--model.activation-checkpointing", "full"],
    "fp32-eager": ["--model.compile", "off"],
    "bf16-det": ["--model.dtype", "bfloat16", "--deterministic-mode"],
    "bf16-flash": ["--model.dtype", "bfloat16", "--fsdp-attention-backend", "_native_flash"],
    "fp32-det": ["--deterministic-mode"],
}
_NO_PATTERNS = {"fp32-no-patterns"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, out: Path, rollouts: int, config: str) -> None:
    """One variant, in this process (called with ``--_one``): Inductor's setting, then the trainer."""
    import torch._inductor.config

    if name in _NO_PATTERNS:
        torch._inductor.config.pattern_matcher = False
    sys.path.insert(0, str(ROOT))
    import train_grpo

    argv = ["--config", config, "--run.output-dir", str(out), "--run.name", name, "--run.no-progress"]
    argv += ["--train.no-export", "--train.no-resume", "--train.overwrite", "--run.wandb-mode", "disabled"]
    argv += ["--train.num-rollouts", str(rollouts), "--model.compile", "on"]
    argv += ["--data.prompts-per-rank", "8", "--train.micro-batch-size", "16", *VARIANTS[name]]
    raise SystemExit(train_grpo.main(argv))


def launch(name: str, out: Path, rollouts: int, config: str) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "HF_HUB_OFFLINE": "1"})
    cmd = [sys.executable, __file__, "--out", str(out), "--rollouts", str(rollouts), "--config", config]
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen([*cmd, "--_one", name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, time.monotonic()


def read_canary(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "train/log_prob_mean_abs_diff"
    return [r[key] for r in rows if key in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--config", default="configs/world_cpu.yaml")
    p.add_argument("--parallel", action="store_true", help="run the variants at once (they share the GPU)")
    p.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args._one:
        run_variant(args._one, args.out, args.rollouts, args.config)
    procs, results = {}, {}
    for name in args.variants:
        procs[name] = launch(name, args.out, args.rollouts, args.config)
        if not args.parallel:
            procs[name][0].wait()
    for name, (proc, t0) in procs.items():
        rc = proc.wait()
        wall = time.monotonic() - t0
        canary = read_canary(args.out / name) if rc == 0 else None
        results[name] = {"rc": rc, "wall_s": round(wall, 1), "canary_per_rollout": canary}
        (args.out / "canary.json").write_text(json.dumps(results, indent=1))
    lines = ["| variant | canary per rollout (first step) | rc | wall s |", "| --- | --- | ---: | ---: |"]
    for name, r in results.items():
        values = ", ".join(f"{v:.2e}" for v in r["canary_per_rollout"] or []) or "—"
        lines.append(f"| {name} | {values} | {r['rc']} | {r['wall_s']} |")
    (args.out / "canary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
