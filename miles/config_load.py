"""Reading a recipe strictly: the YAML file, each value's type, each number's range.

An unknown key, a wrong type, a string where a number belongs, a key given twice or a number out of
its field's range is a :class:`ConfigError` that names the key (and, for a key, the valid ones).
Nothing here knows the config's sections: :mod:`miles.config` passes its classes and range table.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe file or flag that cannot be used, with the key it concerns."""


def _satisfies(value: float, rule: str) -> bool:
    if rule == "any":
        return True
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        above = value >= lo if rule[0] == "[" else value > lo
        below = value <= hi if rule[-1] == "]" else value < hi
        return above and below
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def numeric_fields(node: Any, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, the key as the message names it, value) of every number in the config ``node``:
    fields, list items (``key[i]``) and mapping values (``key.NAME``)."""
    found = []
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += numeric_fields(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            found += [(key, f"{key}[{i}]", v) for i, v in enumerate(value) if _is_number(v)]
        elif isinstance(value, dict):
            found += [(key, f"{key}.{k}", v) for k, v in value.items() if _is_number(v)]
        elif _is_number(value):
            found.append((key, key, value))
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ranges(cfg: Any, ranges: dict[str, tuple[str, str]]) -> None:
    """Every number finite and within its field's ``ranges`` rule (``miles.config.RANGES``) (``ConfigError`` naming it)."""
    for key, name, value in numeric_fields(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        rule, why = ranges.get(key, ("any", ""))
        if not _satisfies(value, rule):
            shown = rule if rule[0] in "<>a" else f"in {rule}"
            raise ConfigError(f"{name} must be {shown}" + (f" ({why})" if why else "") + f", got {value!r}")


# ---------------------------------------------------------------------------------------------
# Strict YAML loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` where lossless (int -> float), else raise naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return _check_value(key, value, args[0])
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return {
            _check_value(key, k, args[0]): _check_value(f"{key}.{k}", v, args[1]) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                hint = " (YAML reads a number like 3e-5 as a string: write 3.0e-5)"
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}{hint}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {_type_name(tp)} at {key}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            hint = ""
            if prefix == "reward":  # the flat options before each reward had its section
                hint = " (a reward's options sit in its own section: reward.NAME.OPTION, e.g. reward.pickscore.model_path)"
            raise ConfigError(f"unknown config key '{key}'; valid keys here: {sorted(fields)}{hint}")
        kwargs[name] = _check_value(key, value, hints[name])
    if not prefix:  # the whole config
        # Section defaults are filled in first so that validation sees the whole config.
        return cls(**{n: kwargs.get(n, fields[n].default_factory()) for n in fields})
    return cls(**kwargs)


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """``FILE:LINE:COLUMN: not valid YAML (what the parser says)``, 1-based as editors count."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = "; ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p) or str(e)
    return f"{where}: not valid YAML ({what})"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    f"{mark.name}:{mark.line + 1}:{mark.column + 1}: the key {key!r} is given twice in one "
                    f"section (first on line {seen[key] + 1}); YAML would silently keep the last: keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | Path, config_cls: type) -> Any:
    """Load a YAML recipe strictly into ``config_cls`` (:class:`miles.config.Config`): no key twice, not empty."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        loader = _UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte offset {e.start}); save the recipe as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    if not data:
        raise ConfigError(
            f"{path}: the recipe is empty: it would run the built-in tiny defaults. Give its sections "
            "(see configs/tiny_cpu.yaml), or drop --config to run the defaults on purpose"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return _build(config_cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
