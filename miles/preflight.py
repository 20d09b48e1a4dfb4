"""Reward preflight: sample the prior, then ask whether GRPO can get a signal from the reward.

    python -m miles.preflight --config configs/world_cpu.yaml --out runs/preflight
    python -m miles.preflight --config configs/wan2_1_t2v_1_3b.yaml --num-prompts 4 --reward.weights.pickscore 1.0
    torchrun ... train_grpo.py --config ... --preflight      # the same, before training (stops on "NO signal")

``--num-prompts`` prompts of ``data.prompt_file`` (spread over the file), ``data.group_size`` samples
each, sampled as the held-out evaluation samples (``miles.eval.evaluate``: the rollout's steps,
shift and guidance, ODE, the sample's seed fixing its initial noise, so groups differ by their
initial noise only; the SDE rollouts of training add more spread), decoded and scored by every
configured reward (gold ones too), re-scored ``--rescore`` times, and scored again after a blur,
a frame shuffle and a colour shift (``miles.rewards.preflight``). Prints a table with a verdict
per reward and writes ``OUT/preflight.{json,md}``. One process, on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def sample_groups(cfg, num_prompts: int, device: torch.device) -> tuple[torch.Tensor, list[str]]:
    """The prior's (``cfg.model``) videos (B, F, 3, H, W) of ``num_prompts`` prompts x
    ``data.group_size`` seeds, a prompt's samples consecutive, and their prompts."""
    from miles.data.prompts import load_prompts
    from miles.eval.__main__ import _compute_in
    from miles.eval.evaluate import eval_settings, evaluate
    from miles.models.wan import load_wan

    prompts = load_prompts(cfg.data.prompt_file)
    step = max(len(prompts) // num_prompts, 1)
    chosen = prompts[::step][:num_prompts]
    model = load_wan(cfg.model, device)
    for t in model.transformers:
        _compute_in(t.eval(), cfg.model.dtype)
    image_to_video = model.condition_mode is not None
    result = evaluate(
        model,
        _NoReward(),
        [p.text for p in chosen],
        cfg.data.group_size,
        eval_settings(cfg, model),
        negative_prompt=cfg.data.negative_prompt,
        max_sequence_length=cfg.data.max_sequence_length,
        device=device,
        images=[p.image for p in chosen] if image_to_video else None,
    )
    videos = torch.stack([result["videos"][i] for i in range(len(result["prompts"]))])
    return videos, result["prompts"]


class _NoReward:
    """Sampling only: the preflight scores the videos itself (several times)."""

    names: list[str] = []

    def __call__(self, videos, prompts, images=None):
        return torch.zeros(len(prompts)), {}


def run_preflight(cfg, num_prompts: int = 8, rescore: int = 2, out: Path | None = None, say=print) -> dict:
    """Sample, score and judge (``miles.rewards.preflight``); prints the table with ``say``, writes
    ``out/preflight.{json,md}`` when given. Returns the report."""
    from miles.rewards.from_config import build_configured_rewards
    from miles.rewards.preflight import preflight, table
    from miles.rewards.shaping import EvalRewards

    local = int(os.environ.get("LOCAL_RANK", 0))  # under torchrun (--preflight) every rank runs it alike
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    rewards = EvalRewards(*build_configured_rewards(cfg.reward, device))
    videos, prompts = sample_groups(cfg, num_prompts, device)
    report = preflight(
        rewards, videos, prompts, cfg.data.group_size, rescore=rescore, micro_batch=cfg.train.micro_batch_size
    )
    report["model"] = cfg.model.path
    text = table(report)
    say(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "preflight.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "preflight.md").write_text(text)
    return report


def has_signal(report: dict, trained: list[str]) -> bool:
    """Whether every trained reward (and their mix) passed."""
    return all(report["rewards"][n]["verdict"].startswith("signal") for n in ["reward", *trained])


def main(argv: list[str] | None = None) -> int:
    from miles.config import ConfigError, parse_args
    from miles.console import configure_library_progress, show_progress

    pre = argparse.ArgumentParser(prog="python -m miles.preflight", description=__doc__.split("\n\n")[0])
    pre.add_argument("--config", default=None, help="the recipe (model, prompts, group size, rewards)")
    pre.add_argument("--out", type=Path, default=None)
    pre.add_argument("--num-prompts", type=int, default=8)
    pre.add_argument("--rescore", type=int, default=2, help="times each video is scored again (noise)")
    opts, rest = pre.parse_known_args(argv)
    try:
        cfg, _ = parse_args((["--config", opts.config] if opts.config else []) + rest)
        if not cfg.data.prompt_file:
            raise ConfigError("give the prompts to sample: --data.prompt-file FILE")
        if opts.num_prompts < 2:
            raise ConfigError("--num-prompts must be >= 2")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_library_progress(show_progress(cfg.run.progress))
    report = run_preflight(cfg, opts.num_prompts, opts.rescore, opts.out)
    return 0 if has_signal(report, list(cfg.reward.weights)) else 1


if __name__ == "__main__":
    sys.exit(main())
