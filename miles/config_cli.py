"""The command line's own pieces: the launcher's help, ``--reward.weights.NAME W`` flags, and the
tyro rule that lists the registered rewards in ``reward.weights``' help (:func:`miles.config.parse_args`
puts them together)."""

from __future__ import annotations

import dataclasses
from typing import Any

import tyro

from miles.config_load import ConfigError

LAUNCHER_HELP = """miles: GRPO fine-tuning of Wan video transformers with sequence parallelism.

Launcher options (read before the configuration options below):
  --config FILE    YAML recipe; the flags below override its values
  --dry-run        check every input the run would refuse and print its plan (mesh, SP plan,
                   memory per rank), then exit: no GPU, no weights, no torch.distributed
  --world-size N   with --dry-run: the world size to plan for (a real run takes it from torchrun)
"""

_REWARD_WEIGHT_FLAG = "--reward.weights."
MAX_WORLD_SIZE = 65536
"""The largest ``--world-size`` a dry run plans for (its plan lists every rank's groups)."""


def check_world_size(world_size: int | None) -> None:
    """``--world-size`` (the dry run's) within [1, MAX_WORLD_SIZE]: a huge one hung the plan."""
    if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
        shown = (
            str(world_size) if len(str(world_size)) < 30 else f"an integer of {len(str(world_size))} digits"
        )
        raise ConfigError(f"--world-size must be in [1, {MAX_WORLD_SIZE}] ranks, got {shown}")


def pop_reward_weights(args: list[str]) -> tuple[list[str], dict[str, float]]:
    """Take every ``--reward.weights.NAME W`` (or ``...NAME=W``) out of ``args``.

    tyro turns ``reward.weights`` into one flag per key of the recipe's mapping, so it cannot add
    a reward; these flags are therefore applied to the recipe before tyro parses the rest.
    """
    rest, weights = [], {}
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith(_REWARD_WEIGHT_FLAG):
            rest.append(arg)
            continue
        flag, has_value, value = arg.partition("=")
        if not has_value:
            if i == len(args):
                raise ConfigError(f"{flag} needs a weight, e.g. {flag} 1.0")
            value, i = args[i], i + 1
        name = flag.removeprefix(_REWARD_WEIGHT_FLAG).replace("-", "_")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ConfigError(f"{flag}: expected a number, got {value!r}") from None
    return rest, weights


def cli_registry(reward_config: type, reward_names: list[str]) -> tyro.constructors.ConstructorRegistry:
    """tyro rules: the ``reward.weights`` help lists the registered rewards (a docstring cannot)."""
    # tyro's own rule for dataclasses; a private module, but tyro is pinned (pyproject.toml).
    from tyro.constructors._struct_spec_dataclass import dataclass_rule

    registry = tyro.constructors.ConstructorRegistry()

    @registry.struct_rule
    def reward_weights_help(info: tyro.constructors.StructTypeInfo) -> Any:
        if info.type is not reward_config:
            return None
        spec = dataclass_rule(info)
        fields = []
        for field in spec.fields:
            if field.name == "weights":
                doc = field.helptext() if callable(field.helptext) else field.helptext
                extra = (
                    f"Registered rewards: {', '.join(reward_names)}. Set or add one with "
                    "--reward.weights.NAME WEIGHT (a weight of 0 scores and logs a reward without training on it)."
                )
                field = dataclasses.replace(field, helptext=f"{doc or ''} {extra}".strip())
            fields.append(field)
        return dataclasses.replace(spec, fields=tuple(fields))

    return registry
