"""The config's cross-field checks: combinations of values that each lie in range but that no run
can use (``miles.config.validate`` raises the first failing one as a ``ConfigError``). Per-field
ranges are the parts' ``RANGES`` tables; an algorithm's own checks are its ``check`` (the registry's
``algorithm_errors``)."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from miles.algorithms import algorithm_errors


def field_checks(cfg: Any) -> list[tuple[bool, str]]:
    """(ok, message) for every cross-field check of ``cfg``, in the order they are reported."""
    return [*_rollout_checks(cfg), *_train_checks(cfg)]


def _rollout_checks(cfg: Any) -> list[tuple[bool, str]]:
    return [
        ((cfg.rollout.num_frames - 1) % 4 == 0, "rollout.num_frames must be 4k+1 (1, 5, 9, ... 81)"),
        (
            cfg.rollout.height % 16 == 0 and cfg.rollout.width % 16 == 0,
            "rollout.height/width must be multiples of 16",
        ),
        (
            cfg.rollout.sde_type != "flow_grpo_wan"
            or cfg.rollout.sde_window_size > 0
            or math.floor(round(cfg.rollout.timestep_fraction * cfg.rollout.num_steps, 9)) >= 1,
            f"rollout.sde_type flow_grpo_wan trains floor(rollout.timestep_fraction * rollout.num_steps) "
            f"= floor({cfg.rollout.timestep_fraction} * {cfg.rollout.num_steps}) = 0 steps: raise "
            f"rollout.timestep_fraction to at least 1 / num_steps (its Wan recipe uses 0.99)",
        ),
        (
            cfg.rollout.sde_type != "cps" or cfg.rollout.noise_level <= 1.0,
            "rollout.noise_level must be in (0, 1] with rollout.sde_type cps (sigma_t = sigma_next * sin(a*pi/2))",
        ),
        (len(cfg.rollout.sde_window_range) == 2, "rollout.sde_window_range must be [lo, hi]"),
        (
            cfg.rollout.tis_cap == 0 or cfg.rollout.tis_cap >= 1,
            "rollout.tis_cap must be >= 1 (the truncation cap of the importance weight; 2 is usual) or 0 (no correction)",
        ),
    ]


def _train_checks(cfg: Any) -> list[tuple[bool, str]]:
    return [
        (
            cfg.train.lr_schedule != "cosine"
            or cfg.train.lr_warmup_steps < cfg.train.num_rollouts * cfg.train.steps_per_rollout,
            "train.lr_warmup_steps must be below the run's optimizer steps (train.num_rollouts x "
            "train.steps_per_rollout) for the cosine schedule to have steps to anneal over",
        ),
        (
            not cfg.run.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            "run.tensorboard needs the tensorboard package: pip install 'miles[tensorboard]'",
        ),
        (
            cfg.train.guard == "off" or (bool(cfg.eval.prompt_file) and cfg.eval.every > 0),
            "train.guard watches the held-out evaluations: it needs eval.prompt_file and eval.every > 0",
        ),
        (
            cfg.train.guard_reward in (None, "reward", *cfg.reward.weights, *cfg.reward.gold),
            f"train.guard_reward {cfg.train.guard_reward!r} is not evaluated: give reward, a trained reward "
            f"({', '.join(cfg.reward.weights)}) or a reward.gold one",
        ),
        (
            not (cfg.train.overwrite and cfg.train.resume),
            "--train.overwrite deletes the previous run: it needs --train.no-resume",
        ),
        (len(cfg.train.adam_betas) == 2, "train.adam_betas must have two values"),
        (
            cfg.train.learning_rate * cfg.train.weight_decay < 1,
            f"train.learning_rate * train.weight_decay = {cfg.train.learning_rate * cfg.train.weight_decay:g}: "
            "AdamW multiplies every weight by 1 - lr * weight_decay each step, so >= 1 zeroes (or flips) "
            "them all; fine-tunes use a weight decay of 0 to 0.1",
        ),
        *((False, message) for message in algorithm_errors(cfg)),  # the algorithm's own checks
        (bool(cfg.reward.weights), "reward.weights must name at least one reward"),
    ]


def batch_split_error(cfg: Any) -> str | None:
    """Why a rank's samples do not split into the optimizer steps' whole micro-batches (None: they do)."""
    samples = cfg.data.prompts_per_rank * cfg.data.group_size
    per_step = samples // cfg.train.steps_per_rollout
    if samples % cfg.train.steps_per_rollout or per_step % cfg.train.micro_batch_size:
        return (
            f"data.prompts_per_rank * data.group_size = {samples} samples per rank must split into "
            f"train.steps_per_rollout = {cfg.train.steps_per_rollout} optimizer steps of whole "
            f"micro-batches of train.micro_batch_size = {cfg.train.micro_batch_size}"
        )
    return None
