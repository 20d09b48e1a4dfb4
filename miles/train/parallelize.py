"""Parallelize the experts as the trainer runs them: LoRA, then attention backend → SP install →
FSDP2 (per block, then root) per expert, on meta skeletons; then each rank loads only its own
shards (:mod:`miles.models.sharded_load`). The old policy's and the reference's copies are
skeletons sharded alike, filled from the policy's local shards: no rank ever holds a whole expert.

:func:`parallelize` does the whole of it for the trainer; :func:`parallelize_expert` is its one
step on one module (attention backend → SP → FSDP2), which tests and benchmarks call on their own
models, so that every parallelized model is wrapped in the trainer's order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from miles.blocks import transformer_blocks
from miles.models.dtypes import DTYPES
from miles.models.family import FamilyModel
from miles.models.lora import lora_config
from miles.models.sharded_load import (
    RandomInit,
    WeightFiles,
    add_lora,
    build_skeleton,
    cast_frozen,
    copy_local_shards,
    materialize,
)
from miles.parallel.checkpointing import checkpoint_modes
from miles.parallel.compile import resolve_compile
from miles.parallel.fsdp import apply_fsdp
from miles.parallel.topology import ParallelMesh
from miles.sequence_parallel import apply_sequence_parallel
from miles.train.logging import print0
from miles.train.memory_budget import ALLOCATOR_SLACK, ResidentMemory, activation_budget
from miles.train.plan import RunPlan

__all__ = ["ParallelExperts", "compute_dtype", "parallelize", "parallelize_expert"]


@dataclass
class ParallelExperts:
    """The wrapped experts: the policy's (trained), the old policy's (DiffusionNFT; else empty) and
    the frozen KL reference's (a full fine-tune with a KL term; else None)."""

    policy: list[nn.Module]
    old: list[nn.Module]
    reference: list[nn.Module] | None


def compute_dtype(cfg) -> torch.dtype | None:
    """FSDP2's compute dtype for ``model.dtype`` (None: compute in fp32, as the fp32 masters)."""
    return None if cfg.model.dtype == "float32" else DTYPES[cfg.model.dtype]


def parallelize_expert(
    transformer: nn.Module,
    mesh: ParallelMesh,
    *,
    attention_backend: str | None = None,
    param_dtype: torch.dtype | None = None,
    checkpoint_modes: Sequence[str] | Callable[[nn.Module], Sequence[str]] | None = None,
    compile_blocks: bool = False,
    sp_plan=None,
    **fsdp_options,
):
    """Attention backend → SP install (the model's plan; nothing at sp = 1) → FSDP2 over
    ``mesh.fsdp_mesh``, in place; returns the SP handle. ``checkpoint_modes`` may be a function of
    the SP-installed module (the trainer calibrates its budget there). ``sp_plan``: the family's
    plan for this expert (default: the engine's, from the model's ``_cp_plan``)."""
    if attention_backend is not None:
        transformer.set_attention_backend(attention_backend)
    handle = apply_sequence_parallel(transformer, mesh, plan=sp_plan)
    if callable(checkpoint_modes):
        checkpoint_modes = checkpoint_modes(transformer)
    apply_fsdp(
        transformer,
        mesh.fsdp_mesh,
        param_dtype=param_dtype,
        checkpoint_modes=checkpoint_modes,
        compile_blocks=compile_blocks,
        **fsdp_options,
    )
    return handle


def parallelize(
    model: FamilyModel,
    plan: RunPlan,
    mesh: ParallelMesh,
    device: torch.device,
    resident: Callable[[], ResidentMemory],
    *,
    uses_old_policy: bool = False,
    uses_reference: bool = False,
) -> ParallelExperts:
    """Wrap ``model``'s experts (meta skeletons from the family's ``load(..., experts="skeleton")``) as the run
    plan says, load each rank's shards, and build the old policy's and the reference's copies.
    ``resident``: the per-rank memory terms the activation checkpointing budget fits around,
    computed once the adapters are installed (they count in the blocks FSDP gathers)."""
    # torch >= 2.12 warns on every rank that the transformer's output is a view (an in-place
    # op on it would skip FSDP2's pre-backward hook). The trainer never modifies it in place.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPWanTransformer3DModel\) returned a view"
    )
    experts = _Parallelizer(model, plan, mesh, device, resident).run(uses_old_policy, uses_reference)
    if resolve_compile(plan.cfg.model.compile, device):
        print0("[miles] torch.compile per block: the first rollout and train step include compile time")
    return experts


class _Parallelizer:
    def __init__(self, model, plan: RunPlan, mesh, device, resident: Callable[[], ResidentMemory]):
        self.model, self.plan, self.mesh, self.device = model, plan, mesh, device
        self.resident_of = resident
        self.cfg = plan.cfg
        self.compute_dtype = compute_dtype(self.cfg)
        self.compile_blocks = resolve_compile(self.cfg.model.compile, device)

    def _checkpoint_modes(self, transformer: nn.Module) -> list[str]:
        """Per-block activation checkpointing; ``budget`` calibrates one block on CUDA and fits the
        activations into what the per-rank total budget leaves after everything resident
        (:mod:`miles.train.memory_budget`), so that the peak stays within the budget."""
        cfg = self.cfg.model
        n = len(transformer_blocks(transformer))
        if cfg.activation_checkpointing != "budget":
            return checkpoint_modes(cfg.activation_checkpointing, n)
        budget = cfg.activation_memory_budget_gib * 2**30
        left = activation_budget(budget, self.resident)  # refuses a rollout that cannot fit
        if self.device.type != "cuda":
            return checkpoint_modes("selective", n)
        # The calibration's random inputs must not move the RNG the LoRA adapters are drawn from.
        with torch.random.fork_rng(devices=[self.device]):
            block_bytes = self.model.calibrate_block_memory(
                transformer,
                self.plan.shape.tokens_per_rank,
                self.device,
                batch=2 * self.cfg.train.micro_batch_size,  # CFG doubles the batch
                dtype=self.compute_dtype or torch.float32,
                compiled=self.compile_blocks,
            )
        modes = checkpoint_modes("budget", n, left, block_bytes)
        print0(
            f"[miles] activation checkpointing for a {cfg.activation_memory_budget_gib} GiB budget "
            f"({self.resident.train_fixed / 2**30:.1f} GiB resident in training, "
            f"{self.resident.rollout_peak / 2**30:.1f} GiB rollout peak, {ALLOCATOR_SLACK:.0%} slack): "
            + ", ".join(f"{m} x{modes.count(m)}" for m in dict.fromkeys(modes))
            + " (one block keeps "
            + ", ".join(f"{m} {b / 2**30:.2f}" for m, b in block_bytes.items())
            + " GiB)"
        )
        return modes

    def run(self, uses_old_policy: bool, uses_reference: bool) -> ParallelExperts:
        """LoRA, then attention backend → SP install → FSDP2 (per block, then root), per expert, on
        meta skeletons; then each rank loads only its own shards (:mod:`miles.models.sharded_load`).
        The old policy's and the reference's copies are skeletons sharded alike, filled from the
        policy's local shards: no rank ever holds a whole expert."""
        cfg = self.cfg
        trained = dict(reduce_dtype=torch.float32, reshard_after_forward=cfg.parallel.reshard_after_forward)
        adapters = []
        for transformer in self.model.transformers:
            adapters.append(self._make_trainable(transformer))
        self.resident = self.resident_of()
        for transformer in self.model.transformers:
            transformer.train()
            self._shard(transformer, checkpointing=True, **trained)
        for i, (transformer, sub) in enumerate(zip(self.model.transformers, self.model.expert_folders)):
            if cfg.model.init == "random":
                source = RandomInit(seed=cfg.run.seed, salt=sub)
            else:
                source = WeightFiles(self.model.path / sub)
            materialize(transformer, self.device, source, adapters[i])
        old = []  # the old policy's experts (DiffusionNFT), with their adapters
        if uses_old_policy:
            old = [self._sharded_copy(i, lora=True, **trained) for i in range(len(self.model.transformers))]
        # A full fine-tune with a KL term keeps a frozen copy of the initial weights, sharded alike,
        # stored in the compute dtype (the dtype FSDP2 computes it in anyway).
        reference = None
        if uses_reference and cfg.model.lora_rank == 0:
            reference = [
                self._sharded_copy(i, lora=False, dtype=self.compute_dtype).requires_grad_(False).eval()
                for i in range(len(self.model.transformers))
            ]
        return ParallelExperts(policy=list(self.model.transformers), old=old, reference=reference)

    def _sharded_copy(
        self, i: int, lora: bool, dtype: torch.dtype | None = None, **fsdp_options
    ) -> nn.Module:
        """A copy of expert ``i``: a skeleton (with the same adapters when ``lora``), sharded like the
        expert, filled with its local shards (in ``dtype``, default the expert's own dtypes)."""
        copy_ = build_skeleton(self.model.path, self.model.expert_folders[i])
        if not lora:
            copy_.requires_grad_(False)
        elif self.cfg.model.lora_rank > 0:
            with torch.random.fork_rng(devices=[]):  # the copy's adapter draw is overwritten anyway
                self._make_trainable(copy_)
        if dtype is not None:
            cast_frozen(copy_, dtype)
        self._shard(copy_, **fsdp_options)
        copy_local_shards(copy_, self.model.transformers[i])
        return copy_

    def _make_trainable(self, transformer: nn.Module) -> dict[str, torch.Tensor]:
        """Full fine-tune: every parameter trains (fp32 masters); LoRA: a frozen base, stored in the
        compute dtype, with trainable fp32 adapters. Returns the adapters' initial values (peft's
        draw, captured on the CPU while ``transformer`` is a meta skeleton)."""
        cfg = self.cfg.model
        if cfg.lora_rank == 0:
            transformer.requires_grad_(True)
            return {}
        transformer.requires_grad_(False)
        adapters = add_lora(transformer, lora_config(cfg))
        if self.compute_dtype is not None:
            cast_frozen(transformer, self.compute_dtype)
        return adapters

    def _shard(self, transformer: nn.Module, checkpointing: bool = False, **fsdp_options) -> None:
        """Attention backend → SP install → FSDP2 on one expert (``checkpointing``: with the
        configured activation checkpointing, calibrated after SP is installed)."""
        parallelize_expert(
            transformer,
            self.mesh,
            attention_backend=self.plan.attention_backend,
            param_dtype=self.compute_dtype,
            checkpoint_modes=self._checkpoint_modes if checkpointing else None,
            compile_blocks=self.compile_blocks,
            sp_plan=self.model.sequence_parallel_plan(transformer) if self.mesh.sp_size > 1 else None,
            **fsdp_options,
        )
