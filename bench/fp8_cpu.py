"""The trainer with FP8 rollouts on CPU: torchao's real float8 path with its hardware check bypassed.

    pip install --target /tmp/taosite torchao==0.18.0   # not in the shared venv: diffusers imports it
    PYTHONPATH=/tmp/taosite:$PWD python bench/fp8_cpu.py --out runs/fp8_cpu     # ~1 min on 2 cores

FP8 is refused on CPU at plan time (``miles.rollout.precision``). torchao's float8 tensors do run
on CPU in torch 2.13 once its CUDA-capability assertion is skipped (``torch._scaled_mm`` on CPU;
fp32 accumulation, not Hopper's fast FP8 accumulation, so the gap here is not the H200's). This
script skips both checks, in its own processes, and runs the tiny recipe (``configs/tiny_cpu.yaml``
in bf16, dp 2, 2 rollouts x 2 optimizer steps) three times: bf16 rollouts, FP8 rollouts with the
correction (``rollout.tis_cap`` 2) and FP8 without it (``tis_cap`` 0). It checks the plumbing
(collect → the float8 swap → accumulate with bf16 old log-probs) with the real library and shows
what the correction does to a rollout's first optimizer step: ratio and clip fraction. Writes
``fp8_cpu.json`` and ``fp8_cpu.md`` to ``--out``. Nothing in ``miles/`` is edited.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "bf16": [],
    "fp8, corrected (tis_cap 2)": ["--rollout.precision", "fp8"],
    "fp8, uncorrected (tis_cap 0)": ["--rollout.precision", "fp8", "--rollout.tis-cap", "0"],
}
KEYS = (
    "train/log_prob_mean_abs_diff",
    "train/tis_logp_gap",
    "train/ratio",
    "train/clipfrac",
    "train/tis_weight_mean",
)


def _child(argv: list[str]) -> int:
    """One training run with both checks bypassed (runs under torchrun)."""
    import torchao  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("torchao") and hasattr(module, "_check_hardware_support"):
            module._check_hardware_support = lambda *a, **k: None
    import miles.train.plan as plan

    plan.check_rollout_precision = lambda *a, **k: []
    sys.path.insert(0, str(ROOT))
    import train_grpo

    return train_grpo.main(argv)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, flags in RUNS.items():
        name = label.split(",")[0] + ("_nocorr" if "uncorrected" in label else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--child",
               "--config", "configs/tiny_cpu.yaml", "--model.dtype", "bfloat16", *flags,
               "--run.output-dir", str(args.out / "runs"), "--run.name", name, "--train.no-resume",
               "--train.overwrite", "--train.no-export", "--train.num-rollouts", "2", "--eval.every", "0",
               "--run.wandb-mode", "disabled"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = [
            json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()
        ]
        results[label] = [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows]
    (args.out / "fp8_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    text = metrics_table(results)
    (args.out / "fp8_cpu.md").write_text(text)
    print(text)


def metrics_table(results: dict) -> str:
    """Per run label and step: the first step's canary, the TIS log-prob gap, the ratio, the clipped
    fraction (the Markdown of ``fp8_cpu.json``, and of ``bench/attention_cpu.py``'s)."""
    lines = [
        "| rollouts | step | canary (first step) | tis_logp_gap | ratio | clipfrac |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, rows in results.items():
        for r in rows:
            canary = r.get("train/log_prob_mean_abs_diff")
            gap = r.get("train/tis_logp_gap")
            lines.append(
                f"| {label} | {r['step']} | {'' if canary is None else f'{canary:.2e}'} | "
                f"{'' if gap is None else f'{gap:.2e}'} | {r['train/ratio']:.7f} | {r['train/clipfrac']:.3f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
