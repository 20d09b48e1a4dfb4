"""The LoRA adapters of a run, built in one place for training, export and evaluation."""

from __future__ import annotations

__all__ = ["lora_config"]


def lora_config(model_cfg):
    """peft's ``LoraConfig`` for ``model_cfg`` (the run's ``ModelConfig``: ``lora_rank``,
    ``lora_alpha``, ``lora_target_modules``; gaussian init), or None for a full fine-tune."""
    if model_cfg.lora_rank == 0:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        init_lora_weights="gaussian",
        target_modules=model_cfg.lora_target_modules,
    )
