"""Public entry points: validate SP arguments at startup, install SP on a model in place.

Order in a trainer (see docs/sequence_parallel.md):

    dims = ParallelDims(world_size=W, sequence_parallel_size=sp, ulysses_degree=u)
    validate_sp_args(dims, attention_backend, model_backend)      # driver-side, at startup
    mesh = build_parallel_mesh(dims, device_type)
    model.set_attention_backend(...)                              # optional, independent of SP
    handle = apply_sequence_parallel(model, mesh)                 # in place, before FSDP
    fully_shard(..., mesh=mesh.fsdp_mesh)                         # FSDP over dp x sp
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from miles.parallel.topology import ParallelDims, ParallelMesh
from miles.sequence_parallel.boundaries import install_boundaries
from miles.sequence_parallel.plan import SequenceParallelPlan, sequence_parallel_plan
from miles.sequence_parallel.ring import RING_BACKENDS, _backend_name

__all__ = ["SequenceParallelHandle", "apply_sequence_parallel", "validate_sp_args"]


class SequenceParallelHandle:
    """What ``apply_sequence_parallel`` installed; ``remove()`` takes it out again."""

    def __init__(self, plan: SequenceParallelPlan | None, removers: list[Callable[[], None]]) -> None:
        self.plan = plan
        self._removers = removers

    @property
    def enabled(self) -> bool:
        return self.plan is not None

    def remove(self) -> None:
        """Remove the hooks and restore ``dispatch_attention_fn`` and the processors' config."""
        while self._removers:
            self._removers.pop()()


def validate_sp_args(dims: ParallelDims, attention_backend: str | None, model_backend: Any = None) -> None:
    """Driver-side checks of the SP configuration; raises ``ValueError`` naming the fix.

    ``dims`` validated itself on construction (sp >= 1, ulysses >= 0, world % sp, sp % ulysses).
    Here: a model backend that cannot provide a plan, and a ring (> 1) with an attention backend
    that has no ring kernel.
    """
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims must be a ParallelDims, got {type(dims).__name__}")
    if dims.sp == 1:
        return
    if model_backend is not None and not hasattr(model_backend, "sequence_parallel_plan"):
        raise ValueError(
            f"--sequence-parallel-size {dims.sp} needs a model backend with `sequence_parallel_plan`, and "
            f"{type(model_backend).__name__} has none. Implement it (return a SequenceParallelPlan) or run "
            f"with --sequence-parallel-size 1."
        )
    name = _backend_name(attention_backend)
    if name is not None:
        from diffusers.models.attention_dispatch import AttentionBackendName

        known = [b.value for b in AttentionBackendName]
        if name not in known:
            raise ValueError(f"unknown attention backend {name!r}; diffusers knows {known}")
    if dims.ring > 1 and name not in RING_BACKENDS:
        raise ValueError(
            f"--fsdp-attention-backend {name!r} has no ring-attention kernel, and ring degree = "
            f"sp / ulysses = {dims.sp} / {dims.ulysses} = {dims.ring} > 1. Use one of {list(RING_BACKENDS)} "
            f"(None = diffusers' default), or set --ulysses-degree {dims.sp} (ring 1, any backend) if the "
            f"head count allows it."
        )


def apply_sequence_parallel(
    model: nn.Module, mesh: ParallelMesh, plan: SequenceParallelPlan | None = None
) -> SequenceParallelHandle:
    """Install USP sequence parallelism on ``model`` in place, before FSDP wrapping.

    ``plan`` defaults to :func:`sequence_parallel_plan` (the family's ``_miles_sp_plan`` or the
    one from the model's diffusers ``_cp_plan``). With sp == 1 nothing is installed and the
    model is bitwise unchanged. Collective-free: the groups come from ``mesh``.
    """
    if mesh.sp_size == 1:
        return SequenceParallelHandle(None, [])
    plan = plan if plan is not None else sequence_parallel_plan(model)
    u = mesh.dims.ulysses
    if plan.num_attention_heads % u != 0:
        valid = [
            d
            for d in range(1, mesh.sp_size + 1)
            if mesh.sp_size % d == 0 and plan.num_attention_heads % d == 0
        ]
        raise ValueError(
            f"{plan.num_attention_heads} attention heads are not divisible by --ulysses-degree {u}; "
            f"choose one of {valid} (ring takes the rest of sp = {mesh.sp_size}), or 0 for auto."
        )
    removers = [install_boundaries(model, plan.boundaries, mesh.sp_group)]
    try:
        removers.append(plan.attention_installer(model, mesh.ulysses_group, mesh.ring_group))
    except BaseException:
        removers.pop()()
        raise
    return SequenceParallelHandle(plan, removers)
