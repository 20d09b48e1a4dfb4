"""The run plan gathers the parts' own checks (issue 44).

- refusals of different parts (the inputs, the attention backend) are listed at once, in one message;
- the family owns its facts: Wan's 512-token context split of an I2V transformer is a warning the
  family gives (nothing outside ``miles/models/`` knows it), and so are the VAE decoder's terms;
- the board: ``miles/rollout/`` imports nothing from ``miles/parallel/``; ``miles/config.py`` names
  no algorithm or reward section of its own (they come from the registries).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from miles.config import parse_args

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, config: str, *flags: str):
    cfg, _ = parse_args(
        ["--config", str(ROOT / "configs" / config), "--run.output-dir", str(tmp_path), *flags]
    )
    return cfg


def test_refusals_of_several_parts_are_listed_at_once(tmp_path):
    from miles.train.plan import PlanError, plan_run

    cfg = _cfg(
        tmp_path,
        "tiny_cpu.yaml",
        "--data.prompt-file",
        str(tmp_path / "missing.txt"),
        "--fsdp-attention-backend",
        "_native_flash",  # no float32 kernel: refused on CUDA
    )
    with pytest.raises(PlanError) as refused:
        plan_run(cfg, 1, device_type="cuda")
    message = str(refused.value)
    assert message.startswith("2 inputs the run would refuse"), message
    assert (
        "missing.txt" in message and "--fsdp-attention-backend _native_flash has no float32 kernel" in message
    )


def test_the_family_gives_its_text_length_warning(tmp_path):
    from miles.train.plan import plan_run

    i2v = plan_run(_cfg(tmp_path / "a", "tiny_i2v_cpu.yaml"), 1, device_type="cpu")  # 512 text tokens
    warned = " ".join(i2v.model.text_length_warnings(64))
    assert "Wan splits its context at 512 text tokens, but data.max_sequence_length is 64" in warned
    assert i2v.model.text_length_warnings(512) == []
    t2v = plan_run(_cfg(tmp_path / "b", "tiny_cpu.yaml"), 1, device_type="cpu")
    assert t2v.model.text_length_warnings(64) == []
    d, k = t2v.model.vae_decoder_memory()
    assert (t2v.sizes.vae_base_dim, t2v.sizes.vae_decoder_bytes) == (d, k) and d > 0 and k > 0


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_rollout_imports_nothing_from_the_parallel_layer():
    for path in sorted((ROOT / "miles" / "rollout").glob("*.py")):
        assert not [m for m in _imports(path) if m.startswith("miles.parallel")], path


def test_the_config_names_no_algorithm_of_its_own():
    from miles.algorithms import algorithm_names, algorithm_option_classes

    strings = set()
    for room in ("config.py", "config_checks.py"):  # the assembly and its cross-field checks
        tree = ast.parse((ROOT / "miles" / room).read_text())
        strings |= {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
    for name in [*algorithm_names(), *algorithm_option_classes()]:
        assert name not in strings, name  # no branch on, or section of, a named algorithm
    assert not any(m.startswith("miles.algorithms.") for m in _imports(ROOT / "miles" / "config.py"))
