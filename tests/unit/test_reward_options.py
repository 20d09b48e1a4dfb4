"""Each reward owns its options: a dataclass registered with it, its config section ``reward.NAME``.

- an unknown or misspelled option (in a recipe, a flag, or from Python) is refused naming the valid
  ones; an option out of its declared range or failing its section's ``check()`` is refused at load;
- every reward built from the config receives exactly its section's values (each field set to a value
  other than its default, through a recipe) and the common arguments it takes, nothing else: the
  registry's factory is replaced by a recorder, so no model loads;
- a reward whose constructor names a parameter outside its options is refused at registration.

The dry run and the real run refuse a misspelled option alike: tests/unit/test_refusals_alike.py.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest
import yaml

from miles.config import ConfigError, load_config_file, parse_args
from miles.rewards import build_rewards, register_reward, reward_option_classes
from miles.rewards import registry as registry_module
from miles.rewards.base import Reward
from miles.rewards.from_config import build_configured_rewards


def _other_value(field: dataclasses.Field, tp: typing.Any) -> typing.Any:
    """A value of the field's type other than its default, derived from the type alone."""
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return next(a for a in typing.get_args(tp) if a != default)
    if origin in (typing.Union, types.UnionType):
        tp, origin = args[0], typing.get_origin(args[0])
        if origin is typing.Literal:
            return next(a for a in typing.get_args(tp) if a != default)
    if tp is str:
        return f"/given/{field.name}"
    if tp is int:
        return (default or 1) + 2
    if tp is float:
        return (default or 1.0) * 2 + 0.5
    if origin is list:
        return [0.0, 10.0]
    if origin is dict:
        return {"world_adherence": 0.25}
    raise AssertionError(f"no test value for {field.name}: {tp}")


def _given_sections() -> dict[str, dict]:
    """Every reward section with every option set to a non-default value."""
    sections = {}
    for name, cls in reward_option_classes().items():
        hints = typing.get_type_hints(cls)
        sections[name] = {f.name: _other_value(f, hints[f.name]) for f in dataclasses.fields(cls)}
        assert all(v != getattr(cls(), k) for k, v in sections[name].items()), name
    return sections


@pytest.fixture
def recorded(monkeypatch):
    """``{reward name: the keyword arguments it was built with}``; every registered factory recorded."""
    seen: dict[str, dict] = {}
    for name, entry in list(registry_module._REGISTRY.items()):

        def record(_name=name, **kwargs):
            seen[_name] = kwargs
            return object()

        monkeypatch.setitem(registry_module._REGISTRY, name, dataclasses.replace(entry, factory=record))
    return seen


def test_every_reward_receives_exactly_its_section(tmp_path, recorded):
    sections = _given_sections()
    names = registry_module.registered_rewards()
    recipe = {"reward": {"weights": dict.fromkeys(names, 1.0), "num_frames": 3, **sections}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cfg = load_config_file(path)
    build_configured_rewards(cfg.reward, device="cpu")
    assert sorted(recorded) == names
    for name in names:
        entry = registry_module._REGISTRY[name]
        section = getattr(cfg.reward, name) if entry.options else None
        want = {f: getattr(section, f) for f in sections.get(name, {})}
        assert want == sections.get(name, {})  # the recipe's values, through the loader
        want.update(
            {
                k: v
                for k, v in {"num_frames": cfg.reward.num_frames, "device": "cpu"}.items()
                if k in entry.common
            }
        )
        assert recorded[name] == want, name


def test_real_constructors_take_their_options():
    """The registry's check at import: each options field is a constructor parameter, and each
    parameter an options field or a common argument (the recorder above skips the constructors)."""
    for name, entry in registry_module._REGISTRY.items():
        params = registry_module._parameters(entry.factory)
        fields = registry_module.option_names(entry.options)
        assert set(fields) <= set(params), name
        assert set(params) - set(fields) <= set(registry_module.COMMON_ARGUMENTS), name


RECIPE_REFUSALS = {
    "unknown_option": (
        {"pickscore": {"model_path": "/x", "revision": "main"}},
        "unknown config key 'reward.pickscore.revision'; valid keys here: ['model_path', 'processor_path']",
    ),
    "misspelled_option": (
        {"remote": {"url": "http://h", "retires": 5}},
        "unknown config key 'reward.remote.retires'; valid keys here: ['backoff_s', 'batch_size', "
        "'num_frames', 'retries', 'rewards', 'timeout_s', 'token', 'url']",
    ),
    "old_flat_option": (
        {"pickscore_path": "/x"},
        "unknown config key 'reward.pickscore_path'; valid keys here: ['aesthetic', 'clipscore', 'gold', "
        "'hpsv2', 'normalize', 'num_frames', 'pickscore', 'remote', 'videoalign', 'vlm_judge', 'weights'] "
        "(a reward's options sit in its own section: reward.NAME.OPTION, e.g. reward.pickscore.model_path)",
    ),
    "section_of_a_reward_without_options": (
        {"sharpness": {"num_frames": 2}},
        "unknown config key 'reward.sharpness'",
    ),
    "wrong_type": (
        {"videoalign": {"num_frames": "eight"}},
        "reward.videoalign.num_frames: expected an integer",
    ),
    "out_of_range": ({"remote": {"timeout_s": 0}}, "reward.remote.timeout_s must be > 0, got 0.0"),
    "section_check": (
        {"vlm_judge": {"score_range": [5, 1]}},
        "reward.vlm_judge.score_range must be [lo, hi] with lo < hi",
    ),
}


@pytest.mark.parametrize("case", RECIPE_REFUSALS)
def test_recipe_refuses_bad_options_naming_the_valid_ones(tmp_path, case):
    section, message = RECIPE_REFUSALS[case]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"reward": section}))
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert message in str(e.value)


def test_flag_refuses_a_misspelled_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--reward.pickscore.modle-path", "/x"])
    err = capsys.readouterr().err
    assert "--reward.pickscore.modle-path" in err and "--reward.pickscore.model-path" in err


PYTHON_REFUSALS = {
    "unknown_option": (
        {"pickscore": {"modle_path": "/x"}},
        {},
        "unknown option(s) ['modle_path'] of reward 'pickscore' (reward.pickscore); its options: "
        "['model_path', 'processor_path']",
    ),
    "options_of_a_reward_without_options": (
        {"sharpness": {"num_frames": 2}},
        {},
        "reward 'sharpness' takes no options",
    ),
    "unknown_reward": ({"pikscore": {}}, {}, "unknown reward 'pikscore'; registered rewards: ["),
    "unknown_common_argument": (
        None,
        {"num_frame": 2},
        "unknown reward argument(s) ['num_frame']; the common ones",
    ),
    "flat_option": (None, {"model_path": "/x"}, "a reward's own options go in its section"),
}


@pytest.mark.parametrize("case", PYTHON_REFUSALS)
def test_build_rewards_refuses_bad_options_naming_the_valid_ones(case):
    options, common, message = PYTHON_REFUSALS[case]
    with pytest.raises(ValueError) as e:
        build_rewards({"sharpness": 1.0}, options, **common)
    assert message in str(e.value)


def test_a_misnamed_constructor_parameter_is_refused_at_registration():
    @dataclasses.dataclass
    class Options:
        model_path: str | None = None

    class Misnamed(Reward):
        def __init__(self, modelpath: str | None = None, num_frames: int | None = 4) -> None:
            pass

        def __call__(self, videos, prompts):
            raise AssertionError

    with pytest.raises(
        TypeError, match=r"\['modelpath'\] parameter\(s\) outside its options \['model_path'\]"
    ):
        register_reward("test_misnamed", options=Options)(Misnamed)
    assert "test_misnamed" not in registry_module.registered_rewards()


def test_recipes_spell_options_in_their_sections():
    """The shipped recipes load (tests/unit/test_config_ranges.py) and spell options in their sections."""
    repo = Path(__file__).resolve().parents[2]
    for recipe in sorted((repo / "configs").glob("*.yaml")):
        reward = yaml.safe_load(recipe.read_text()).get("reward", {})
        flat = [k for k in reward if k not in ("weights", "normalize", "gold", "num_frames")]
        assert all(isinstance(reward[k], dict) for k in flat), (recipe.name, flat)


def test_a_token_in_the_config_is_never_written_out():
    """reward.remote.token may be set in a recipe or on the command line: the run directory's
    config.yaml, the checkpoints and wandb get ``to_dict(cfg)``, which says only that it was set."""
    import yaml

    from miles.config import REDACTED, parse_args, to_dict

    cfg, _ = parse_args(["--config", "configs/tiny_cpu.yaml", "--reward.remote.token", "s3cret"])
    assert cfg.reward.remote.token == "s3cret"  # the run itself uses it
    saved = to_dict(cfg)
    assert saved["reward"]["remote"]["token"] == REDACTED
    assert "s3cret" not in yaml.safe_dump(saved)
    plain, _ = parse_args(["--config", "configs/tiny_cpu.yaml"])
    assert to_dict(plain)["reward"]["remote"]["token"] is None
