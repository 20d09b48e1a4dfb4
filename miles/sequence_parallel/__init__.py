"""USP sequence parallelism (Ulysses x Ring) for diffusers video transformers.

One sample's token sequence is sharded over the ``sp`` ranks of an sp group: boundaries from
the model's plan shard it after patchify and gather it after ``proj_out``; self-attention
runs as Ulysses all-to-all x ring attention; everything else is token-local. Usable on its
own, without the trainer::

    from miles.parallel.topology import ParallelDims, build_parallel_mesh
    from miles.sequence_parallel import apply_sequence_parallel, validate_sp_args

    dims = ParallelDims(world_size=4, sequence_parallel_size=4, ulysses_degree=2)
    validate_sp_args(dims, attention_backend=None)
    mesh = build_parallel_mesh(dims, device_type="cuda")
    handle = apply_sequence_parallel(transformer, mesh)   # in place; sp == 1 is a no-op
    ...
    handle.remove()

Any token count works: a length that sp does not divide is padded at the end and the pads
are excluded from attention and dropped by the gather (docs/sequence_parallel.md, "Uneven
lengths"). User docs, numerics and the failure table: docs/sequence_parallel.md.
"""

from miles.sequence_parallel.apply import SequenceParallelHandle, apply_sequence_parallel, validate_sp_args
from miles.sequence_parallel.attention import apply_dispatch_sp_attention, usp_attention
from miles.sequence_parallel.comm import gather_sequence, shard_sequence
from miles.sequence_parallel.plan import (
    GatherOutput,
    SequenceParallelPlan,
    ShardInput,
    ShardOutput,
    plan_from_cp_plan,
    sequence_parallel_plan,
)
from miles.sequence_parallel.ring import RING_BACKENDS, RING_KERNELS, RingKernel, ring_attention
from miles.sequence_parallel.state import SequenceState, sequence_state

__all__ = [
    "RING_BACKENDS",
    "RING_KERNELS",
    "GatherOutput",
    "RingKernel",
    "SequenceParallelHandle",
    "SequenceParallelPlan",
    "SequenceState",
    "ShardInput",
    "ShardOutput",
    "apply_dispatch_sp_attention",
    "apply_sequence_parallel",
    "gather_sequence",
    "plan_from_cp_plan",
    "ring_attention",
    "sequence_parallel_plan",
    "sequence_state",
    "shard_sequence",
    "usp_attention",
    "validate_sp_args",
]
