"""Configuration: nested dataclasses, a YAML recipe, command-line overrides.

    torchrun ... train_grpo.py --config configs/tiny_cpu.yaml --train.learning-rate 3e-5

The recipe file is loaded strictly (an unknown key, a wrong type, or a string where a number
belongs is an error that names the key), then tyro applies the command-line flags on top.
Every field's docstring is its ``--help`` text. The parallel flags keep the seed's names
(``--sequence-parallel-size``, ``--ulysses-degree``, ``--fsdp-attention-backend``,
``--deterministic-mode``) without a section prefix.

The config is assembled here from its parts: the config's own sections (:mod:`miles.sections`),
one section per algorithm's options (``grpo``, ``nft``, ...: declared in each algorithm's file and
registered with it, :mod:`miles.algorithms`) with ``algorithm.name``'s choices, and one section per
reward's options (``reward.NAME``, :mod:`miles.rewards.registry`). Adding an algorithm or a reward
never touches this file. The strict loader is :mod:`miles.config_load`, the flags' helpers
:mod:`miles.config_cli`.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from miles.algorithms import (
    algorithm_exclusive_sections,
    algorithm_help,
    algorithm_names,
    algorithm_option_classes,
)
from miles.config_checks import batch_split_error, field_checks
from miles.config_cli import LAUNCHER_HELP, check_world_size, cli_registry, pop_reward_weights
from miles.config_load import ConfigError, check_ranges, check_rules, load_recipe, numeric_fields
from miles.rewards import reward_option_classes  # the rewards register themselves and their options
from miles.rewards.from_config import check_reward_names as reward_name_check
from miles.sections import RANGES as SECTION_RANGES
from miles.sections import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    RewardMixConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "RANGES",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "config_warnings",
    "load_config_file",
    "numeric_fields",
    "parse_args",
    "to_dict",
    "validate",
]


def _reward_config_class() -> type:
    """``RewardConfig``: the mix (:class:`RewardMixConfig`), then one section per registered reward
    that has options, ``reward.NAME`` (e.g. ``reward.pickscore.model_path``), of the options
    dataclass declared in the reward's own file (``miles.rewards.registry``): a new reward and its
    options never touch this file."""
    sections = reward_option_classes()
    clash = sorted(set(sections) & {f.name for f in dataclasses.fields(RewardMixConfig)})
    assert not clash, f"rewards named like a reward.* field: {clash}"
    fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections.items()]
    cls = dataclasses.make_dataclass("RewardConfig", fields, bases=(RewardMixConfig,), kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = RewardMixConfig.__doc__
    return cls


RewardConfig = _reward_config_class()


def _algorithm_config_class() -> type:
    """``AlgorithmConfig``: ``name``, one of the registered algorithms (``miles.algorithms``; the
    default is the first registered), its ``--help`` one line per algorithm (each one's ``summary``)."""
    names = tuple(algorithm_names())
    doc = (
        "The RL algorithm (``miles.algorithms``): what the rollout records and the loss. " + algorithm_help()
    )
    name_type = Annotated[Literal[names], tyro.conf.arg(help=doc)]
    cls = dataclasses.make_dataclass(
        "AlgorithmConfig", [("name", name_type, dataclasses.field(default=names[0]))], kw_only=True
    )
    cls.__module__ = __name__
    return cls


AlgorithmConfig = _algorithm_config_class()


def _post_init(self) -> None:
    if not _DEFER_VALIDATION.get():
        validate(self)


def _config_class() -> type:
    """``Config``: the config's own sections, the algorithm and one section per algorithm's options
    (in registration order: ``grpo``, ``nft``, ...), then evaluation and training."""
    own = {
        "run": RunConfig,
        "model": ModelConfig,
        "parallel": ParallelConfig,
        "data": DataConfig,
        "rollout": RolloutConfig,
        "reward": RewardConfig,
        "algorithm": AlgorithmConfig,
    }
    tail = {"eval": EvalConfig, "train": TrainConfig}
    algorithms = algorithm_option_classes()
    clash = sorted(set(algorithms) & (set(own) | set(tail)))
    assert not clash, f"algorithm options named like a config section: {clash}"
    fields = [
        (name, cls, dataclasses.field(default_factory=cls))
        for name, cls in {**own, **algorithms, **tail}.items()
    ]
    cls = dataclasses.make_dataclass("Config", fields, kw_only=True, namespace={"__post_init__": _post_init})
    cls.__module__ = __name__
    return cls


Config = _config_class()
# Each algorithm section's class under its own name (``from miles.config import GRPOConfig``, as before).
globals().update({cls.__name__: cls for cls in algorithm_option_classes().values()})

# Set while tyro builds a Config from the command line: tyro would print a validation error in its
# own box and exit; parse_args validates afterwards instead, so every refusal reads alike.
_DEFER_VALIDATION: contextvars.ContextVar[bool] = contextvars.ContextVar("defer_validation", default=False)


def _option_ranges(prefix: str, classes: dict[str, type]) -> dict[str, tuple[str, str]]:
    """Each options class's own ranges (its ``RANGES``, keyed by field) under ``prefix + section``."""
    return {
        f"{prefix}{name}.{key}": rule
        for name, options in classes.items()
        for key, rule in getattr(options, "RANGES", {}).items()
    }


# Every numeric field's range (the rules: miles.sections.RANGES): the config's own sections', then
# each algorithm's and each reward's, as their options classes declare them.
RANGES: dict[str, tuple[str, str]] = {
    **SECTION_RANGES,
    **_option_ranges("", algorithm_option_classes()),
    **_option_ranges("reward.", reward_option_classes()),
}
check_rules(RANGES)  # each rule parses at import, not when a value first meets it


def check_run_name(run: RunConfig) -> None:
    """``run.name`` must keep the run directory inside ``run.output_dir``."""
    parts = Path(run.name).parts
    if not run.name.strip() or Path(run.name).is_absolute() or ".." in parts or "\0" in run.name or not parts:
        raise ConfigError(
            f"run.name {run.name!r} would put the run directory outside run.output_dir {run.output_dir!r} "
            "(or nowhere): use a plain folder name such as my_run (subfolders a/b are fine; no '..', no "
            "absolute path); set the parent folder with --run.output-dir"
        )


def check_reward_signal(reward: RewardConfig) -> None:
    """A reward set whose weights are all 0 trains on a constant reward: no advantage, no gradient."""
    weights = list(reward.weights.values())
    remote = getattr(reward, "remote", None)
    if "remote" in reward.weights and remote is not None and remote.rewards:
        weights = [w * reward.weights["remote"] for w in remote.rewards.values()] + [
            w for n, w in reward.weights.items() if n != "remote"
        ]
    if weights and not any(weights):
        raise ConfigError(
            f"every reward weight is 0 (reward.weights {dict(reward.weights)}): the trained reward would be 0 "
            "for every sample, so no advantage and no gradient. Give the reward to train on a non-zero "
            "weight (--reward.weights.NAME 1.0); a weight of 0 only logs a reward beside a trained one"
        )


def check_reward_options(reward: RewardConfig) -> None:
    """Each reward section's own checks (its options class's ``check()``, if any), every section alike."""
    for name in reward_option_classes():
        check = getattr(getattr(reward, name), "check", None)
        if check is not None:
            try:
                check()
            except ValueError as e:
                raise ConfigError(str(e)) from None


def validate(cfg: Config) -> None:
    """Checks that do not need the world size or the model (those run at startup)."""
    check_ranges(cfg, RANGES)
    check_run_name(cfg.run)
    for ok, message in field_checks(cfg):
        if not ok:
            raise ConfigError(message)
    check_reward_signal(cfg.reward)
    check_reward_options(cfg.reward)
    if message := batch_split_error(cfg):
        raise ConfigError(message)
    from miles.rewards.shaping import check_gold, check_normalize  # light: torch only

    try:
        check_normalize(cfg.reward.normalize, cfg.reward.weights)
        check_gold(cfg.reward.gold, cfg.reward.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _changed(section: Any, names: list[str] | None = None) -> list[str]:
    """The fields of a config section set to other than their default."""
    default = type(section)()
    fields = names or [f.name for f in dataclasses.fields(section)]
    return [n for n in fields if getattr(section, n) != getattr(default, n)]


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but most likely a mistake (the entry point prints them once): an
    update that changes nothing, an option that the chosen setting never reads."""
    found = []
    if cfg.train.learning_rate == 0:
        found.append("learning rate 0: the weights will not change (train.learning_rate)")
    if cfg.reward.gold and not cfg.eval.prompt_file:
        found.append(
            "reward.gold is scored in evaluation only, and eval.prompt_file is unset: it is never scored"
        )
    unused = [
        (f"{section}.{n}", f"algorithm.name is {cfg.algorithm.name}; only {name} reads the {section} section")
        for section, name in algorithm_exclusive_sections().items()
        if cfg.algorithm.name != name
        for n in _changed(getattr(cfg, section))
    ]
    if cfg.model.lora_rank == 0:
        why = "model.lora_rank is 0 (a full fine-tune)"
        unused += [(f"model.{n}", why) for n in _changed(cfg.model, ["lora_alpha", "lora_target_modules"])]
    if cfg.rollout.sde_window_size == 0:
        why = "rollout.sde_window_size is 0 (no window)"
        unused += [(f"rollout.{n}", why) for n in _changed(cfg.rollout, ["sde_window_range"])]
    if not cfg.rollout.differs_from_training:
        why = "rollout.precision and rollout.attention_precision are bf16 (no drift to correct)"
        unused += [(f"rollout.{n}", why) for n in _changed(cfg.rollout, ["tis_cap"])]
    scored = {*cfg.reward.weights, *cfg.reward.gold}
    for name in reward_option_classes():
        if name not in scored:
            why = f"{name} is in neither reward.weights nor reward.gold"
            unused += [(f"reward.{name}.{n}", why) for n in _changed(getattr(cfg.reward, name))]
    found += [f"{key} is set but never read: {why}" for key, why in unused]
    return found


def check_reward_names(cfg: Config) -> None:
    """Every name in ``reward.weights`` and ``reward.gold`` is a registered reward (the rewards' own
    check, :func:`miles.rewards.from_config.check_reward_names`)."""
    try:
        reward_name_check(cfg.reward)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_config_file(path: str | Path) -> Config:
    """Load a YAML recipe strictly into a :class:`Config`: no key twice, not empty, every key known
    and typed (:func:`miles.config_load.load_recipe`)."""
    return load_recipe(path, Config)


# Fields that hold secrets: written out (config.yaml, checkpoints, wandb) only as whether they were set.
SECRET_FIELDS = tuple(
    f"reward.{name}.{key}"
    for name, options in reward_option_classes().items()
    for key in getattr(options, "SECRETS", ())  # a reward's options name their secret fields
)
REDACTED = "<set; not saved>"


def to_dict(cfg: Config) -> dict:
    """``cfg`` as the run directory, its checkpoints and wandb keep it: secrets redacted
    (``SECRET_FIELDS``; a set one becomes ``REDACTED``, so a resume still sees that it was set)."""
    out = dataclasses.asdict(cfg)
    for path in SECRET_FIELDS:
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None:
            node[leaf] = REDACTED
    return out


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """``--config FILE`` plus tyro overrides; returns the config and the launcher-level options."""
    from miles.rewards import registered_rewards

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--dry-run", action="store_true")
    pre.add_argument("--world-size", type=int, default=None)
    opts, rest = pre.parse_known_args(argv)
    check_world_size(opts.world_size)
    default = load_config_file(opts.config) if opts.config else Config()
    rest, weights = pop_reward_weights(rest)
    if weights:
        reward = dataclasses.replace(default.reward, weights={**default.reward.weights, **weights})
        default = dataclasses.replace(default, reward=reward)
    registry = cli_registry(RewardConfig, registered_rewards())
    token = _DEFER_VALIDATION.set(True)
    try:
        cfg = tyro.cli(Config, default=default, args=rest, description=LAUNCHER_HELP, registry=registry)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    finally:
        _DEFER_VALIDATION.reset(token)
    validate(cfg)
    check_reward_names(cfg)
    return cfg, opts
