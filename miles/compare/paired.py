"""Paired differences of per-sample held-out scores, their standard errors and a verdict.

Every run is scored on the same (prompt, seed) samples with the same initial noise
(``miles.eval``), so run A minus run B is a paired difference per sample; its standard error is
std(differences) / sqrt(n) (sample std, n − 1), the statistic ``tests/e2e/test_learning.py`` asks
for. A verdict is "A > B by 4.1 SE" when the mean difference is at least ``z`` standard errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_se of no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def verdict(a: str, b: str, diff: float, se: float, z: float) -> str:
    """``"A > B by 4.1 SE"``, ``"A ≈ B (+1.2 SE, under 3)"`` or ``"A = B (identical scores)"``."""
    if se == 0.0:
        if diff == 0.0:
            return f"{a} = {b} (identical scores)"
        hi, lo = (a, b) if diff > 0 else (b, a)
        return f"{hi} > {lo} (every sample by the same {abs(diff):.4g})"
    score = diff / se
    if abs(score) < z:
        return f"{a} ≈ {b} ({score:+.1f} SE, under {z:g})"
    hi, lo = (a, b) if score > 0 else (b, a)
    return f"{hi} > {lo} by {abs(score):.1f} SE"


def paired(a: Sequence[float], b: Sequence[float], names: tuple[str, str], z: float) -> dict:
    """The paired comparison of two runs' per-sample scores (the same samples, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"paired scores differ in length: {len(a)} vs {len(b)}")
    diff, se = mean_se([x - y for x, y in zip(a, b)])
    return {
        "a": names[0],
        "b": names[1],
        "mean_a": mean_se(a)[0],
        "mean_b": mean_se(b)[0],
        "diff": diff,
        "se": se,
        "z": diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff)),
        "verdict": verdict(names[0], names[1], diff, se, z),
    }


def aligned(runs: dict[str, dict]) -> tuple[list[tuple[str, int]], list[str]]:
    """The (prompt, seed) samples and reward names every run holds, checked to be the same set:
    a comparison of different prompts or seeds is refused, naming the runs."""
    first_label, first = next(iter(runs.items()))
    keys = sorted(first["scores"])
    names = first["names"]
    for label, run in runs.items():
        if sorted(run["scores"]) != keys:
            raise ValueError(
                f"{label} was evaluated on other prompts or seeds than {first_label}: compare runs "
                "evaluated with the same eval.prompt_file and eval.num_seeds"
            )
        missing = [n for n in names if n not in run["names"]]
        if missing:
            raise ValueError(f"{label} has no scores for {', '.join(missing)} ({first_label} has)")
    return keys, names


def compare_all(runs: dict[str, dict], z: float, twins: dict[str, str] | None = None) -> dict:
    """Per reward: each run's mean and SE, every pair (in the given order) compared, and each run
    against its negated twin (``twins``: run label -> twin label, both in ``runs``)."""
    keys, names = aligned(runs)
    labels = [label for label in runs if label not in (twins or {}).values()]
    out = {"num_samples": len(keys), "rewards": {}}
    for name in names:
        rows = {label: [runs[label]["scores"][k][name] for k in keys] for label in runs}
        entry = {
            "runs": {label: dict(zip(("mean", "se"), mean_se(rows[label]))) for label in runs},
            "pairs": [
                paired(rows[a], rows[b], (a, b), z) for i, a in enumerate(labels) for b in labels[i + 1 :]
            ],
            "twins": [paired(rows[a], rows[t], (a, t), z) for a, t in (twins or {}).items()],
        }
        out["rewards"][name] = entry
    return out
