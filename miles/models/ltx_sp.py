"""LTX-Video's sequence-parallel plan and block memory calibration.

Diffusers' ``LTXVideoTransformer3DModel._cp_plan`` splits the root's ``hidden_states``, the two
RoPE tables and gathers ``proj_out``, as miles needs, but it also splits the text
(``encoder_hidden_states``) and its mask across ranks, for diffusers' own attention backends that
all-to-all the cross-attention too. The LTX processor forwards its ``_parallel_config`` in both
attentions, so the default installer would put USP (which takes no mask) into the masked
cross-attention. The family plan therefore:

- shards the root's ``hidden_states`` (the packed tokens, dim 1) and both RoPE outputs (dim 1);
  the text and its mask stay whole on every rank (each rank's queries attend to the whole text,
  exactly as at sp = 1);
- installs USP in the self-attention only (``attn1``): ``apply_dispatch_sp_attention(only="attn1")``,
  pad-aware, so a token count sp does not divide is padded;
- gathers ``proj_out``'s output (dim 1).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from miles.sequence_parallel import GatherOutput, SequenceParallelPlan, ShardInput, ShardOutput
from miles.sequence_parallel.attention import apply_dispatch_sp_attention


def ltx_sequence_parallel_plan(transformer: nn.Module) -> SequenceParallelPlan:
    """The SP plan of an ``LTXVideoTransformer3DModel`` (module docstring)."""
    return SequenceParallelPlan(
        boundaries={
            "": (ShardInput("hidden_states", dim=1, expected_dims=3),),
            "rope": (ShardOutput(0, dim=1, expected_dims=3), ShardOutput(1, dim=1, expected_dims=3)),
            "proj_out": (GatherOutput(0, dim=1, expected_dims=3),),
        },
        attention_installer=functools.partial(apply_dispatch_sp_attention, only="attn1"),
        num_attention_heads=int(transformer.config.num_attention_heads),
        source="miles.models.ltx_sp (LTX-Video's family plan: text whole, USP in attn1)",
    )


def calibrate_ltx_block_memory(
    transformer: nn.Module,
    tokens: int,
    device: torch.device,
    batch: int = 2,
    dtype=torch.bfloat16,
    compiled: bool = False,
    text_tokens: int = 128,
) -> dict[str, float]:
    """Activation bytes one LTX block keeps for backward in each checkpointing mode, measured at
    ``batch`` x ``tokens`` on a ``dtype`` copy of block 0 (as :func:`miles.models.wan.calibrate_block_memory`
    does for Wan): inputs shaped as the model passes them (timestep embedding (B, 1, 6·D), RoPE
    tables (B, S, D) in fp32, the text projected to D with its additive mask (B, 1, L))."""
    from miles.parallel.checkpointing import measure_first_block_memory

    cfg = transformer.config
    dim = cfg.num_attention_heads * cfg.attention_head_dim

    def make_inputs():
        hidden = torch.randn(batch, tokens, dim, device=device, dtype=dtype, requires_grad=True)
        context = torch.randn(batch, text_tokens, dim, device=device, dtype=dtype)
        temb = torch.randn(batch, 1, 6 * dim, device=device, dtype=dtype)
        rope = torch.randn(batch, tokens, dim, device=device, dtype=torch.float32)
        mask = torch.zeros(batch, 1, text_tokens, device=device, dtype=dtype)
        return hidden, context, temb, (rope, rope), mask

    return measure_first_block_memory(transformer, make_inputs, device, dtype, compiled=compiled)
