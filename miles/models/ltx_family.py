"""The LTX-Video family (LTX-Video 2B and 13B text-to-video, diffusers ``LTXPipeline`` folders)
behind the model-family seam, :mod:`miles.models.family`: the loader (:mod:`miles.models.ltx`), its
configs-only model, and the export layout (one ``transformer``; LoRA adapters saved as
``LTXPipeline`` saves them)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from miles.models.ltx import (
    EXPERT_FOLDERS,
    LTX_PIPELINES,
    LTXModel,
    check_ltx_folder,
    load_ltx,
    scheduler_config,
)


class LTXFamily:
    """The :class:`miles.models.family.ModelFamily` of diffusers LTX-Video folders."""

    name = "ltx"
    pipeline_classes = LTX_PIPELINES
    expert_folders = EXPERT_FOLDERS

    def load(self, model_cfg, device, experts: str = "load", seed: int = 0) -> LTXModel:
        return load_ltx(model_cfg, device, experts=experts, seed=seed)

    def load_meta(self, cfg, strict: bool = False) -> tuple[LTXModel, dict, list[str]]:
        """The folder of ``cfg.model`` as configs only: transformer, VAE and text encoder on meta."""
        from miles.models.folder import read_pipeline_index, resolve_model_path
        from miles.models.meta import (
            _diffusers_class,
            _meta_from_config,
            optional_meta_text_encoder,
            refusal_warnings,
        )

        path = resolve_model_path(cfg.model)
        index = read_pipeline_index(path)
        warnings = refusal_warnings(check_ltx_folder, path, strict)
        if cfg.model.task not in ("auto", "t2v"):
            raise ValueError(
                f"model.task {cfg.model.task!r}: LTX-Video folders are text-to-video; set model.task auto"
            )
        eval_cfg = getattr(cfg, "eval", None)
        if eval_cfg is not None and eval_cfg.prompt_file and eval_cfg.sampler == "pipeline":
            raise ValueError(
                "eval.sampler pipeline: LTX-Video's scheduler takes its shift from the token count "
                "(use_dynamic_shifting), which the pipeline sampler does not pass yet; use eval.sampler rollout"
            )
        for sub in ("transformer", "vae"):
            if not (path / sub / "config.json").is_file():
                raise ValueError(f"model.path {path} lacks {sub}/config.json (the dry run reads it)")
        transformer = _meta_from_config(
            _diffusers_class(index, "transformer", "LTXVideoTransformer3DModel"), path / "transformer"
        )
        vae = _meta_from_config(_diffusers_class(index, "vae", "AutoencoderKLLTXVideo"), path / "vae")
        text_encoder = optional_meta_text_encoder(index, path / "text_encoder", warnings)
        model = LTXModel(
            path=path,
            transformers=[transformer],
            pipeline=SimpleNamespace(vae=vae, text_encoder=text_encoder),
            scheduler_config=scheduler_config(path),
        )
        return model, index, warnings

    def save_lora_weights(self, folder: Path, **kwargs) -> None:
        from diffusers import LTXPipeline

        LTXPipeline.save_lora_weights(folder, **kwargs)


LTX = LTXFamily()
