"""The trainer's rewards from its ``reward`` config section: the trained mix and the gold rewards.

Every field of ``RewardConfig`` other than ``weights``, ``normalize`` and ``gold`` is a reward
option routed by ``build_rewards`` to the rewards whose constructor takes it (``remote_url`` to
``remote``, ``vlm_*`` to ``vlm_judge``, ``clipscore_path`` to ``clipscore``...), so a new reward
option is one config field plus one constructor parameter of the same name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from miles.rewards.registry import MultiReward, build_rewards, check_resources
from miles.rewards.shaping import check_gold, check_normalize

_SHAPING_FIELDS = frozenset({"weights", "normalize", "gold"})


def reward_options(reward_cfg: Any, device: torch.device | str | None = None) -> dict[str, Any]:
    """The options of ``reward_cfg`` (a ``RewardConfig``) for ``build_rewards``, plus ``device``."""
    options = {
        f.name: getattr(reward_cfg, f.name)
        for f in dataclasses.fields(reward_cfg)
        if f.name not in _SHAPING_FIELDS
    }
    if device is not None:
        options["device"] = device
    return options


def check_reward_config(reward_cfg: Any) -> None:
    """What building the rewards would refuse, loading nothing: shaping options and local weights."""
    check_normalize(reward_cfg.normalize, reward_cfg.weights)
    check_gold(reward_cfg.gold, reward_cfg.weights)
    check_resources([*reward_cfg.weights, *reward_cfg.gold], **reward_options(reward_cfg))


def build_configured_rewards(
    reward_cfg: Any, device: torch.device | str | None = None
) -> tuple[MultiReward, MultiReward | None]:
    """``(trained mix, gold mix or None)``; every folder is checked before any model loads."""
    check_reward_config(reward_cfg)
    options = reward_options(reward_cfg, device)
    trained = build_rewards(reward_cfg.weights, **options)
    gold = build_rewards(dict.fromkeys(reward_cfg.gold, 0.0), **options) if reward_cfg.gold else None
    return trained, gold
