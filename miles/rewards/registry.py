"""Reward registry and the weighted sum the trainer optimises.

Register a reward class (or factory) with ``@register_reward("name")``; the trainer builds the
configured mix once, before any rollout, with ``build_rewards({"pickscore": 1.0}, **options)``.
Each option goes only to the rewards whose constructor takes it (``num_frames`` to every image
reward, ``pickscore_path`` to PickScore), so one flat ``reward`` config section serves them all.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from miles.rewards.base import Reward, check_videos

_REGISTRY: dict[str, Callable[..., Reward]] = {}

T = TypeVar("T", bound=Callable[..., Reward])


def register_reward(name: str) -> Callable[[T], T]:
    """Class/factory decorator: make ``name`` selectable in ``build_rewards``."""

    def decorator(factory: T) -> T:
        if name in _REGISTRY:
            raise ValueError(
                f"reward {name!r} is already registered (by {_REGISTRY[name]!r}); pick another name"
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def registered_rewards() -> list[str]:
    """Names accepted by ``build_rewards``, sorted."""
    return sorted(_REGISTRY)


def _accepted_options(factory: Callable[..., Reward]) -> set[str]:
    params = inspect.signature(factory).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class MultiReward:
    """The weighted sum of several rewards: ``combined = sum_i weight_i * reward_i``."""

    def __init__(self, rewards: Mapping[str, Reward], weights: Mapping[str, float]) -> None:
        assert rewards.keys() == weights.keys(), (rewards.keys(), weights.keys())
        self.rewards = dict(rewards)
        self.weights = {name: float(w) for name, w in weights.items()}

    @property
    def names(self) -> list[str]:
        return list(self.rewards)

    @property
    def needs_images(self) -> bool:
        """Whether a reward of the mix scores against each sample's condition image."""
        return any(r.needs_images for r in self.rewards.values())

    def __call__(
        self, videos: torch.Tensor, prompts: Sequence[str], images: Sequence | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score ``videos`` (B, F, C, H, W) in [0, 1] against ``prompts`` (B,) and, for the rewards
        that need them (``Reward.needs_images``), the samples' condition ``images`` (B,).

        Returns ``(combined, per_reward)``: (B,) float32 on ``videos.device`` and the unweighted
        score of each reward under its name (also (B,) float32 on ``videos.device``).
        """
        check_videos(videos, prompts)
        batch = videos.shape[0]
        combined = torch.zeros(batch, dtype=torch.float32, device=videos.device)
        per_reward: dict[str, torch.Tensor] = {}
        for name, reward in self.rewards.items():
            if reward.needs_images:
                if images is None or len(images) != batch:
                    raise ValueError(
                        f"reward {name!r} scores image-to-video samples against their first frame: it needs "
                        "an image-to-video model and a JSONL prompt file with an 'image' per prompt"
                    )
                score = reward(videos, prompts, images=images)
            else:
                score = reward(videos, prompts)
            if not isinstance(score, torch.Tensor) or tuple(score.shape) != (batch,):
                got = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
                raise ValueError(f"reward {name!r} returned {got}; rewards must return a ({batch},) tensor")
            score = score.detach().to(device=videos.device, dtype=torch.float32)
            per_reward[name] = score
            combined = combined + self.weights[name] * score
        return combined, per_reward

    def __repr__(self) -> str:
        return f"MultiReward({self.weights})"


def build_rewards(specs: Mapping[str, float], **options: Any) -> MultiReward:
    """Build the reward mix ``{name: weight}``; ``options`` are routed to the rewards that take them.

    Everything is validated (names, weights, options) before any reward is constructed, and each
    reward validates and loads its own resources in its constructor, so call this before the
    first rollout to fail early.
    """
    if not isinstance(specs, Mapping) or not specs:
        raise ValueError(
            f"reward.weights must name at least one reward with its weight, e.g. {{'pickscore': 1.0}}; "
            f"got {specs!r}. Registered rewards: {registered_rewards()}"
        )
    for name, weight in specs.items():
        if name not in _REGISTRY:
            raise ValueError(f"unknown reward {name!r}; registered rewards: {registered_rewards()}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(float(weight))
        ):
            raise ValueError(f"the weight of reward {name!r} must be a finite number; got {weight!r}")
    known = set().union(*(_accepted_options(f) for f in _REGISTRY.values()))
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown reward option(s) {unknown}; options the rewards take: {sorted(known)}")

    check_resources(specs, **options)
    rewards: dict[str, Reward] = {}
    for name in specs:
        factory = _REGISTRY[name]
        accepted = _accepted_options(factory)
        rewards[name] = factory(**{k: v for k, v in options.items() if k in accepted})
    return MultiReward(rewards, {name: float(w) for name, w in specs.items()})


def check_resources(names: Sequence[str] | Mapping[str, float], **options: Any) -> None:
    """Run each named reward's ``check_resources(**its options)``, if it has one, loading nothing.

    Rewards with weights to load define it as a static or class method that raises ``ValueError``
    naming the folder to download when their local files are missing: the dry run and
    ``build_rewards`` call it before any model is loaded.
    """
    for name in names:
        if name not in _REGISTRY:
            raise ValueError(f"unknown reward {name!r}; registered rewards: {registered_rewards()}")
        factory = _REGISTRY[name]
        check = getattr(factory, "check_resources", None)
        if check is not None:
            accepted = _accepted_options(factory)
            check(**{k: v for k, v in options.items() if k in accepted})
