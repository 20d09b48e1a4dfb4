"""Layout errors are refused before any weights load, by every rank, with the same message.

Two gloo ranks build the real ``Trainer`` on a model folder that holds only config JSONs (the tiny
two-expert model's, its transformer edited to 3 heads; no weights: loading them would fail with a
different error). Each rank must raise the same ``ValueError`` for: ``--ulysses-degree 2`` with 3
heads, a world size (2) that ``--sequence-parallel-size 4`` does not divide, a ring with an
attention backend that has no ring kernel, and HSDP replicas (``--parallel.replicate-size``) that do
not divide the world or leave shard groups smaller than an sp group. About 10 s on 2 cores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "two_expert"

CASES = [
    (["--sequence-parallel-size", "2", "--ulysses-degree", "2"], "ulysses_degree=2 is not valid"),
    (["--sequence-parallel-size", "4"], "world size 2 is not divisible by --sequence-parallel-size 4"),
    (
        [
            "--sequence-parallel-size",
            "2",
            "--ulysses-degree",
            "1",
            "--fsdp-attention-backend",
            "_native_math",
        ],
        "has no ring-attention kernel",
    ),
    # HSDP: replicas must divide the world, and each shard group must hold whole sp groups
    (["--parallel.replicate-size", "3"], "world size 2 is not divisible by --parallel.replicate-size 3"),
    (
        ["--sequence-parallel-size", "2", "--parallel.replicate-size", "2"],
        "leaves shard groups of 1 ranks, which do not hold whole sequence-parallel groups",
    ),
]


def _config_only_folder(dst: Path) -> Path:
    for src in TINY.rglob("*.json"):
        (dst / src.relative_to(TINY)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst / src.relative_to(TINY))
    config = dst / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_attention_heads": 3}))
    return dst


def _body(rank, world_size, model_dir, out_dir):
    from miles.config import parse_args
    from miles.train.trainer import Trainer

    for flags, message in CASES:
        cfg, _ = parse_args(
            ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--model.path", model_dir]
            + ["--run.output-dir", out_dir, "--run.wandb-mode", "disabled", *flags]
        )
        with pytest.raises(ValueError, match=message):
            Trainer(cfg)


def test_every_rank_refuses_a_bad_layout_before_loading_weights(tmp_path):
    folder = _config_only_folder(tmp_path / "wan_configs_only")
    assert not list(folder.rglob("*.safetensors"))
    run_pooled(_body, 2, str(folder), str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
