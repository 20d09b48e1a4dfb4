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


class ExportWriteError(RuntimeError):
    """The export could not be written (disk full, read-only run directory); no ``.partial`` is left."""


def export_pipeline(cfg: Config, model_path: Path, experts: list[nn.Module], out_dir: Path) -> Path | None:
    """Collective; rank 0 writes ``out_dir``. Returns the folder on rank 0, None elsewhere."""
    states = full_state_dicts(experts)
    if dist.get_rank() != 0:
        # No barrier: writing a large pipeline can outlast the collective timeout, and nothing
        # after the export needs the other ranks.
        return None
    out_dir = Path(out_dir)
    try:
        _write(cfg, model_path, states, out_dir)
    except OSError as e:
        shutil.rmtree(out_dir.with_name(out_dir.name + ".partial"), ignore_errors=True)
        reason = f"{e.strerror}: {e.filename}" if e.strerror else str(e)
        raise ExportWriteError(
            f"could not write the export {out_dir} ({reason}). The final checkpoint is saved: free space "
            "or make the run directory writable, then relaunch the same command with --train.num-rollouts "
            "unchanged to export again"
        ) from None
    return out_dir


def cast_like_from_pretrained(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module`` to ``dtype`` but for the submodules its class keeps in float32 (norms, RoPE,
    time embedding: ``_keep_in_fp32_modules``), as ``from_pretrained(torch_dtype=dtype)`` loads it;
    a plain ``.to(dtype)`` would round them and makes diffusers warn on every export."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or [])
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.to(dtype)


def readable_by_umask(folder: Path) -> None:
    """Give every file and folder under ``folder`` the modes the umask grants (0o644 / 0o755 under
    the usual 022): safetensors writes its files 0o600, unreadable by the user's group."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


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
        cast_like_from_pretrained(transformer, dtype)
    pipe.save_pretrained(tmp / ("merged" if cfg.model.lora_rank > 0 else "pipeline"), safe_serialization=True)
    readable_by_umask(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
