"""The activation-budget calibration at sp > 1 (``miles.models.wan.calibrate_block_memory``).

With SP installed, block 0 carries the boundary hook that shards the whole sequence on entry.
The calibration feeds a copy of block 0 one rank's shard (ceil(S/sp) tokens) directly, so the copy
must run without that hook: with it, the shard was sharded again and the block's attention met
RoPE tables of the unsharded length (the A14B rehearsal at sp 8 failed so: 512 vs 4095 tokens).
The CUDA measurement itself is replaced by a CPU forward + backward that records what the block saw.
"""

from __future__ import annotations

import pytest
import torch

import miles.parallel.checkpointing as checkpointing
from miles.models.wan import calibrate_block_memory
from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.sequence_parallel import apply_sequence_parallel
from tests.dist_utils import run_pooled
from tests.distributed.test_usp_model import tiny_wan

pytestmark = pytest.mark.distributed


def _body(rank, world_size):
    torch.manual_seed(0)
    model = tiny_wan("t2v")
    dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=world_size)
    apply_sequence_parallel(model, build_parallel_mesh(dims, "cpu"))
    assert model.blocks[0]._forward_pre_hooks_with_kwargs, "SP should shard the sequence at block 0"
    seen = {}

    def measure(block, make_inputs, device, compiled=False):
        hidden, context, temb, rope = make_inputs()
        out = block(hidden, context, temb, rope)
        out.sum().backward()
        seen.update(
            tokens_in=hidden.shape[1],
            tokens_out=out.shape[1],
            hooks=len(block._forward_pre_hooks_with_kwargs),
        )
        return {m: 0.0 for m in checkpointing.MODES}

    saved = checkpointing.measure_block_memory
    checkpointing.measure_block_memory = measure
    try:
        calibrate_block_memory(model, tokens=7, device=torch.device("cpu"), batch=2, dtype=torch.float32)
    finally:
        checkpointing.measure_block_memory = saved
    assert seen == dict(tokens_in=7, tokens_out=7, hooks=0), seen
    assert model.blocks[0]._forward_pre_hooks_with_kwargs, "the model's own block keeps its SP hook"


def test_calibration_feeds_one_shard_at_sp2():
    run_pooled(_body, 2)
