"""The comparison's table (Markdown), its curves from the runs' logs, and the plot (matplotlib, the
``bench`` extra: without it the plot is skipped with a note)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(run_dir: Path | None) -> dict:
    """A run's curves from its logs: the training reward per optimizer step (``metrics.jsonl``'s
    ``reward/mean``, logged on the first step of each rollout) and every held-out evaluation
    (``eval.jsonl``), each with the seconds since the run's first logged row."""
    if run_dir is None:
        return {}
    train = [r for r in _rows(run_dir / "metrics.jsonl") if "reward/mean" in r]
    evals = _rows(run_dir / "eval.jsonl")
    times = [r["time"] for r in train + evals]
    if not times:
        return {}
    t0 = min(times)
    return {
        "train": [{"step": r["step"], "s": r["time"] - t0, "reward": r["reward/mean"]} for r in train],
        "eval": [
            {
                "step": r["step"],
                "s": r["time"] - t0,
                **{k[5:-5]: v for k, v in r.items() if k.endswith("/mean")},
            }
            for r in evals
        ],
    }


def table(comparison: dict) -> str:
    """Markdown: each run's mean ± SE per reward, then every pair and twin with its verdict."""
    n = comparison["num_samples"]
    lines = [f"Held-out scores ({n} samples, the same prompts, seeds and noise for every run)", ""]
    lines += ["| reward | run | mean | SE |", "|---|---|---|---|"]
    for name, entry in comparison["rewards"].items():
        for label, r in entry["runs"].items():
            lines.append(f"| {name} | {label} | {r['mean']:.4f} | {r['se']:.4f} |")
    lines += ["", "| reward | A − B | paired SE | verdict |", "|---|---|---|---|"]
    for name, entry in comparison["rewards"].items():
        for p in entry["pairs"] + entry["twins"]:
            twin = " (negated twin)" if p in entry["twins"] else ""
            lines.append(
                f"| {name} | {p['a']} − {p['b']}{twin} = {p['diff']:+.4f} | {p['se']:.4f} | {p['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def plot(path: Path, comparison: dict, runs_curves: dict[str, dict], reward: str) -> Path | None:
    """Held-out means ± SE per run, the paired differences, and (when the runs have logs) the
    training reward and ``reward``'s held-out curve per step and per second. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    with_curves = any(runs_curves.values())
    fig, axes = plt.subplots(2 if with_curves else 1, 2, figsize=(11, 8 if with_curves else 4), squeeze=False)
    entry = comparison["rewards"][reward]
    labels = list(entry["runs"])
    ax = axes[0][0]
    means = [entry["runs"][k]["mean"] for k in labels]
    ax.errorbar(range(len(labels)), means, yerr=[entry["runs"][k]["se"] for k in labels], fmt="o", capsize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_title(f"held-out {reward} (mean ± SE)")
    ax = axes[0][1]
    pairs = entry["pairs"] + entry["twins"]
    ax.errorbar(
        range(len(pairs)), [p["diff"] for p in pairs], yerr=[p["se"] for p in pairs], fmt="s", capsize=4
    )
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(pairs)), [f"{p['a']} − {p['b']}" for p in pairs], rotation=20)
    ax.set_title("paired difference ± paired SE")
    if with_curves:
        for col, x in enumerate(("step", "s")):
            ax = axes[1][col]
            for label, c in runs_curves.items():
                if not c:
                    continue
                line = ax.plot([r[x] for r in c["train"]], [r["reward"] for r in c["train"]], alpha=0.5, lw=1)
                ev = [r for r in c["eval"] if reward in r]
                ax.plot(
                    [r[x] for r in ev], [r[reward] for r in ev], "o-", color=line[0].get_color(), label=label
                )
            ax.set_xlabel("optimizer step" if x == "step" else "seconds")
            ax.set_title(f"training reward (thin) and held-out {reward} (dots)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def finite(obj):
    """``obj`` with inf/nan floats as strings (JSON has no infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
