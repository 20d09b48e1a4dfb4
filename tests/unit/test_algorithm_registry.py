"""Algorithms own their options, as rewards do (issue 44).

- a toy algorithm in a temporary module (its options dataclass with ``RANGES``, its ``check``, one
  ``@register_algorithm``) imported before the config: its section and ``algorithm.name`` choice
  appear in the config, the flags, ``--help``, the YAML loader and the range table, and its check
  refuses; nothing else is edited (one process, ~10 s: the config is built once per process);
- each shipped algorithm's section is its own file's dataclass, and the config's algorithm checks
  are the algorithms' own;
- a misspelled option of an algorithm is refused naming the valid ones, from a recipe and a flag.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.algorithms import algorithm_errors, algorithm_names, algorithm_option_classes, register_algorithm
from miles.algorithms.base import Algorithm
from miles.config import AlgorithmConfig, Config, ConfigError, load_config_file, parse_args

REPO = Path(__file__).resolve().parents[2]

TOY = '''
import dataclasses
from typing import ClassVar

from miles.algorithms import register_algorithm
from miles.algorithms.base import Algorithm


@dataclasses.dataclass(kw_only=True)
class ToyOptions:
    """``toy``: a test's algorithm."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {"alpha": ("(0, 100]", "the toy's step")}

    alpha: float = 1.0
    """The toy's step size."""


@register_algorithm("toy", options=ToyOptions)
class Toy(Algorithm):
    name = "toy"
    summary = "a toy that trains nothing (section ``toy``)."

    @classmethod
    def check(cls, cfg):
        return ["algorithm.name toy rolls out without CFG: set rollout.guidance_scale 1"] * (
            cfg.rollout.guidance_scale > 1
        )

    def __init__(self, cfg, schedule=None):
        self.alpha = cfg.toy.alpha

    def sde_steps(self, num_steps, generator):
        return []

    def accumulate(self, policy, batch, chunks, step_in_rollout=0):
        return {"loss": 0.0}

    def forwards_per_sample(self, batch):
        return 0
'''

PROBE = """
import contextlib, io, json, sys
import toy_algorithm  # the one import line
from miles.algorithms import build_algorithm
from miles.config import RANGES, ConfigError, load_config_file, parse_args

out = {}
cfg, _ = parse_args(["--algorithm.name", "toy", "--toy.alpha", "0.25", "--rollout.guidance-scale", "1"])
out["alpha"], out["name"] = cfg.toy.alpha, cfg.algorithm.name
out["built"] = type(build_algorithm(cfg)).__name__
out["range"] = RANGES.get("toy.alpha")
out["yaml"] = load_config_file(sys.argv[1]).toy.alpha
for key, argv in {
    "refused_range": ["--algorithm.name", "toy", "--toy.alpha", "-1", "--rollout.guidance-scale", "1"],
    "refused_check": ["--algorithm.name", "toy"],
}.items():
    try:
        parse_args(argv)
    except ConfigError as e:
        out[key] = str(e)
try:
    load_config_file(sys.argv[2])
except ConfigError as e:
    out["refused_key"] = str(e)
buf = io.StringIO()
with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
    parse_args(["--help"])
out["help"] = buf.getvalue()
print(json.dumps(out))
"""


def test_a_toy_algorithm_is_its_file_and_one_registration(tmp_path):
    (tmp_path / "toy_algorithm.py").write_text(TOY)
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("algorithm:\n  name: toy\nrollout:\n  guidance_scale: 1.0\ntoy:\n  alpha: 3.0\n")
    bad.write_text("algorithm:\n  name: toy\ntoy:\n  alpah: 3.0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(good), str(bad)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["alpha"], out["name"], out["built"]) == (0.25, "toy", "Toy")
    assert out["range"] == ["(0, 100]", "the toy's step"]
    assert out["yaml"] == 3.0
    assert "toy.alpha must be > 0 (the toy's step), got -1.0" in out["refused_range"]
    assert out["refused_check"] == "algorithm.name toy rolls out without CFG: set rollout.guidance_scale 1"
    assert "unknown config key 'toy.alpah'; valid keys here: ['alpha']" in out["refused_key"]
    assert "--toy.alpha" in out["help"] and "a toy that trains nothing" in out["help"]


def test_each_section_is_its_algorithms_own():
    sections = algorithm_option_classes()
    assert list(sections) == ["grpo", "nft", "awm", "dgpo", "dpo", "sft"]
    assert algorithm_names() == [
        "flow_grpo",
        "grpo_guard",
        "diffusion_nft",
        "awm",
        "dgpo",
        "online_dpo",
        "sft",
    ]
    for section, cls in sections.items():
        assert cls.__module__.startswith("miles.algorithms."), (section, cls)
        assert isinstance(getattr(Config(), section), cls)
        assert all(key in {f for f in cls.__dataclass_fields__} for key in cls.RANGES), section


def test_the_algorithm_checks_are_the_algorithms_own():
    guard = Config(algorithm=AlgorithmConfig(name="grpo_guard"))
    assert algorithm_errors(guard) == []
    guard.rollout.sde_type = "cps"
    guard.grpo.step_loss_weight = "sigma_over_sqrt_dt"
    errors = algorithm_errors(guard)
    assert (
        len(errors) == 2
        and "set rollout.sde_type sde" in errors[0]
        and "grpo.step_loss_weight none" in errors[1]
    )
    with pytest.raises(ConfigError, match="set rollout.sde_type sde"):
        parse_args(["--algorithm.name", "grpo_guard", "--rollout.sde-type", "cps"])
    with pytest.raises(ConfigError, match=r"rollout.noise_level must be > 0 with algorithm.name grpo_guard"):
        parse_args(["--algorithm.name", "grpo_guard", "--rollout.noise-level", "0"])
    parse_args(["--algorithm.name", "diffusion_nft", "--rollout.noise-level", "0"])  # NFT samples ODEs
    with pytest.raises(ConfigError, match=r"algorithm.name sft trains on data.prompt_file"):
        parse_args(["--algorithm.name", "sft"])


def test_a_misspelled_option_names_the_valid_ones(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  name: diffusion_nft\nnft:\n  bta: 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'nft.bta'; valid keys here: \['beta', "):
        load_config_file(recipe)
    with pytest.raises(SystemExit):
        parse_args(["--nft.bta", "0.5"])
    assert "--nft.beta" in capsys.readouterr().err  # tyro names the similar flag


def test_registration_refuses_a_section_held_by_other_options():
    import dataclasses

    @dataclasses.dataclass
    class Other:
        beta: float = 1.0

    with pytest.raises(ValueError, match="the config section 'nft' already holds NFTConfig"):

        @register_algorithm("other_nft_test", options=Other, section="nft")
        class OtherNFT(Algorithm):
            pass

    with pytest.raises(TypeError, match="options must be a dataclass type"):
        register_algorithm("not_a_dataclass_test", options=dict)
    assert "other_nft_test" not in algorithm_names()
