"""FSDP2 wrapping of a Wan transformer over the flattened dp x sp mesh (or HSDP's 2-D mesh).

HSDP (``parallel.replicate_size`` R > 1): ``mesh`` is the 2-D ``("replicate", "shard")`` mesh of
:func:`miles.parallel.topology.build_parallel_mesh`, and ``fully_shard`` on a 2-D mesh shards over
the inner axis and replicates over the outer one. Gradients are reduce-scattered (mean) over the
shard group and all-reduced (mean) over the replicas: a mean over all W ranks, as plain FSDP's,
so the identity below holds unchanged (tests/distributed/test_hsdp.py checks it).

Order (in place, after SP is installed): activation checkpointing per block → ``torch.compile`` per
block (optional) → ``fully_shard`` per block → ``fully_shard`` on the root. FSDP keeps its
default gradient mean over all dp·sp ranks; with the SP gather's backward summing over sp, that
mean is exactly (1/dp)·Σ_dp g (see docs/sequence_parallel.md). The same function wraps the model in the trainer and in the
grad-sync parity tests.

Mixed precision keeps every forward input as the caller passes it (``cast_forward_inputs=False``):
FSDP2's default would cast all floating inputs to the compute dtype, and so round the fp32
timestep to bf16 before Wan's sinusoidal embedding (values 4 apart in [512, 1024)) and the fp32
RoPE tables before the blocks. The caller casts latents and text embeddings to the compute dtype,
as ``WanPipeline`` does (:func:`miles.dtypes.compute_dtype` tells which). Outside the blocks, the parameters
diffusers keeps in fp32 (``_keep_in_fp32_modules``: Wan's ``time_embedder`` and output
``scale_shift_table``) stay fp32 as ``from_pretrained(dtype=bf16)`` keeps them: the root unit holds
them in fp32 and every other root-level submodule is a unit of its own in the compute dtype.
Inside a block, one unit gathers in one dtype, so the block's fp32-kept ``scale_shift_table`` and
``norm2`` are computed from their bf16 cast (docs/validation.md gives the size of that difference).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.blocks import transformer_blocks
from miles.dtypes import COMPUTE_DTYPE_ATTR
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
    """Shard ``model`` (a WanTransformer3DModel, possibly SP-installed) in place over ``mesh``
    (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP).

    ``checkpoint_modes``: one activation-checkpointing mode per block (``none``, ``selective``,
    ``attention``, ``full``; see :mod:`miles.parallel.checkpointing`), applied before sharding.
    ``compile_blocks``: compile each (wrapped) block's forward (see :mod:`miles.parallel.compile`).
    """
    if checkpoint_modes is not None:
        apply_checkpointing(transformer_blocks(model), checkpoint_modes)
    if compile_blocks:
        _compile_blocks(transformer_blocks(model))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    root_mp = mp
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if keep and param_dtype is not None and param_dtype != torch.float32:
        # The root unit keeps the fp32 parameters; the rest of the root computes in param_dtype.
        root_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        for module in _compute_dtype_units(model, keep, skip=transformer_blocks(model)):
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
    setattr(model, COMPUTE_DTYPE_ATTR, param_dtype or next(model.parameters()).dtype)
    return model


def _compute_dtype_units(module: nn.Module, keep: set[str], skip: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``module`` (``skip`` aside) that own parameters and hold none that
    diffusers keeps in fp32: a parameter or module named in ``keep`` stays with the root."""

    def holds_kept(m: nn.Module) -> bool:
        return any(part in keep for name, _ in m.named_parameters() for part in name.split("."))

    units = []
    for name, child in module.named_children():
        if child is skip or name in keep or not any(True for _ in child.parameters()):
            continue
        units += _compute_dtype_units(child, keep, skip) if holds_kept(child) else [child]
    return units


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
