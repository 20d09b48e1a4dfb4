"""SequenceParallelPlan: what a model family declares so that SP can be installed on it.

A plan has three parts:

- ``boundaries``: module path -> where the sequence is sharded (an input before the module
  runs, or an output after it) and where it is gathered back (an output);
- ``attention_installer(model, ulysses_group, ring_group) -> remove``: puts USP
  self-attention into the model; the default is ``apply_dispatch_sp_attention``. An installer
  whose attention excludes pad keys (reading ``sequence_state(model).seq_len``) sets
  ``sequence_state(model).attention_pads = True``; without it a token count that sp does not
  divide raises at the first shard;
- ``num_attention_heads``: checked against the Ulysses degree.

``sequence_parallel_plan(model)`` returns the plan a family pre-attached as
``model._miles_sp_plan``, else assembles the default from the model's diffusers ``_cp_plan``.
For Wan (diffusers 0.42) that is: split both ``rope`` outputs (dim 1), split ``blocks.0``'s
``hidden_states`` input (dim 1, after patchify), split the root's ``timestep`` when it is
2-D (Wan2.2 TI2V per-token timesteps; 1-D timesteps are left alone by ``expected_dims``),
and gather ``proj_out``'s output (dim 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from miles.sequence_parallel.attention import apply_dispatch_sp_attention

__all__ = [
    "GatherOutput",
    "SequenceParallelPlan",
    "ShardInput",
    "ShardOutput",
    "plan_from_cp_plan",
    "sequence_parallel_plan",
]

FAMILY_PLAN_ATTR = "_miles_sp_plan"


@dataclass(frozen=True)
class ShardInput:
    """Keep this rank's chunk of the forward argument ``name`` (by keyword or position)."""

    name: str
    dim: int
    expected_dims: int | None = None


@dataclass(frozen=True)
class ShardOutput:
    """Keep this rank's chunk of output ``index`` (0 for a single-tensor output)."""

    index: int
    dim: int
    expected_dims: int | None = None


@dataclass(frozen=True)
class GatherOutput:
    """All-gather output ``index`` over the sp group (backward: SUM over sp, local slice)."""

    index: int
    dim: int
    expected_dims: int | None = None


Boundary = ShardInput | ShardOutput | GatherOutput
AttentionInstaller = Callable[
    [nn.Module, "dist.ProcessGroup | None", "dist.ProcessGroup | None"], Callable[[], None]
]


@dataclass(frozen=True)
class SequenceParallelPlan:
    """How to install sequence parallelism on one model (see the module docstring)."""

    boundaries: dict[str, tuple[Boundary, ...]]
    attention_installer: AttentionInstaller
    num_attention_heads: int
    source: str = "a family plan"  # where the plan comes from (the dry run reports it)

    def __post_init__(self) -> None:
        if self.num_attention_heads < 1:
            raise ValueError(f"num_attention_heads must be >= 1, got {self.num_attention_heads}")
        if not any(isinstance(b, GatherOutput) for specs in self.boundaries.values() for b in specs):
            raise ValueError("a sequence-parallel plan needs at least one GatherOutput boundary")
        if not any(
            isinstance(b, ShardInput | ShardOutput) for specs in self.boundaries.values() for b in specs
        ):
            raise ValueError("a sequence-parallel plan needs at least one ShardInput/ShardOutput boundary")


def _convert_entry(path: str, entry: Any) -> tuple[Boundary, ...]:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    if isinstance(entry, ContextParallelOutput | list | tuple):
        outputs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
        specs: list[Boundary] = []
        for i, cpo in enumerate(outputs):
            if cpo is None:
                continue
            if not isinstance(cpo, ContextParallelOutput):
                raise ValueError(f"_cp_plan[{path!r}]: expected ContextParallelOutput entries, got {cpo!r}")
            specs.append(GatherOutput(index=i, dim=cpo.gather_dim, expected_dims=cpo.expected_dims))
        return tuple(specs)
    if isinstance(entry, dict):
        specs = []
        for key, cpi in entry.items():
            if not isinstance(cpi, ContextParallelInput):
                raise ValueError(
                    f"_cp_plan[{path!r}][{key!r}] = {cpi!r} is not supported by the miles SP installer "
                    f"(only single ContextParallelInput entries); attach a family plan (model.{FAMILY_PLAN_ATTR})."
                )
            if isinstance(key, int):
                if not cpi.split_output:
                    raise ValueError(f"_cp_plan[{path!r}][{key}]: integer keys need split_output=True")
                specs.append(ShardOutput(index=key, dim=cpi.split_dim, expected_dims=cpi.expected_dims))
            elif cpi.split_output:
                raise ValueError(
                    f"_cp_plan[{path!r}][{key!r}]: split_output=True needs an integer output index"
                )
            else:
                specs.append(ShardInput(name=key, dim=cpi.split_dim, expected_dims=cpi.expected_dims))
        return tuple(specs)
    raise ValueError(f"_cp_plan[{path!r}] has an unsupported entry {entry!r}")


def plan_from_cp_plan(model: nn.Module) -> SequenceParallelPlan:
    """The default plan: boundaries from ``model._cp_plan``, attention via ``dispatch_attention_fn``."""
    name = type(model).__name__
    cp_plan = getattr(model, "_cp_plan", None)
    if not cp_plan:
        raise ValueError(
            f"{name} has no diffusers `_cp_plan`, so the sequence boundaries (where to shard and where to "
            f"gather) are unknown. Attach a family plan (model.{FAMILY_PLAN_ATTR} = SequenceParallelPlan(...)) "
            f"or run with --sequence-parallel-size 1."
        )
    wildcards = [path for path in cp_plan if "*" in path]
    if wildcards:
        raise ValueError(
            f"{name}._cp_plan uses wildcard keys {wildcards}, which the miles SP installer does not expand; "
            f"attach a family plan (model.{FAMILY_PLAN_ATTR}) with explicit module paths."
        )
    boundaries: dict[str, tuple[Boundary, ...]] = {}
    for path, entry in cp_plan.items():
        try:
            model.get_submodule(path)
        except AttributeError as e:
            raise ValueError(f"{name}._cp_plan names module {path!r}, which the model does not have") from e
        boundaries[path] = _convert_entry(path, entry)
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is None:
        raise ValueError(
            f"{name} has no config.num_attention_heads; attach a family plan (model.{FAMILY_PLAN_ATTR}) "
            f"that states num_attention_heads."
        )
    return SequenceParallelPlan(
        boundaries=boundaries,
        attention_installer=apply_dispatch_sp_attention,
        num_attention_heads=int(heads),
        source=f"{name}._cp_plan",
    )


def sequence_parallel_plan(model: nn.Module) -> SequenceParallelPlan:
    """The family's pre-attached plan (``model._miles_sp_plan``) if present, else the default one."""
    plan = getattr(model, FAMILY_PLAN_ATTR, None)
    if plan is not None:
        if not isinstance(plan, SequenceParallelPlan):
            raise TypeError(
                f"model.{FAMILY_PLAN_ATTR} must be a SequenceParallelPlan, got {type(plan).__name__}"
            )
        return plan
    return plan_from_cp_plan(model)
