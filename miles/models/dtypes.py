"""The dtype names a model config uses (``model.dtype``, ``model.vae_dtype``, ``model.text_encoder_dtype``)
and the text encoder's place (``model.text_encoder_offload``): what every family's loader and
``encode_prompts`` share."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def text_encoder_dtype(name: str, device_type: str) -> torch.dtype:
    """``model.text_encoder_dtype`` on a device type: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.text_encoder_dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@contextmanager
def text_encoder_on(text_encoder: nn.Module, device, offload: bool) -> Iterator[None]:
    """With ``offload`` (``model.text_encoder_offload``: the text encoder lives on the CPU), the text
    encoder visits ``device`` for the block and goes back where it was after it, errors included;
    without, nothing moves."""
    home = next(text_encoder.parameters()).device
    if offload:
        text_encoder.to(device)
    try:
        yield
    finally:
        if offload:
            text_encoder.to(home)
