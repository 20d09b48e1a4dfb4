"""RL algorithms behind one seam (``miles.algorithms.base``), chosen by ``algorithm.name``."""

from __future__ import annotations

from collections.abc import Callable

from miles.algorithms.base import Algorithm, Policy

_REGISTRY: dict[str, Callable[..., Algorithm]] = {}


def register_algorithm(name: str):
    """Class decorator: make ``name`` selectable as ``algorithm.name``."""

    def decorator(cls):
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return decorator


def registered_algorithms() -> list[str]:
    return sorted(_REGISTRY)


def build_algorithm(cfg) -> Algorithm:
    """The algorithm of ``cfg.algorithm.name``, built from the whole config."""
    name = cfg.algorithm.name
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm.name {name!r}; registered: {registered_algorithms()}")
    return _REGISTRY[name](cfg)


from miles.algorithms import awm, dgpo, diffusion_nft, flow_grpo, online_dpo, sft  # noqa: E402,F401  (registers)

__all__ = ["Algorithm", "Policy", "build_algorithm", "register_algorithm", "registered_algorithms"]
