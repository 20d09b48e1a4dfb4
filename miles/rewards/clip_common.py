"""What the CLIP-based scorers share: local-folder checks naming the repo to download, loading a
transformers ``CLIPModel``/``CLIPProcessor`` offline, and unit-norm frame and prompt embeddings.

Frames go through the processor as uint8 PIL images (``frames_to_uint8``), so it resizes, crops
and normalises them exactly as for the photos the scorer was trained on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from miles.rewards.base import frames_to_uint8, sample_frame_indices

MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
PROCESSOR_FILES = (("preprocessor_config.json", "processor_config.json"), ("tokenizer.json", "vocab.json"))


def check_folder(path: str | os.PathLike | None, key: str, repo: str, groups: Sequence[Sequence[str]]) -> str:
    """``path`` as str if it is a folder with one file of each group; else ValueError naming ``repo``."""
    need = " and ".join("one of " + "/".join(g) if len(g) > 1 else g[0] for g in groups)
    fix = f"download {repo} to a local folder (e.g. `hf download {repo} --local-dir DIR`)"
    if path is None or str(path) == "":
        raise ValueError(f"set {key} to a local folder holding {need}: {fix}; models are never downloaded")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{key}={path!r} is not a folder; {fix} and point {key} at it")
    present = set(os.listdir(path))
    for group in groups:
        if not present.intersection(group):
            raise ValueError(f"{key}={path!r} holds no {'/'.join(group)}; it must hold {need}: {fix}")
    return path


def check_file(path: str | os.PathLike | None, key: str, repo: str, names: Sequence[str]) -> str:
    """A weights file: ``path`` itself, or the first of ``names`` inside the folder ``path``."""
    fix = f"download {'/'.join(names)} from {repo}"
    if path is None or str(path) == "":
        raise ValueError(f"set {key} to a local file or folder: {fix}; models are never downloaded")
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in names:
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise ValueError(f"{key}={path!r} holds no {'/'.join(names)}: {fix}")
    raise ValueError(f"{key}={path!r} does not exist: {fix}")


def load_processor(path: str, key: str, repo: str) -> Any:
    from transformers import CLIPProcessor

    try:
        return CLIPProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"could not load a CLIPProcessor from {key}={path!r} ({e}); expected {repo}'s"
        ) from e


def load_clip(path: str, key: str, repo: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A frozen ``CLIPModel`` from a save_pretrained folder, on ``device`` in ``dtype``."""
    from transformers import CLIPModel

    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"could not load a CLIPModel from {key}={path!r} ({e}); expected {repo}'s") from e
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def frame_embeddings(
    model: Any, processor: Any, videos: torch.Tensor, num_frames: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Unit-norm image embeddings of ``num_frames`` frames per video: (B, K, D) float32."""
    idx = sample_frame_indices(videos.shape[1], num_frames)
    frames = frames_to_uint8(videos[:, idx.to(videos.device)])  # (B, K, H, W, C)
    images = [Image.fromarray(frame) for video in frames for frame in video]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    device = next(model.parameters()).device
    emb = model.get_image_features(pixel_values=pixels.to(device=device, dtype=dtype)).pooler_output
    return unit(emb.float()).view(videos.shape[0], len(idx), -1)


def text_embeddings(model: Any, processor: Any, prompts: Sequence[str]) -> torch.Tensor:
    """Unit-norm prompt embeddings (B, D) float32, prompts truncated to the text tower's length."""
    max_length = model.config.text_config.max_position_embeddings
    text = processor(
        text=list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    device = next(model.parameters()).device
    emb = model.get_text_features(
        input_ids=text["input_ids"].to(device), attention_mask=text["attention_mask"].to(device)
    ).pooler_output
    return unit(emb.float())
