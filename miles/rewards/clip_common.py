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
from miles.rewards.resources import ResourceCheck

MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
PROCESSOR_FILES = (("preprocessor_config.json", "processor_config.json"), ("tokenizer.json", "vocab.json"))


def check_folder(path: str | os.PathLike | None, key: str, repo: str, groups: Sequence[Sequence[str]]) -> str:
    """``path`` as str if it is a folder with one whole file of each group; else a ``ResourceError``
    listing every problem, naming ``repo``."""
    files = ResourceCheck()
    found = files.folder(path, key, repo, groups)
    files.done()
    return found


def check_file(path: str | os.PathLike | None, key: str, repo: str, names: Sequence[str]) -> str:
    """A whole weights file: ``path`` itself, or the first of ``names`` inside the folder ``path``."""
    files = ResourceCheck()
    found = files.file(path, key, repo, names)
    files.done()
    return found


def check_clip_folder(
    files: ResourceCheck, path: str | os.PathLike | None, key: str, repo: str, groups: Sequence[Sequence[str]]
) -> str | None:
    """A CLIP folder as the reward loads it: its files whole, then its processor loaded by
    :func:`load_processor`, the constructor's own loader (problems recorded in ``files``)."""
    found = files.folder(path, key, repo, groups)
    if found is not None:
        files.attempt(load_processor, found, key, repo)
    return found


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
