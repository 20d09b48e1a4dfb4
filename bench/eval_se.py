"""The held-out evaluation's own spread: its standard error from one large ``python -m miles.eval`` run.

    python -m miles.eval --config configs/world_cpu.yaml --eval.num-seeds 64 --train.micro-batch-size 32 \\
        --data.prompts-per-rank 8 --eval.no-log-videos --out OUT          # the prior, 8 prompts x 64 seeds
    python bench/eval_se.py OUT/eval.json --seeds-per-block 4 --out docs/learning/eval_se.json

Reads every sample's score, and writes: the mean and per-sample standard deviation; the standard
error sd / sqrt(n) at n = 8 prompts x 4, 8, 16, 32 seeds; and the spread measured directly: the
means of disjoint blocks of ``--seeds-per-block`` seeds (each block is what an evaluation with that
many seeds on other noise would read), their standard deviation, minimum and maximum.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("eval_json", type=Path)
    p.add_argument("--seeds-per-block", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    samples = json.loads(args.eval_json.read_text())["samples"]
    scores = [s["reward"] for s in samples]
    seeds = sorted({s["seed"] for s in samples})
    prompts = sorted({s["prompt"] for s in samples})
    sd = statistics.stdev(scores)
    k = args.seeds_per_block
    blocks = [
        statistics.fmean(s["reward"] for s in samples if seeds[b] <= s["seed"] < seeds[b] + k)
        for b in range(0, len(seeds) - k + 1, k)
    ]
    out = {
        "source": str(args.eval_json),
        "num_samples": len(scores),
        "num_prompts": len(prompts),
        "num_seeds": len(seeds),
        "mean": round(statistics.fmean(scores), 4),
        "per_sample_sd": round(sd, 4),
        "se_by_seeds": {n: round(sd / math.sqrt(len(prompts) * n), 4) for n in (4, 8, 16, 32)},
        "blocks": {
            "seeds_per_block": k,
            "means": [round(m, 4) for m in blocks],
            "sd": round(statistics.stdev(blocks), 4),
            "min": round(min(blocks), 4),
            "max": round(max(blocks), 4),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
