"""The trainer with INT8 rollout attention on CPU: the kernel's float formula standing in for it.

    python bench/attention_cpu.py --out runs/attention_cpu     # a few minutes on 2 cores

``rollout.attention_precision sage_int8`` is refused on CPU at plan time (Triton kernels, CUDA only;
the tiny model's 16-wide heads too). This script skips that check in its own processes and makes
the kernel :func:`miles.rollout.attention.sage_int8_reference` (SageAttention's arithmetic in
float32: per-block INT8 Q and K, fp16 P and V), then runs the tiny recipe (``configs/tiny_cpu.yaml``
in bf16, dp 2, 2 rollouts x 2 optimizer steps, Flow-GRPO with ``grpo.clip_range`` 1e-4) three
times: bf16 rollouts, INT8-attention rollouts with the correction (``rollout.tis_cap`` 2) and
without it (``tis_cap`` 0). It checks the plumbing (collect → the self-attention switch → accumulate
with bf16 old log-probs) through the real trainer and shows what the correction does to a rollout's
first optimizer step. The formula is a CPU stand-in, not the kernel's speed. Writes
``attention_cpu.json`` and ``attention_cpu.md`` to ``--out``. Nothing in ``miles/`` is edited.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "bf16": [],
    "int8 attention, corrected (tis_cap 2)": ["--rollout.attention-precision", "sage_int8"],
    "int8 attention, uncorrected (tis_cap 0)": [
        "--rollout.attention-precision",
        "sage_int8",
        "--rollout.tis-cap",
        "0",
    ],
}
KEYS = (
    "train/log_prob_mean_abs_diff",
    "train/tis_logp_gap",
    "train/ratio",
    "train/clipfrac",
    "train/tis_weight_mean",
)


def _child(argv: list[str]) -> int:
    """One training run with the check bypassed and the formula as the kernel (under torchrun)."""
    import miles.rollout.attention as attention
    import miles.train.plan as plan

    spec = attention.KERNELS["sage_int8"]
    attention.KERNELS["sage_int8"] = dataclasses.replace(spec, load=lambda: attention.sage_int8_reference)
    plan.check_attention_precision = lambda *a, **k: []
    sys.path.insert(0, str(ROOT))
    import train_grpo

    return train_grpo.main(argv)


def _table(results: dict) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fp8_cpu import metrics_table  # the same table as the FP8 Linears' CPU run

    return metrics_table(results)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, flags in RUNS.items():
        name = label.split(",")[0].replace(" ", "_") + ("_nocorr" if "uncorrected" in label else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--child",
               "--config", "configs/tiny_cpu.yaml", "--model.dtype", "bfloat16", *flags,
               "--run.output-dir", str(args.out / "runs"), "--run.name", name, "--train.no-resume",
               "--train.overwrite", "--train.no-export", "--train.num-rollouts", "2", "--eval.every", "0",
               "--run.wandb-mode", "disabled"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = [
            json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()
        ]
        results[label] = [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows]
    (args.out / "attention_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    text = _table(results)
    (args.out / "attention_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
