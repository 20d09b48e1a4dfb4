"""What a resume compares with the checkpoint's config, and which checkpoint it picks.

Each key of ``RESUME_MUST_MATCH`` changed alone is named with the checkpoint's value and the flag
that restores it; keys that do not change the checkpoint's meaning (learning rate, layout, number of
rollouts) pass. A checkpoint with a truncated or missing shard, or unreadable metadata, is named by
``checkpoint_problem`` (the fallback to the previous one runs in tests/distributed/test_checkpoint_faults.py).
The model folder's fingerprint tells configs, file names, sizes and safetensors headers apart (not a
copy, not a diffusers version stamp), and a checkpoint of another base model is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from miles.config import parse_args
from miles.models.fingerprint import fingerprint_mismatch, model_fingerprint
from miles.train.resume import RESUME_MUST_MATCH, config_differences, resume_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _cfg(*flags: str):
    return parse_args(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), *flags])[0]


CHANGES = {
    "model.path": ("/models/Wan2.1-T2V-1.3B", "[--model.path /models/Wan2.1-T2V-1.3B]"),
    "model.tiny_variant": ("single_expert", "[--model.tiny-variant single_expert]"),
    "model.lora_rank": (8, "[--model.lora-rank 8]"),
    "model.lora_alpha": (16.0, "[--model.lora-alpha 16.0]"),
    "model.lora_target_modules": (["to_q", "to_v"], "[--model.lora-target-modules to_q to_v]"),
    "data.prompt_file": ("prompts/a.txt", "[--data.prompt-file prompts/a.txt]"),
    "run.seed": (7, "[--run.seed 7]"),
    "algorithm.name": ("diffusion_nft", "[--algorithm.name diffusion_nft]"),
}


@pytest.mark.parametrize("key", list(RESUME_MUST_MATCH))
def test_each_key_that_must_match_is_named_with_its_flag(key):
    cfg = _cfg()
    saved = dataclasses.asdict(cfg)
    value, flag = CHANGES[key]
    section, name = key.split(".")
    saved[section][name] = value
    diffs = config_differences(saved, cfg)
    assert len(diffs) == 1 and diffs[0].startswith(f"{key} (") and diffs[0].endswith(flag), diffs


def test_what_may_change_on_resume_passes():
    saved = dataclasses.asdict(_cfg())
    cfg = _cfg(
        "--train.learning-rate", "3e-5", "--train.num-rollouts", "9", "--sequence-parallel-size", "2",
        "--data.prompts-per-rank", "4", "--run.collective-timeout-s", "60",
    )  # fmt: skip
    assert config_differences(saved, cfg) == []


def test_the_same_model_folder_by_another_path_passes(tmp_path, monkeypatch):
    (tmp_path / "wan").mkdir()
    saved = dataclasses.asdict(_cfg("--model.path", str(tmp_path / "wan")))
    monkeypatch.chdir(tmp_path)
    assert config_differences(saved, _cfg("--model.path", "wan")) == []  # relative to the launch folder
    assert config_differences(saved, _cfg("--model.path", "other"))


def _folder(root: Path, weights: dict) -> Path:
    """A minimal diffusers-style folder: model_index.json, transformer/{config.json, safetensors}."""
    import torch
    from safetensors.torch import save_file

    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "WanPipeline", "transformer": ["d", "W"]})
    )
    (root / "transformer" / "config.json").write_text(
        json.dumps({"_diffusers_version": "0.1", "num_layers": 2})
    )
    save_file({k: torch.zeros(v) for k, v in weights.items()}, root / "transformer" / "w.safetensors")
    return root


def test_the_fingerprint_reads_configs_names_sizes_and_headers_only(tmp_path):
    a = _folder(tmp_path / "a", {"x": (2, 3)})
    fp = model_fingerprint(a)
    assert fp["path"] == str(a.resolve()) and set(fp["components"]) == {"model_index.json", "transformer"}
    # A copy elsewhere, and another diffusers version stamp, are the same model.
    b = _folder(tmp_path / "b", {"x": (2, 3)})
    (b / "transformer" / "config.json").write_text(json.dumps({"_diffusers_version": "0.2", "num_layers": 2}))
    assert fingerprint_mismatch(fp, model_fingerprint(b)) is None
    # Another shape (same byte count: only the header tells), another config value, another file.
    c = _folder(tmp_path / "c", {"x": (3, 2)})
    assert fingerprint_mismatch(fp, model_fingerprint(c)) == ["transformer"]
    (b / "transformer" / "config.json").write_text(json.dumps({"num_layers": 3}))
    assert fingerprint_mismatch(fp, model_fingerprint(b)) == ["transformer"]
    (b / "vae").mkdir()
    (b / "vae" / "config.json").write_text("{}")
    assert fingerprint_mismatch(fp, model_fingerprint(b)) == ["transformer", "vae"]


def _write_digests(ckpt: Path) -> None:
    """The checkpoint's SHA256SUMS, as coreutils writes it (a checkpoint's bytes are checked first)."""
    names = sorted(p.name for p in ckpt.iterdir() if p.name not in ("SHA256SUMS", "COMPLETE"))
    sums = subprocess.run(["sha256sum", *names], cwd=ckpt, check=True, capture_output=True, text=True)
    (ckpt / "SHA256SUMS").write_text(sums.stdout)


def test_a_checkpoint_of_another_base_model_is_refused_before_loading(tmp_path):
    model = _folder(tmp_path / "model", {"x": (2, 3)})
    cfg = _cfg("--model.path", str(model))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("1\n")  # no shards: the fingerprint is checked before the index
    (ckpt / ".metadata").write_bytes(b"not a DCP index")
    state = {"config": dataclasses.asdict(cfg), "model_fingerprint": model_fingerprint(model)}
    (ckpt / "trainer.json").write_text(json.dumps(state))
    _write_digests(ckpt)
    _folder(tmp_path / "other", {"x": (3, 2)})
    shutil.rmtree(model)
    shutil.move(tmp_path / "other", model)  # the same path now holds another model
    with pytest.raises(ValueError) as err:
        resume_checkpoint(tmp_path / "run", cfg)
    message = str(err.value)
    assert "the checkpoint was trained from another base model: transformer of" in message, message
    assert f"set model.path to {model.resolve()}" in message, message
    # A checkpoint saved before fingerprints existed is not checked (it is then found incomplete).
    del state["model_fingerprint"]
    (ckpt / "trainer.json").write_text(json.dumps(state))
    _write_digests(ckpt)
    with pytest.raises(ValueError, match="every checkpoint in .* is corrupt"):
        resume_checkpoint(tmp_path / "run", cfg)
