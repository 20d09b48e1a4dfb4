"""A local diffusers model folder's JSON files: read with errors that name the file and the fix,
before any family-specific check (:func:`miles.models.family.family_of` reads the pipeline class)."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(file: Path) -> dict:
    """A model folder's JSON file; a ``ValueError`` naming the file when it does not parse."""
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{file} is not valid JSON ({e}); restore it from the model's original files"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a {type(data).__name__}, not a JSON object; restore it")
    return data


def read_pipeline_index(path: Path) -> dict:
    """``model_index.json`` of the diffusers folder ``path``; a clear error if ``path`` is not one."""
    index = path / "model_index.json"
    if not path.is_dir():
        raise ValueError(f"model.path {path} is not a folder; point it at a local diffusers Wan folder")
    if not index.is_file():
        raise ValueError(
            f"model.path {path} has no model_index.json: it is not a diffusers folder. Download e.g. "
            "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (the -Diffusers repos) and point model.path at it"
        )
    return read_json(index)


def resolve_model_path(cfg) -> Path:
    """The model folder of ``cfg`` (the run's ``ModelConfig``, read by field: ``models/`` does not
    import the config): ``model.path``, or the embedded tiny model's folder, built on demand."""
    if cfg.path is None:
        from miles.models.tiny import tiny_model_path

        return tiny_model_path(cfg.tiny_model_dir, cfg.tiny_variant)
    return Path(cfg.path).expanduser()
