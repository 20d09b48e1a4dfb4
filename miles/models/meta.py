"""A Wan model folder read as configs only: its modules on the ``meta`` device (exact parameter
counts and shapes, no memory, no weights), for the run plan (:mod:`miles.train.plan`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from miles.models.folder import read_json
from miles.models.i2v import check_i2v_run, condition_mode
from miles.models.wan import WanModel, check_wan_folder, read_model_index, resolve_model_path

__all__ = ["load_meta_model"]


def _diffusers_class(index: dict, component: str, default: str) -> type:
    import diffusers

    entry = index.get(component) or [None, None]
    name = entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[1] else default
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"model_index.json names {component} class {name!r}, which diffusers does not have")
    return cls


def _meta_from_config(cls: type, folder: Path) -> nn.Module:
    """``cls`` built from ``folder/config.json`` on the meta device: exact shapes, no memory. A broken
    file is named (``ValueError``), as loading the weights names it."""
    read_json(folder / "config.json")
    config = cls.load_config(folder)
    with torch.device("meta"):
        return cls.from_config(config)


def _meta_text_encoder(index: dict, folder: Path) -> nn.Module | None:
    entry = index.get("text_encoder") or [None, None]
    if not (folder / "config.json").is_file() or not isinstance(entry, list) or entry[0] != "transformers":
        return None
    import transformers

    cls = getattr(transformers, entry[1], None)
    if cls is None:
        return None
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return cls(config)


def optional_meta_text_encoder(index: dict, folder: Path, warnings: list[str]) -> nn.Module | None:
    """The text encoder of ``folder`` on the meta device, or None: absent, or its config unreadable
    (then a warning: the plan only reports its parameter count)."""
    try:
        return _meta_text_encoder(index, folder)
    except Exception as e:  # optional: only its parameter count is reported
        warnings.append(f"text encoder config unreadable ({e}); not counted")
        return None


def refusal_warnings(check, path: Path, strict: bool) -> list[str]:
    """The dry run's warnings of ``check(path)`` (a family's complete-folder check): none when it
    passes, "the real run will refuse this folder" when it raises ``ValueError``; ``strict`` (the
    real run): that ``ValueError``."""
    try:
        check(path)
    except ValueError as e:  # the dry run needs only configs; the real run needs every component
        if strict:
            raise
        return [f"the real run will refuse this folder: {e}"]
    return []


def load_meta_model(cfg, strict: bool = False) -> tuple[WanModel, dict, list[str]]:
    """A :class:`WanModel` whose transformers and VAE live on the meta device, its ``model_index.json``
    and warnings. Raises ``ValueError`` for a folder the run cannot use; ``strict`` (the real run):
    also for one that lacks a component the weights need (the dry run reads configs only, and warns)."""
    path = resolve_model_path(cfg.model)
    index = read_model_index(path)
    warnings = refusal_warnings(check_wan_folder, path, strict)
    mode = condition_mode(path, index, cfg.model.task)
    check_i2v_run(path, index, mode, cfg.data.max_sequence_length)
    experts = []
    for sub in ("transformer", "transformer_2"):
        folder = path / sub
        if sub == "transformer_2" and not (index.get(sub) or [None])[0]:
            continue
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model.path {path} lacks {sub}/config.json (the dry run reads the transformer config)"
            )
        experts.append(_meta_from_config(_diffusers_class(index, sub, "WanTransformer3DModel"), folder))
    if not (path / "vae" / "config.json").is_file():
        raise ValueError(f"model.path {path} lacks vae/config.json (its scale factors give the latent shape)")
    vae = _meta_from_config(_diffusers_class(index, "vae", "AutoencoderKLWan"), path / "vae")
    text_encoder = optional_meta_text_encoder(index, path / "text_encoder", warnings)
    model = WanModel(
        path=path,
        transformers=experts,
        boundary_ratio=index.get("boundary_ratio") if len(experts) == 2 else None,
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        pipeline=SimpleNamespace(vae=vae, text_encoder=text_encoder),
        condition_mode=mode,
    )
    return model, index, warnings
