"""``torch.compile`` per transformer block (the step between activation checkpointing and FSDP2).

Wan's blocks spend a large share of their time outside the matmuls and attention: fp32 layer
norms, the scale/shift/gate modulation, RoPE and the casts between them, each a separate
memory-bound kernel in eager mode. Compiling each block fuses them (Inductor), and its
partitioner recomputes the cheap element-wise ops in the backward pass instead of saving their
fp32 outputs, so a compiled block also keeps less activation memory.

Only the block's ``forward`` is compiled — on the checkpoint wrapper where there is one, so that
Dynamo traces ``torch.utils.checkpoint`` and Inductor honours the selective-checkpointing policy.
FSDP2's hooks, registered on the module by ``fully_shard`` afterwards, stay eager around it.
Every block runs the same code, so one graph serves all of them (per grad mode, input shape and
checkpointing mode). With SP installed, Ulysses' all-to-all is one custom op with a registered
backward (``miles::ulysses_all_to_all``) inside the graph; ring attention runs eagerly between graphs.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch._inductor.config
from torch import nn

# Graphs per block code object: train and no-grad (rollout), per checkpointing mode, per shape.
_RECOMPILE_LIMIT = 64


def compiled(fn):
    """``fn`` compiled as a block is compiled (static shapes; enough room for every block variant)."""
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), _RECOMPILE_LIMIT))
            break
    # Round every intermediate that eager mode would round to bf16, where eager rounds it, so that
    # a value does not depend on whether Inductor fused its consumer into the same kernel: the
    # rollout's no-grad graph and training's graph (which saves some values for backward) must
    # give the same log-probabilities bit for bit (a first optimizer step with ratio exactly 1).
    torch._inductor.config.emulate_precision_casts = True
    return torch.compile(fn, dynamic=False)


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Replace each block's ``forward`` with a compiled one, in place (before ``fully_shard``)."""
    for block in blocks:
        block.forward = compiled(block.forward)


def resolve_compile(setting: str, device: torch.device) -> bool:
    """``model.compile``: ``auto`` compiles on CUDA only (a CPU run pays the compile time for little)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"model.compile must be auto, on or off, got {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")
