"""Reward registry and the weighted sum the trainer optimises.

Each reward registers itself with its options: ``@register_reward("pickscore", options=PickScoreOptions)``,
a small dataclass in the reward's own file whose fields are its constructor's parameters, one for
one, and its config section (``reward.pickscore.model_path``; field docstrings are the ``--help``
text, a ``RANGES`` class table the numeric ranges, an optional ``check()`` the config-time checks).
Besides its options a reward may take the common arguments ``COMMON_ARGUMENTS`` (``num_frames``,
the config's ``reward.num_frames``; ``device``; ``dtype``), unless its options declare the same
name. Registration refuses a constructor parameter that is neither: a misnamed parameter fails
at import instead of silently keeping its default. Adding a reward touches its own file and one
import line in ``miles/rewards/__init__.py``.

    build_rewards({"pickscore": 1.0}, {"pickscore": {"model_path": "/ckpt/PickScore_v1"}}, num_frames=4)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from miles.rewards.base import Reward, check_videos, weight_file_bytes
from miles.rewards.resources import ResourceError

COMMON_ARGUMENTS = ("num_frames", "device", "dtype")
"""Arguments any reward may take besides its own options: frames sampled per video (``reward.num_frames``),
the device to score on (the trainer's) and, from Python, the dtype of its model."""


@dataclasses.dataclass(frozen=True)
class RewardEntry:
    """A registered reward: how to build it and what it takes."""

    factory: Callable[..., Reward]
    options: type | None
    """Its options dataclass (its config section ``reward.NAME``), or None: it takes no options."""
    common: tuple[str, ...]
    """The common arguments it takes (those its options do not declare themselves)."""


_REGISTRY: dict[str, RewardEntry] = {}

T = TypeVar("T", bound=Callable[..., Reward])


def _parameters(factory: Callable[..., Reward]) -> list[str]:
    params = inspect.signature(factory).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def option_names(options: type | None) -> list[str]:
    """The field names of an options dataclass (none for None)."""
    return [f.name for f in dataclasses.fields(options)] if options is not None else []


def _entry(name: str, factory: Callable[..., Reward], options: type | None) -> RewardEntry:
    if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"reward {name!r}: options must be a dataclass type, got {options!r}")
    params, fields = _parameters(factory), option_names(options)
    stray = [p for p in params if p not in fields and p not in COMMON_ARGUMENTS]
    missing = [f for f in fields if f not in params]
    if stray or missing:
        where = getattr(factory, "__qualname__", repr(factory))
        raise TypeError(
            f"reward {name!r}: {where} takes {stray or 'no'} parameter(s) outside its options "
            f"{fields} and the common arguments {list(COMMON_ARGUMENTS)}, and options {missing or 'none'} "
            "it does not take: name each parameter after its options field (a misnamed one would keep its "
            "default silently)"
        )
    common = tuple(p for p in params if p in COMMON_ARGUMENTS and p not in fields)
    return RewardEntry(factory, options, common)


def register_reward(name: str, options: type | None = None) -> Callable[[T], T]:
    """Class/factory decorator: make ``name`` selectable in ``build_rewards``, with its options
    dataclass (the config section ``reward.NAME``) whose fields are the factory's parameters."""

    def decorator(factory: T) -> T:
        if name in _REGISTRY:
            raise ValueError(
                f"reward {name!r} is already registered (by {_REGISTRY[name].factory!r}); pick another name"
            )
        _REGISTRY[name] = _entry(name, factory, options)
        return factory

    return decorator


def registered_rewards() -> list[str]:
    """Names accepted by ``build_rewards``, sorted."""
    return sorted(_REGISTRY)


def reward_option_classes() -> dict[str, type]:
    """``{reward name: its options dataclass}`` of every registered reward that has options, by name."""
    return {name: _REGISTRY[name].options for name in sorted(_REGISTRY) if _REGISTRY[name].options}


def needs_images(name: str) -> bool:
    """Whether the registered reward ``name`` scores against each sample's condition image."""
    return bool(getattr(_known(name).factory, "needs_images", False))


def _known(name: str) -> RewardEntry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered rewards: {registered_rewards()}")
    return _REGISTRY[name]


def resolve_options(name: str, given: Any = None) -> Any:
    """Reward ``name``'s options: ``given`` (None: the defaults; an instance of its options class; or a
    mapping of its fields) as an instance. ValueError naming the valid options for an unknown one."""
    cls = _known(name).options
    if cls is None:
        if given:
            raise ValueError(f"reward {name!r} takes no options; got {given!r}")
        return None
    if given is None:
        return cls()
    if isinstance(given, cls):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"the options of reward {name!r} must be a mapping or {cls.__name__}; got {given!r}")
    unknown = sorted(set(given) - set(option_names(cls)))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} of reward {name!r} (reward.{name}); its options: {option_names(cls)}"
        )
    return cls(**given)


def check_options(options: Mapping[str, Any] | None, common: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: options instance}`` for ``options`` (reward name -> options); ValueError naming the valid
    names for an unknown reward, option or common argument."""
    unknown = sorted(set(common) - set(COMMON_ARGUMENTS))
    if unknown:
        raise ValueError(
            f"unknown reward argument(s) {unknown}; the common ones are {list(COMMON_ARGUMENTS)}, and a "
            "reward's own options go in its section: options={'pickscore': {'model_path': ...}}"
        )
    return {name: resolve_options(name, given) for name, given in (options or {}).items()}


def _option_values(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Reward ``name``'s options (``options[name]``, else its defaults) as ``{field: value}``."""
    chosen = options[name] if name in options else resolve_options(name)
    return {f: getattr(chosen, f) for f in option_names(_REGISTRY[name].options)}


def _arguments(name: str, options: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments reward ``name`` is built with: its options' fields, then its common ones."""
    kwargs = _option_values(name, options)
    kwargs.update({k: common[k] for k in _REGISTRY[name].common if k in common})
    return kwargs


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


def build_rewards(
    specs: Mapping[str, float], options: Mapping[str, Any] | None = None, **common: Any
) -> MultiReward:
    """Build the reward mix ``{name: weight}``. ``options`` maps a reward name to its options (an
    instance of its options class or a mapping of its fields; left out: its defaults); ``common``
    (``num_frames``, ``device``, ``dtype``) goes to every reward that takes it.

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
        _known(name)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(float(weight))
        ):
            raise ValueError(f"the weight of reward {name!r} must be a finite number; got {weight!r}")
    resolved = check_options(options, common)
    check_resources(specs, resolved)
    rewards = {name: _REGISTRY[name].factory(**_arguments(name, resolved, common)) for name in specs}
    return MultiReward(rewards, {name: float(w) for name, w in specs.items()})


def check_resources(
    names: Sequence[str] | Mapping[str, float], options: Mapping[str, Any] | None = None, **common: Any
) -> None:
    """Run each named reward's ``check_resources(**its options)``, if it has one, loading no weights;
    a :class:`~miles.rewards.resources.ResourceError` lists every problem of every reward at once.

    Rewards with weights to load define it as a static or class method that checks their local files as
    their constructor reads them (the constructor calls it first: one function for both) and raises
    ``ValueError`` naming the folder to download: the dry run, the real run's plan and
    ``build_rewards`` call it before any model is loaded.
    """
    resolved = check_options(options, common)
    problems: list[str] = []
    for name in dict.fromkeys(names):
        check = getattr(_known(name).factory, "check_resources", None)
        if check is None:
            continue
        try:
            check(**_option_values(name, resolved))
        except ResourceError as e:
            problems += e.problems
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ResourceError(problems)


def estimated_resident_bytes(
    names: Sequence[str] | Mapping[str, float], options: Mapping[str, Any] | None = None, itemsize: int = 4
) -> int:
    """The device bytes the named rewards' models will hold, estimated from the weight files their
    ``check_resources`` names (``Reward.loads_weights``; loading nothing, each file once), in a dtype
    of ``itemsize`` bytes (the trainer builds rewards in float32). Rewards without weights: 0."""
    resolved = check_options(options, {})
    found: list = []
    for name in dict.fromkeys(names):
        factory = _known(name).factory
        if getattr(factory, "loads_weights", False):
            paths = factory.check_resources(**_option_values(name, resolved))
            found += list(paths) if isinstance(paths, (tuple, list)) else [paths]
    return weight_file_bytes(found, itemsize) if found else 0
