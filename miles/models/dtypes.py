"""The dtype names a model config uses (``model.dtype``, ``model.vae_dtype``, ``model.text_encoder_dtype``)."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def text_encoder_dtype(name: str, device_type: str) -> torch.dtype:
    """``model.text_encoder_dtype`` on a device type: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.text_encoder_dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
