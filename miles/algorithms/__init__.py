"""RL algorithms behind one seam (``miles.algorithms.base``), chosen by ``algorithm.name``.

Each algorithm's file declares the algorithm, its options dataclass (its config section, with its
``RANGES``) and its ``check(cfg)``, and registers them (``miles.algorithms.registry``). Adding an
algorithm is its file and one import line below.
"""

from __future__ import annotations

from miles.algorithms.base import Algorithm, Policy
from miles.algorithms.registry import (
    algorithm_errors,
    algorithm_exclusive_sections,
    algorithm_help,
    algorithm_names,
    algorithm_option_classes,
    build_algorithm,
    register_algorithm,
    registered_algorithms,
)

# The registration order is the order of the config's sections and of algorithm.name's choices.
# isort: off
from miles.algorithms import flow_grpo  # noqa: E402,F401  (registers flow_grpo, grpo_guard; section grpo)
from miles.algorithms import diffusion_nft, awm, dgpo, online_dpo, sft  # noqa: E402,F401
# isort: on

__all__ = [
    "Algorithm",
    "Policy",
    "algorithm_errors",
    "algorithm_exclusive_sections",
    "algorithm_help",
    "algorithm_names",
    "algorithm_option_classes",
    "build_algorithm",
    "register_algorithm",
    "registered_algorithms",
]
