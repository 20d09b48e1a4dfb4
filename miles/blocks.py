"""The repeated blocks of a diffusers video transformer: what activation checkpointing, per-block
compile, FSDP's units, FP8 rollouts and the memory plan go through, whatever the family."""

from __future__ import annotations

import copy

import torch
from torch import nn

BLOCK_LISTS = (
    "blocks",
    "transformer_blocks",
)  # diffusers' names (Wan: blocks; LTX, Flux, ...: transformer_blocks)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``model``'s repeated blocks (under diffusers' attribute names)."""
    for name in BLOCK_LISTS:
        blocks = getattr(model, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    raise ValueError(
        f"{type(model).__name__} has none of the block lists {BLOCK_LISTS}: miles cannot checkpoint, "
        f"compile or shard its blocks"
    )


def calibration_block(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A detached copy of ``model``'s first block for measuring one block's memory: its hooks
    dropped (with sp > 1 block 0 carries the SP boundary hook that shards the whole sequence on
    entry, while the calibration feeds it one rank's shard directly), a meta skeleton (sharded
    loading) given arbitrary values, on ``device`` in ``dtype``, in training mode."""
    block = copy.deepcopy(transformer_blocks(model)[0])
    for hooks in (block._forward_pre_hooks, block._forward_pre_hooks_with_kwargs, block._forward_hooks):
        hooks.clear()
    if any(p.is_meta for p in block.parameters()):
        block.to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.fill_(0.01)
    return block.to(device=device, dtype=dtype).train()
