"""The Wan family (Wan2.1, Wan2.2 TI2V-5B and A14B, their image-to-video forms) behind the
model-family seam, :mod:`miles.models.family`: the loader (:mod:`miles.models.wan`), the
configs-only model (:mod:`miles.models.meta`) and the export layout (``transformer``,
``transformer_2``; LoRA adapters saved as ``WanPipeline`` saves them)."""

from __future__ import annotations

from pathlib import Path

from miles.models.meta import load_meta_model
from miles.models.wan import EXPERT_FOLDERS, WAN_PIPELINES, WanModel, load_wan


class WanFamily:
    """The :class:`miles.models.family.ModelFamily` of diffusers Wan folders."""

    name = "wan"
    pipeline_classes = WAN_PIPELINES
    expert_folders = EXPERT_FOLDERS

    def load(self, model_cfg, device, experts: str = "load", seed: int = 0) -> WanModel:
        return load_wan(model_cfg, device, experts=experts, seed=seed)

    def load_meta(self, cfg, strict: bool = False) -> tuple[WanModel, dict, list[str]]:
        return load_meta_model(cfg, strict=strict)

    def save_lora_weights(self, folder: Path, **kwargs) -> None:
        from diffusers import WanPipeline

        WanPipeline.save_lora_weights(folder, **kwargs)


WAN = WanFamily()
