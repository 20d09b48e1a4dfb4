"""Curves of several seeds as one result: mean and spread of each run's held-out numbers.

    python bench/learning_seeds.py --out docs/learning/ltx/gpu/seeds.json DIR_SEED0 DIR_SEED1 DIR_SEED2

Each DIR holds a ``learning.json`` of ``bench/learning.py`` (one seed's runs: a method and its
negated twin). For every run name present in all of them: the held-out adherence at the first
and the last evaluation per seed, their mean, standard deviation (n − 1) and range, the error
ratio (1 − final) / (1 − baseline) of the means, and the step and evaluation count. Writes the
JSON and a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(results: list[dict]) -> dict:
    names = [n for n in results[0] if all(n in r for r in results[1:])]
    out = {}
    for name in names:
        first = [r[name]["eval"][0]["adherence"] for r in results]
        last = [r[name]["eval"][-1]["adherence"] for r in results]
        steps = sorted({r[name]["eval"][-1]["step"] for r in results})
        mean_first, mean_last = statistics.fmean(first), statistics.fmean(last)
        out[name] = {
            "seeds": len(results),
            "final_step": steps,
            "baseline": first,
            "final": last,
            "baseline_mean": mean_first,
            "final_mean": mean_last,
            "final_std": statistics.stdev(last) if len(last) > 1 else 0.0,
            "final_range": [min(last), max(last)],
            "error_ratio_of_means": (1 - mean_last) / max(1 - mean_first, 1e-9),
        }
    return out


def markdown(summary: dict) -> str:
    lines = [
        "| run | seeds | steps | held-out baseline | final per seed | final mean ± std (range) | error ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        per = " / ".join(f"{x:.3f}" for x in s["final"])
        lines.append(
            f"| {name} | {s['seeds']} | {'/'.join(map(str, s['final_step']))} | {s['baseline_mean']:.3f} | {per} | "
            f"{s['final_mean']:.3f} ± {s['final_std']:.3f} ({s['final_range'][0]:.3f}–{s['final_range'][1]:.3f}) | "
            f"×{s['error_ratio_of_means']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the summary JSON (its .md beside it)")
    p.add_argument("dirs", nargs="+", type=Path, help="folders with one seed's learning.json each")
    args = p.parse_args(argv)
    results = [json.loads((d / "learning.json").read_text()) for d in args.dirs]
    summary = summarize(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"sources": [str(d) for d in args.dirs], "runs": summary}, indent=1) + "\n"
    )
    md = markdown(summary)
    args.out.with_suffix(".md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
