"""The trainer's rewards from its ``reward`` config section: the trained mix and the gold rewards.

``reward.weights``, ``normalize`` and ``gold`` choose and mix the rewards, ``reward.num_frames`` is the
common frame count, and each reward's options come from its own section ``reward.NAME`` (the options
dataclass registered with it, ``miles.rewards.registry``), passed to it field for field.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from miles.rewards.registry import (
    MultiReward,
    build_rewards,
    check_resources,
    estimated_resident_bytes,
    needs_images,
    registered_rewards,
    reward_option_classes,
)
from miles.rewards.shaping import check_gold, check_normalize


def reward_sections(reward_cfg: Any) -> dict[str, Any]:
    """``{reward name: its options}``: the section of ``reward_cfg`` (a ``RewardConfig``) of every
    reward that has options."""
    return {name: getattr(reward_cfg, name) for name in reward_option_classes()}


def common_arguments(reward_cfg: Any, device: torch.device | str | None = None) -> dict[str, Any]:
    """What every reward that takes it gets: ``num_frames`` (``reward.num_frames``) and ``device``."""
    common: dict[str, Any] = {"num_frames": reward_cfg.num_frames}
    if device is not None:
        common["device"] = device
    return common


def check_reward_config(reward_cfg: Any) -> None:
    """What building the rewards would refuse, loading nothing: shaping options and local weights."""
    check_normalize(reward_cfg.normalize, reward_cfg.weights)
    check_gold(reward_cfg.gold, reward_cfg.weights)
    check_resources([*reward_cfg.weights, *reward_cfg.gold], reward_sections(reward_cfg))


def check_reward_names(reward_cfg: Any) -> None:
    """Every name in ``reward.weights`` and ``reward.gold`` is a registered reward (ValueError naming them)."""
    known = registered_rewards()
    for name in reward_cfg.weights:
        if name not in known:
            raise ValueError(
                f"reward.weights names an unknown reward {name!r}; registered rewards: {known} "
                "(set one with --reward.weights.NAME WEIGHT)"
            )
    for name in reward_cfg.gold:
        if name not in known:
            raise ValueError(f"reward.gold names an unknown reward {name!r}; registered rewards: {known}")


def check_reward_inputs(reward_cfg: Any) -> None:
    """What building the rewards refuses, without constructing one (PickScore would load CLIP-H):
    the names, finite weights, shaping options and every reward's local weights."""
    check_reward_names(reward_cfg)
    for name, weight in reward_cfg.weights.items():
        if not math.isfinite(weight):
            raise ValueError(f"reward.weights.{name} must be a finite number, got {weight}")
    check_reward_config(reward_cfg)


def check_image_rewards(reward_cfg: Any, image_to_video: bool) -> None:
    """The trainer's refusal of a reward that scores against the given first frame (``needs_images``)
    in a text-to-video run."""
    needs = [n for n in reward_cfg.weights if n in registered_rewards() and needs_images(n)]
    if needs and not image_to_video:
        raise ValueError(
            f"reward.weights {sorted(reward_cfg.weights)}: a reward scores against each sample's given "
            "first frame, but the model is text-to-video; use an image-to-video model (model.task i2v)"
        )


def estimated_reward_bytes(reward_cfg: Any) -> int:
    """The device bytes of the trained and gold rewards' models, estimated from their weight files
    (``miles.rewards.registry.estimated_resident_bytes``): the plan's ``rewards`` memory term."""
    return estimated_resident_bytes([*reward_cfg.weights, *reward_cfg.gold], reward_sections(reward_cfg))


def build_configured_rewards(
    reward_cfg: Any, device: torch.device | str | None = None
) -> tuple[MultiReward, MultiReward | None]:
    """``(trained mix, gold mix or None)``; every folder is checked before any model loads."""
    check_reward_config(reward_cfg)
    sections, common = reward_sections(reward_cfg), common_arguments(reward_cfg, device)
    trained = build_rewards(reward_cfg.weights, sections, **common)
    gold = build_rewards(dict.fromkeys(reward_cfg.gold, 0.0), sections, **common) if reward_cfg.gold else None
    return trained, gold
