"""FSDP2 wrapping of a Wan transformer over the flattened dp x sp mesh.

Order (in place, after SP is installed): activation checkpointing per block → ``torch.compile`` per
block (optional) → ``fully_shard`` per block → ``fully_shard`` on the root. FSDP keeps its
default gradient mean over all dp·sp ranks; with the SP gather's backward summing over sp, that
mean is exactly (1/dp)·Σ_dp g (see docs/sequence_parallel.md). The same function wraps the model in the trainer and in the
grad-sync parity tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.parallel.checkpointing import apply_checkpointing
from miles.parallel.compile import compile_blocks as _compile_blocks


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    checkpoint_modes: Sequence[str] | None = None,
    compile_blocks: bool = False,
) -> nn.Module:
    """Shard ``model`` (a WanTransformer3DModel, possibly SP-installed) in place over ``mesh``.

    ``checkpoint_modes``: one activation-checkpointing mode per block (``none``, ``selective``,
    ``attention``, ``full``; see :mod:`miles.parallel.checkpointing`), applied before sharding.
    ``compile_blocks``: compile each (wrapped) block's forward (see :mod:`miles.parallel.compile`).
    """
    if checkpoint_modes is not None:
        apply_checkpointing(model.blocks, checkpoint_modes)
    if compile_blocks:
        _compile_blocks(model.blocks)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded_for_rollout(models: list[nn.Module], enabled: bool = True, reshard_after_forward: bool = True):
    """Gather each FSDP module's parameters once for a whole rollout, then reshard.

    Sampling runs many forwards with the same weights; without this, FSDP all-gathers every
    block on every denoising step. The parameters used are the training parameters themselves,
    so rollout and training see the same bits.
    """
    modules = [m for model in models for m in _fsdp_modules(model)] if enabled else []
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)
