"""The dtype a module computes in: the one fact the FSDP wrapper (``miles.parallel.fsdp``) writes on
the modules it casts and the sampler and the losses (``miles.rollout``, ``miles.algorithms``) read,
so that the rollout's math imports nothing from the parallel layer."""

from __future__ import annotations

import torch
from torch import nn

COMPUTE_DTYPE_ATTR = "_miles_compute_dtype"


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model`` computes in: FSDP2's parameter dtype after ``apply_fsdp``, else its
    parameters' dtype. Latents and text embeddings enter the model in it; the timestep stays fp32."""
    dtype = getattr(model, COMPUTE_DTYPE_ATTR, None) or getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype
