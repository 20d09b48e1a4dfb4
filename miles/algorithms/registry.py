"""The algorithm registry: each algorithm registers itself with its options, as a reward does:
``@register_algorithm("diffusion_nft", options=NFTConfig, section="nft")``, a dataclass in the
algorithm's own file that is its config section (``nft.beta``: field docstrings are the ``--help``
text, a ``RANGES`` class table the numeric ranges), and the class's ``check(cfg)`` the config-time
refusals that concern it. Several algorithms may share a section (``flow_grpo`` and ``grpo_guard``:
``grpo``). The config's ``algorithm.name`` choices and its sections follow from this registry
(``miles.config``): adding an algorithm is its file and one import line in
``miles/algorithms/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from miles.algorithms.base import Algorithm
from miles.rollout.schedule import FlowSchedule


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """A registered algorithm: its class and the config section of its options."""

    cls: type[Algorithm]
    section: str | None
    """The config section it reads its options from (``cfg.<section>``), or None: it has none."""


_REGISTRY: dict[str, AlgorithmEntry] = {}
_SECTIONS: dict[str, type] = {}


def register_algorithm(
    name: str, options: type | None = None, section: str | None = None
) -> Callable[[type[Algorithm]], type[Algorithm]]:
    """Class decorator: make ``name`` selectable as ``algorithm.name``, with its ``options``
    dataclass as the config section ``section`` (default: ``name``)."""
    section = section or (name if options is not None else None)
    if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"algorithm {name!r}: options must be a dataclass type, got {options!r}")

    def decorator(cls: type[Algorithm]) -> type[Algorithm]:
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} is already registered")
        if options is not None:
            held = _SECTIONS.setdefault(section, options)
            if held is not options:
                raise ValueError(
                    f"algorithm {name!r}: the config section {section!r} already holds {held.__name__}; "
                    "pick another section name"
                )
        elif section is not None and section not in _SECTIONS:
            raise ValueError(f"algorithm {name!r}: no options registered for section {section!r}")
        _REGISTRY[name] = AlgorithmEntry(cls, section)
        return cls

    return decorator


def registered_algorithms() -> list[str]:
    """Names accepted as ``algorithm.name``, sorted."""
    return sorted(_REGISTRY)


def algorithm_names() -> list[str]:
    """Names accepted as ``algorithm.name``, in registration order (the ``--help`` order)."""
    return list(_REGISTRY)


def algorithm_option_classes() -> dict[str, type]:
    """``{section: its options dataclass}`` of every registered algorithm, in registration order."""
    return dict(_SECTIONS)


def algorithm_exclusive_sections() -> dict[str, str]:
    """``{section: the one algorithm that reads it}``: the sections registered by a single algorithm
    (``nft``, ``awm``, ...; not ``grpo``, whose advantages every algorithm trained on rewards reads and
    which two register). Their settings change nothing under another algorithm (``config_warnings``)."""
    readers: dict[str, list[str]] = {}
    for name, entry in _REGISTRY.items():
        if entry.section is not None:
            readers.setdefault(entry.section, []).append(name)
    return {section: names[0] for section, names in readers.items() if len(names) == 1}


def algorithm_help() -> str:
    """One line per algorithm (its ``summary``), for ``algorithm.name``'s ``--help``."""
    return " ".join(f"``{name}``: {entry.cls.summary}" for name, entry in _REGISTRY.items())


def algorithm_errors(cfg) -> list[str]:
    """The refusals of ``cfg`` by its algorithm's own ``check`` (none for an unknown name: the
    config's choices refuse it first)."""
    entry = _REGISTRY.get(cfg.algorithm.name)
    return entry.cls.check(cfg) if entry is not None else []


def build_algorithm(cfg, schedule: FlowSchedule | None = None) -> Algorithm:
    """The algorithm of ``cfg.algorithm.name``, built from the whole config and the model family's
    noise schedule (``RunPlan.schedule``: the noise levels a matching loss draws are the rollout's);
    None: Wan's, ``rollout.shift`` on the sampler's grid."""
    name = cfg.algorithm.name
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm.name {name!r}; registered: {registered_algorithms()}")
    return _REGISTRY[name].cls(cfg, schedule)
