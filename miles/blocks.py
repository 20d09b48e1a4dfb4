"""The repeated blocks of a diffusers video transformer: what activation checkpointing, per-block
compile, FSDP's units, FP8 rollouts and the memory plan go through, whatever the family."""

from __future__ import annotations

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
