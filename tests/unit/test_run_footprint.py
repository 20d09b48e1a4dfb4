"""The run's footprint is computed once, by the plan (issue 44): model sizes, token counts and the
resident memory the trainer, the dry run and the benches read.

- the sizes of a model before LoRA (adapters predicted from rank and targets) equal its sizes once
  peft installed them: the plan's meta count is the trainer's count;
- the plan's sizes of the tiny model equal those of the loaded modules with their adapters;
- the dry run's memory includes the reward models, estimated from their weight files (safetensors
  headers, each weight once), and both peaks grow by exactly those bytes;
- the tokens of a sample are the family's count, in the plan's shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config import parse_args
from miles.rewards.base import weight_file_bytes
from miles.train.memory_budget import model_sizes

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / ".cache" / "tiny-wan"


def _cfg(tmp_path: Path, *flags: str):
    cfg, _ = parse_args(
        ["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--run.output-dir", str(tmp_path), *flags]
    )
    return cfg


def test_predicted_adapters_count_as_installed_ones():
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    model = WanTransformer3DModel.from_pretrained(TINY / "two_expert" / "transformer")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    predicted = model_sizes([model], lora_rank=4, lora_targets=targets)
    assert predicted.lora_params > 0
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert model_sizes([model]) == predicted


def test_the_plans_sizes_are_the_loaded_models(tmp_path):
    from peft import LoraConfig

    from miles.train.plan import plan_run

    cfg = _cfg(tmp_path, "--model.lora-rank", "4")
    plan = plan_run(cfg, 1, device_type="cpu")
    loaded = plan.family.load(cfg.model, torch.device("cpu"))
    for t in loaded.transformers:
        t.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=cfg.model.lora_target_modules))
    pipe = loaded.pipeline
    sizes = model_sizes(
        loaded.transformers, pipe.text_encoder, pipe.vae, vae_decoder=loaded.vae_decoder_memory()
    )
    assert sizes == plan.sizes
    r = cfg.rollout
    assert plan.shape.tokens_per_sample == loaded.num_tokens(r.num_frames, r.height, r.width) > 0
    assert plan.shape.tokens_per_rank == -(-plan.shape.tokens_per_sample // plan.dims.sp)


def test_weight_files_counted_once_by_their_headers(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "reward"
    (folder / "sub").mkdir(parents=True)
    save_file(
        {"w": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.float16)}, folder / "model.safetensors"
    )
    save_file({"x": torch.zeros(2, 2)}, folder / "sub" / "head.safetensors")
    torch.save({"w": torch.zeros(100)}, folder / "pytorch_model.bin")  # the same weights again: not counted
    assert weight_file_bytes(folder) == (15 + 7 + 4) * 4
    assert weight_file_bytes([folder, folder / "model.safetensors"], itemsize=2) == (15 + 7 + 4) * 2
    alone = tmp_path / "head.pt"
    torch.save({"w": torch.zeros(10)}, alone)
    assert weight_file_bytes(alone) == alone.stat().st_size


def test_the_dry_run_counts_the_reward_models(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from miles.rewards.pickscore import PickScore
    from miles.train.plan import plan_run

    folder = tmp_path / "pickscore"
    folder.mkdir()
    save_file({"w": torch.zeros(1000, 3)}, folder / "model.safetensors")
    found = (str(folder), "reward.pickscore.model_path", str(folder))
    monkeypatch.setattr(PickScore, "check_resources", staticmethod(lambda **_: found))
    base = plan_run(_cfg(tmp_path / "a"), 1, device_type="cpu")
    with_pick = plan_run(_cfg(tmp_path / "b", "--reward.weights.pickscore", "1.0"), 1, device_type="cpu")
    assert base.resident.rewards == 0
    assert with_pick.resident.rewards == 3000 * 4  # float32 on the device, as the trainer builds it
    assert with_pick.memory_gib["rewards"] == pytest.approx(3000 * 4 / 2**30)
    for peak in ("train_peak", "rollout_peak"):
        grown = (with_pick.memory_gib[peak] - base.memory_gib[peak]) * 2**30
        assert grown == pytest.approx(3000 * 4)
