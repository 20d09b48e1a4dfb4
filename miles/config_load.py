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


MAX_STEPS = "1e7"  # the upper bound of rollouts, optimizer steps and intervals counted in them (RANGES rules)


def _interval(rule: str) -> tuple[float, float, bool, bool]:
    """(lo, hi, lo included, hi included) of a RANGES rule "[a, b)" and the like."""
    assert rule[0] in "[(" and rule[-1] in "])", (
        f"a range must be an interval bounded on both sides: {rule!r}"
    )
    lo, hi = (float(x) for x in rule[1:-1].split(","))
    return lo, hi, rule[0] == "[", rule[-1] == "]"


def check_rules(ranges: dict[str, tuple[str, str]]) -> None:
    """Every rule of ``ranges`` is an interval bounded on both sides (AssertionError naming it)."""
    for rule, _ in ranges.values():
        _interval(rule)


def _satisfies(value: float, rule: str) -> bool:
    lo, hi, lo_in, hi_in = _interval(rule)
    above = value >= lo if lo_in else value > lo
    below = value <= hi if hi_in else value < hi
    return above and below


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
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        rule, why = ranges[key]
        if not _satisfies(value, rule):
            raise ConfigError(_range_message(name, value, rule, why))


def _range_message(name: str, value: float, rule: str, why: str) -> str:
    """``KEY must be > 0 (why), got V; its range is (0, 4096]``: the side that failed, then the range."""
    lo, hi, lo_in, hi_in = _interval(rule)
    lo_text, hi_text = (x.strip() for x in rule[1:-1].split(","))
    if value < lo or (value == lo and not lo_in):
        side = f">= {lo_text}" if lo_in else f"> {lo_text}"
    else:
        side = f"<= {hi_text}" if hi_in else f"< {hi_text}"
    return (
        f"{name} must be {side}"
        + (f" ({why})" if why else "")
        + f", got {_shown(value)}; its range is {rule}"
    )


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
            raise ConfigError(f"{key}: {_shown(value)} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {_shown(value)}")
        return [_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {_shown(value)}")
        return {
            _check_value(key, k, args[0]): _check_value(f"{key}.{k}", v, args[1]) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key}: expected a section (mapping), got {type(value).__name__} {_shown(value)}"
            )
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                hint = " (YAML reads a number like 3e-5 as a string: write 3.0e-5)"
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {_shown(value)}{hint}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {_shown(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {_shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {_shown(value)}")
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


RECIPE_MAX_BYTES = 1 << 20
"""A recipe is a few KB; a larger file is not one (and a YAML parser's time grows with it)."""
RECIPE_MAX_DEPTH = 16
"""Nesting levels a recipe may use (its deepest field, ``reward.NAME.OPTION[i]``, is 4)."""


def _mark(node_or_event: Any) -> str:
    mark = node_or_event.start_mark
    return f"{mark.name}:{mark.line + 1}:{mark.column + 1}"


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader for what a user can write into a recipe: refuses a key given twice in one
    mapping (PyYAML keeps the last), a key that is not a name (a list, a number), aliases (``*x``:
    a few lines of them expand into billions of values) and nesting deeper than
    :data:`RECIPE_MAX_DEPTH` (PyYAML's composer recurses: Python's stack would end it)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"{_mark(event)}: YAML aliases (*{event.anchor}, of an anchor &{event.anchor}) are not read in a "
                "recipe: write the value out (an alias can expand a few lines into billions of values)"
            )
        self._depth += 1
        try:
            if self._depth > RECIPE_MAX_DEPTH:
                raise ConfigError(
                    f"{_mark(self.peek_event())}: nested more than {RECIPE_MAX_DEPTH} levels deep; a recipe's "
                    "deepest key is reward.NAME.OPTION (see configs/tiny_cpu.yaml)"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        digits = len(node.value.lstrip("+-"))
        if digits > 1000:  # int() refuses 4300 digits with a hint about sys.set_int_max_str_digits
            raise ConfigError(f"{_mark(node)}: an integer of {digits} digits; no setting needs one")
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                kinds = {yaml.SequenceNode: "a list", yaml.MappingNode: "a mapping"}
                shown = kinds.get(type(key_node)) or f"{type(key).__name__} {_shown(key)}"
                raise ConfigError(
                    f"{_mark(key_node)}: a key must be a name, got {shown}; recipe keys are section and field "
                    "names (quote a key YAML reads as something else, e.g. 'on' or '1')"
                )
            if key in seen:
                raise ConfigError(
                    f"{_mark(key_node)}: the key {key!r} is given twice in one "
                    f"section (first on line {seen[key] + 1}); YAML would silently keep the last: keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _RecipeLoader.construct_yaml_int)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a refused value may be enormous)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def _read_recipe(path: Path) -> str:
    """The recipe's text; ``ConfigError`` naming what ``path`` is instead of a readable UTF-8 recipe."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give the path of a YAML recipe inside it")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file: give the path of a YAML recipe")
    try:
        size = path.stat().st_size
        if size > RECIPE_MAX_BYTES:
            raise ConfigError(
                f"config file {path} is {size} bytes; a recipe is a few KB (at most {RECIPE_MAX_BYTES}): "
                "is it the right file?"
            )
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte offset {e.start}); save the recipe as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None


def load_recipe(path: str | Path, config_cls: type) -> Any:
    """Load a YAML recipe strictly into ``config_cls`` (:class:`miles.config.Config`): no key twice, not empty, no alias, not
    deeper than a recipe's sections, at most :data:`RECIPE_MAX_BYTES`."""
    path = Path(path)
    text = _read_recipe(path)
    try:
        loader = _RecipeLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    except RecursionError:  # the scanner's own recursion, below RECIPE_MAX_DEPTH's reach
        raise ConfigError(f"{path}: nested too deeply to be a recipe") from None
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
