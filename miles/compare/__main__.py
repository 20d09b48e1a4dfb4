"""Compare runs on the same held-out prompts, seeds and noise: paired differences, verdicts, curves.

    python -m miles.compare runs/nft runs/flow_grpo --out runs/compare          # two run directories
    python -m miles.compare miles/world/pipeline runs/nft/export/pipeline \\
        --config configs/world_cpu.yaml --out /tmp/cmp                            # the prior vs an export
    python -m miles.compare runs/a runs/b --twin a=runs/a_negated --twin b=runs/b_negated --out OUT
    python -m miles.compare runs/a/eval/step_000010.json runs/b/eval/step_000010.json --out OUT

Each run (``miles.compare.sources``: a run directory, an export, a checkpoint or an evaluation JSON)
is sampled on the config's held-out prompts × ``eval.num_seeds`` seeds by ``miles.eval.evaluate``,
with one config for all (``--config``, default the first run directory's ``config.yaml``; any field
can be overridden as for ``train_grpo.py``, e.g. ``--eval.prompt-file``), so every run sees each
sample's same initial noise and the difference of two runs is paired per sample. Per reward (the
combined one and each configured reward, gold rewards included): each run's mean ± SE, every pair
(in the order given) with its paired SE and a verdict ("a > b by 4.1 SE" at ``--z`` or more), and
each ``--twin RUN=TWIN``'s separation. Writes ``OUT/compare.json`` (everything, with the curves),
``OUT/compare.md`` (the table), ``OUT/compare.png`` (with matplotlib: means, differences, and the
run directories' training and held-out curves per step and per second) and ``OUT/<run>/eval.json``
(each sampled run's per-sample scores). One process, on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _parse(argv: list[str] | None):
    from miles.compare.sources import resolve
    from miles.config import parse_args
    from miles.files import check_writable

    pre = argparse.ArgumentParser(prog="python -m miles.compare", description=__doc__.split("\n\n")[0])
    pre.add_argument("runs", nargs="+", help="run directories, exports, checkpoints or eval JSONs")
    pre.add_argument("--out", type=Path, required=True)
    pre.add_argument("--names", nargs="+", default=None, help="a label per run (default: its directory)")
    pre.add_argument("--twin", action="append", default=[], metavar="RUN=TWIN", help="a run's negated twin")
    pre.add_argument("--z", type=float, default=3.0, help="standard errors for a verdict (default 3)")
    pre.add_argument("--config", default=None)
    opts, rest = pre.parse_known_args(argv)
    if len(opts.runs) < 2:
        raise ValueError("give two or more runs to compare")
    if opts.names is not None and len(opts.names) != len(opts.runs):
        raise ValueError(f"--names gives {len(opts.names)} labels for {len(opts.runs)} runs")
    sources = [resolve(r, n) for r, n in zip(opts.runs, opts.names or [None] * len(opts.runs))]
    twins = {}
    for spec in opts.twin:
        run, sep, twin = spec.partition("=")
        if not sep or run not in {s.label for s in sources}:
            raise ValueError(f"--twin {spec}: give RUN=TWIN, RUN one of {[s.label for s in sources]}")
        sources.append(resolve(twin, f"{run} negated"))
        twins[run] = f"{run} negated"
    labels = [s.label for s in sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs share a label ({labels}): name them with --names")
    config = opts.config or next((str(s.run_dir / "config.yaml") for s in sources if s.run_dir), None)
    if config is None:
        raise ValueError("give --config (the evaluation settings): no run directory to take them from")
    cfg, _ = parse_args(["--config", config, *rest])
    if not cfg.eval.prompt_file and any(s.kind != "eval_json" for s in sources):
        raise ValueError("give the prompts to evaluate: --eval.prompt-file FILE")
    check_writable(opts.out, what="--out")
    return cfg, sources, twins, opts


def main(argv: list[str] | None = None) -> int:
    from miles.compare.paired import compare_all
    from miles.compare.report import curves, finite, plot, table
    from miles.compare.sources import evaluate_source
    from miles.config import ConfigError
    from miles.console import configure_library_progress, show_progress
    from miles.rewards.from_config import build_configured_rewards
    from miles.rewards.shaping import EvalRewards

    try:
        cfg, sources, twins, opts = _parse(argv)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_library_progress(show_progress(cfg.run.progress))  # no bars into a redirected log
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rewards = None
    if any(s.kind != "eval_json" for s in sources):
        rewards = EvalRewards(*build_configured_rewards(cfg.reward, device))
    scores = {}
    for s in sources:
        print(f"[compare] {s.label}: {s.kind} {s.path}", flush=True)
        scores[s.label] = evaluate_source(s, cfg, rewards, device, opts.out)
    try:
        comparison = compare_all(scores, opts.z, twins)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs_curves = {s.label: curves(s.run_dir) for s in sources}
    text = table(comparison)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "compare.md").write_text(text)
    report = {
        "runs": {s.label: {"kind": s.kind, "path": str(s.path), "run_dir": str(s.run_dir)} for s in sources},
        "eval": {"prompt_file": cfg.eval.prompt_file, "num_seeds": cfg.eval.num_seeds, "seed": cfg.eval.seed},
        "z": opts.z,
        **comparison,
        "curves": runs_curves,
    }
    (opts.out / "compare.json").write_text(json.dumps(finite(report), indent=1))
    print(text)
    reward = (
        next(n for n in comparison["rewards"] if n != "reward")
        if len(comparison["rewards"]) > 1
        else "reward"
    )
    png = plot(opts.out / "compare.png", comparison, runs_curves, reward)
    print(f"wrote {opts.out / 'compare.json'}, {opts.out / 'compare.md'}" + (f", {png}" if png else ""))
    if png is None:
        print("(no plot: matplotlib is not installed; pip install 'miles[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
