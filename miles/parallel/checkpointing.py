"""Activation checkpointing per transformer block: none, selective, attention, full — or a budget.

Four ways to run a block in training, from most memory and least recompute to the reverse:

- ``none``: keep every activation;
- ``selective``: keep the outputs of matmuls and attention, recompute everything else in the
  backward pass. Wan's blocks spend most of their activation memory on fp32 element-wise
  temporaries (norms, modulation, gates, RoPE) that are cheap to recompute, while the matmuls
  and attention — nearly all the FLOPs — are never recomputed;
- ``attention``: keep only the attention outputs and recompute the linear layers too. At video
  lengths attention is most of a block's FLOPs (~70% at 32k tokens for Wan2.1-1.3B), so this
  recomputes ~30% of a forward for ~1/10 of the memory of ``none``;
- ``full``: keep only the block's input and recompute the whole block (+1 forward).

``budget`` picks a mode per block from a memory budget: blocks are downgraded one step at a
time (none → selective → attention → full) until the estimated activation memory fits. The
per-block costs come from :func:`measure_block_memory` (a calibration forward of one block at
the real sequence length on CUDA) or from the caller.

The wrapping happens before FSDP2's ``fully_shard`` (torchtitan's order) so that each block's
recompute re-gathers its own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "selective", "attention", "full")

# What selective checkpointing keeps: matmul and attention outputs (the expensive ops).
_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.convolution.default,
}


ATTENTION_OPS = {op for op in SAVE_OPS if "attention" in str(op)}


def _policy(save_ops: set):
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context():
    return create_selective_checkpoint_contexts(_policy(SAVE_OPS))


def _attention_context():
    return create_selective_checkpoint_contexts(_policy(ATTENTION_OPS))


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    """Return ``block`` wrapped for ``mode`` (``none`` returns it unchanged)."""
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        return checkpoint_wrapper(block, context_fn=_selective_context, preserve_rng_state=False)
    if mode == "attention":
        return checkpoint_wrapper(block, context_fn=_attention_context, preserve_rng_state=False)
    raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {MODES}")


def plan_modes(num_blocks: int, block_bytes: dict[str, float], budget_bytes: float) -> list[str]:
    """Per-block modes whose activation memory fits ``budget_bytes``, recomputing least.

    ``block_bytes[mode]`` is one block's activation memory in that mode. Every block costs the
    same, so which blocks are downgraded does not change the total; the last ones go first.
    While a checkpointed block is recomputed in the backward pass its full activations exist
    for a moment, so one block's ``none`` cost is added once any block is checkpointed.
    """

    def need(modes: list[str]) -> float:
        transient = block_bytes["none"] if any(m != "none" for m in modes) else 0.0
        return sum(block_bytes[m] for m in modes) + transient

    modes = ["none"] * num_blocks
    for src, dst in zip(MODES, MODES[1:]):
        for i in reversed(range(num_blocks)):
            if need(modes) <= budget_bytes:
                return modes
            if modes[i] == src:
                modes[i] = dst
    if need(modes) > budget_bytes:
        raise ValueError(
            f"activations need {need(modes) / 2**30:.1f} GiB even with every block fully checkpointed, "
            f"over the budget of {budget_bytes / 2**30:.1f} GiB: raise model.activation_memory_budget_gib, "
            "use more sequence parallelism, or shorten the video"
        )
    return modes


def apply_checkpointing(blocks: nn.ModuleList, modes: Sequence[str]) -> list[str]:
    """Wrap ``blocks`` in place with per-block ``modes``; returns the modes."""
    if len(modes) != len(blocks):
        raise ValueError(f"{len(modes)} modes for {len(blocks)} blocks")
    for i, mode in enumerate(modes):
        blocks[i] = wrap_block(blocks[i], mode)
    return list(modes)


def measure_block_memory(
    block: nn.Module, make_inputs, device: torch.device, compiled: bool = False
) -> dict[str, float]:
    """Activation bytes one block keeps for backward, per mode, measured on CUDA.

    ``make_inputs()`` returns the block's positional inputs (requiring grad where training
    would). Memory kept after forward minus before, with the block's params already resident,
    the block's output included: in the model it is the next block's input, which that block
    keeps (every checkpointed mode saves its input), and the calibration's own input was
    allocated before the measurement. (Leaving it out under-counted 30 checkpointed 1.3B blocks
    at 81x480x832 by ~6 GiB: a 100 GiB budget peaked at 100.8.)
    One untimed forward and backward per mode comes first (compilation, first-use workspaces).
    ``compiled``: measure the block as :func:`miles.parallel.compile.compile_blocks` runs it
    (Inductor saves fewer element-wise outputs than eager mode).
    """
    from miles.parallel.compile import compiled as compile_fn

    out: dict[str, float] = {}
    for mode in MODES:
        wrapped = wrap_block(block, mode)
        forward = compile_fn(wrapped.forward) if compiled else wrapped
        inputs = make_inputs()
        # Outside the measured window: the compile, and a first call's one-time allocations (the
        # first matmul's 32 MiB cuBLAS workspace was counted as one block's: n blocks, n times).
        forward(*make_inputs()).sum().backward()
        block.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        y = forward(*inputs)
        torch.cuda.synchronize(device)
        out[mode] = float(torch.cuda.memory_allocated(device) - before)
        del y, inputs
    return out


def measure_first_block_memory(
    model: nn.Module, make_inputs, device: torch.device, dtype: torch.dtype, compiled: bool = False
) -> dict[str, float]:
    """:func:`measure_block_memory` of a ``dtype`` copy of ``model``'s first block
    (:func:`miles.blocks.calibration_block`), freed afterwards: what each family's block calibration
    runs on the inputs it shapes (``make_inputs``)."""
    from miles.blocks import calibration_block

    block = calibration_block(model, device, dtype)
    try:
        return measure_block_memory(block, make_inputs, device, compiled=compiled)
    finally:
        del block
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fixed_training_bytes(
    num_params: int, num_trainable: int, world_size: int, block_params: int, other_bytes: float = 0.0
) -> float:
    """Per-rank memory that is not activations: FSDP2-sharded fp32 weights, gradients and AdamW
    moments, two bf16 blocks gathered at a time (the current one and the prefetched next), and
    ``other_bytes`` (frozen text encoder, VAE, reward models)."""
    sharded = (4 * num_params + (4 + 8) * num_trainable) / world_size
    return sharded + 2 * 2 * block_params + other_bytes


def checkpoint_modes(
    mode: str,
    num_blocks: int,
    activation_budget_bytes: float | None = None,
    block_bytes: dict[str, float] | None = None,
) -> list[str]:
    """The per-block modes for a config value: one mode for all, or ``budget``."""
    if mode in MODES:
        return [mode] * num_blocks
    if mode != "budget":
        raise ValueError(f"unknown activation checkpointing {mode!r}; choose one of {(*MODES, 'budget')}")
    if activation_budget_bytes is None or block_bytes is None:
        raise ValueError("activation_checkpointing 'budget' needs a memory budget and per-block costs")
    if activation_budget_bytes <= 0:
        raise ValueError(
            "the memory budget is spent before any activation (weights, gradients and optimizer state "
            "per rank exceed it): raise model.activation_memory_budget_gib or shard over more ranks"
        )
    return plan_modes(num_blocks, block_bytes, activation_budget_bytes)
