"""Export the trained transformer(s) as a diffusers folder that ``WanPipeline.from_pretrained`` loads.

    run_dir/export/pipeline/     full fine-tune: the whole pipeline with the trained transformer(s)
    run_dir/export/lora/<expert>/  LoRA: the adapter of each expert (diffusers LoRA format)
    run_dir/export/merged/       LoRA: the pipeline with the adapters merged into the weights

The full weights are gathered to rank 0 one expert at a time (CPU), loaded into a fresh copy of
the pipeline read from the model folder, and saved as safetensors in the compute dtype. The
folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from miles.config import Config

EXPERT_NAMES = ("transformer", "transformer_2")


def full_state_dicts(experts: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Collective: each expert's full (unsharded) state dict, on CPU, on rank 0 (empty elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return [get_model_state_dict(e, options=options) for e in experts]


def export_pipeline(cfg: Config, model_path: Path, experts: list[nn.Module], out_dir: Path) -> Path | None:
    """Collective; rank 0 writes ``out_dir``. Returns the folder on rank 0, None elsewhere."""
    states = full_state_dicts(experts)
    if dist.get_rank() != 0:
        # No barrier: writing a large pipeline can outlast the collective timeout, and nothing
        # after the export needs the other ranks.
        return None
    _write(cfg, model_path, states, Path(out_dir))
    return Path(out_dir)


def _write(cfg: Config, model_path: Path, states: list[dict], out_dir: Path) -> None:
    from diffusers import DiffusionPipeline, WanPipeline

    from miles.models.wan import DTYPES

    dtype = DTYPES[cfg.model.dtype]
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # the folder's own pipeline class: an image-to-video folder keeps its image encoder
    pipe = DiffusionPipeline.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    for name, state in zip(EXPERT_NAMES, states):
        transformer = getattr(pipe, name)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model_state_dict

            transformer.add_adapter(
                LoraConfig(
                    r=cfg.model.lora_rank,
                    lora_alpha=cfg.model.lora_alpha,
                    init_lora_weights="gaussian",
                    target_modules=cfg.model.lora_target_modules,
                )
            )
            transformer.load_state_dict(state, strict=True)
            WanPipeline.save_lora_weights(
                tmp / "lora" / name,
                transformer_lora_layers=get_peft_model_state_dict(transformer),
                # alpha / rank travel with the adapter, or loading assumes scale 1
                transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
                safe_serialization=True,
            )
            transformer.fuse_lora(lora_scale=1.0)
            transformer.unload_lora()
        else:
            transformer.load_state_dict(state, strict=True)
        transformer.to(dtype)
    pipe.save_pretrained(tmp / ("merged" if cfg.model.lora_rank > 0 else "pipeline"), safe_serialization=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
