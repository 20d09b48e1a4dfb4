"""Install a plan's boundaries as forward hooks: shard the sequence in, gather it out.

Shards happen where the plan says (for Wan: the RoPE tables, the first block's
``hidden_states`` after patchify, a 2-D timestep); everything between runs on S/sp tokens;
the gather after ``proj_out`` hands the rest of the forward (unpatchify, loss) the full
sequence, bitwise identical on every sp rank. Hooks are plain ``nn.Module`` hooks, so they
survive FSDP2's ``fully_shard`` and re-run under activation-checkpoint recomputation.

Uneven lengths: every shard pads to sp·ceil(S/sp) and records S in the model's
``SequenceState`` (cleared by a pre-forward hook on the model root at each call); the gather
reads it to drop the pads, the attention to exclude pad keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.sequence_parallel.comm import gather_sequence, shard_sequence
from miles.sequence_parallel.plan import Boundary, GatherOutput, ShardInput, ShardOutput
from miles.sequence_parallel.state import SequenceState, sequence_state

__all__ = ["install_boundaries"]


def _applies(x: Any, expected_dims: int | None) -> bool:
    # Like diffusers: a tensor of another rank is left alone (e.g. Wan's 1-D timestep).
    return isinstance(x, torch.Tensor) and (expected_dims is None or x.dim() == expected_dims)


def _shard(x: torch.Tensor, dim: int, group: dist.ProcessGroup, state: SequenceState) -> torch.Tensor:
    length = x.size(dim)
    state.record(length)
    size = dist.get_world_size(group)
    if length % size != 0 and not state.attention_pads:
        raise ValueError(
            f"sequence length {length} is not divisible by the sequence-parallel size {size}, and this "
            f"model's attention installer does not exclude pad tokens (SequenceState.attention_pads is "
            f"unset; the default apply_dispatch_sp_attention sets it). Make the family installer pad-aware, "
            f"or change the video size so the number of patchified tokens is a multiple of {size}."
        )
    return shard_sequence(x, dim, group)


def _input_hook(
    module: nn.Module, specs: list[ShardInput], group: dist.ProcessGroup, state: SequenceState
) -> Callable:
    params = list(inspect.signature(module.forward).parameters)

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(args)
        for spec in specs:
            if spec.name in kwargs:
                if _applies(kwargs[spec.name], spec.expected_dims):
                    kwargs[spec.name] = _shard(kwargs[spec.name], spec.dim, group, state)
            elif spec.name in params and params.index(spec.name) < len(args):
                i = params.index(spec.name)
                if _applies(args[i], spec.expected_dims):
                    args[i] = _shard(args[i], spec.dim, group, state)
        return tuple(args), kwargs

    return hook


def _output_hook(
    specs: list[ShardOutput | GatherOutput], group: dist.ProcessGroup, state: SequenceState
) -> Callable:
    def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        for spec in specs:
            if spec.index >= len(outputs):
                raise ValueError(
                    f"sequence-parallel boundary on {type(mod).__name__} names output {spec.index}, "
                    f"but the module returned {len(outputs)} outputs"
                )
            x = outputs[spec.index]
            if not _applies(x, spec.expected_dims):
                continue
            if isinstance(spec, GatherOutput):
                outputs[spec.index] = gather_sequence(x, spec.dim, group, length=state.seq_len)
            else:
                outputs[spec.index] = _shard(x, spec.dim, group, state)
        if single:
            return outputs[0]
        return type(output)(outputs) if isinstance(output, tuple | list) else outputs

    return hook


def install_boundaries(
    model: nn.Module, boundaries: dict[str, tuple[Boundary, ...]], group: dist.ProcessGroup
) -> Callable[[], None]:
    """Register the shard/gather hooks of ``boundaries`` on ``model``; returns a function removing them."""
    state = sequence_state(model)

    def new_call(mod: nn.Module, args: tuple) -> None:
        state.seq_len = None

    # First of the root's pre-hooks, so that a root ShardInput (e.g. a 2-D timestep) records into
    # the cleared state.
    handles = [model.register_forward_pre_hook(new_call, prepend=True)]
    for path, specs in boundaries.items():
        module = model.get_submodule(path)
        inputs = [s for s in specs if isinstance(s, ShardInput)]
        outputs = [s for s in specs if isinstance(s, ShardOutput | GatherOutput)]
        if inputs:
            handles.append(
                module.register_forward_pre_hook(_input_hook(module, inputs, group, state), with_kwargs=True)
            )
        if outputs:
            handles.append(module.register_forward_hook(_output_hook(outputs, group, state)))

    def remove() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    return remove
