"""The SP failure table (docs/sequence_parallel.md), one test per row, plus install/remove wiring.

Rows that need a real sp group of size > 1 (a length sp does not divide with a family attention
installer that does not exclude pads) live in tests/distributed/test_usp_model.py; everything
else runs in one process. S % sp != 0 itself is no longer a failure: it is padded
(tests/distributed/test_usp_uneven.py).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.parallel.topology import ParallelDims
from miles.sequence_parallel import (
    RING_BACKENDS,
    SequenceParallelPlan,
    apply_dispatch_sp_attention,
    apply_sequence_parallel,
    plan_from_cp_plan,
    ring_attention,
    sequence_parallel_plan,
    validate_sp_args,
)
from miles.sequence_parallel.attention import _USPDispatchConfig, find_dispatch_module
from miles.sequence_parallel.plan import GatherOutput, ShardInput, ShardOutput
from miles.sequence_parallel.ring import _TEMPLATES_MODULE
from miles.sequence_parallel.state import sequence_state
from tests.models import TINY_WAN


def tiny_wan(**overrides):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    config = dict(TINY_WAN)
    config.update(overrides)
    return WanTransformer3DModel(**config)


def _fake_mesh(world: int, sp: int, u: int) -> SimpleNamespace:
    dims = ParallelDims(world_size=world, sequence_parallel_size=sp, ulysses_degree=u)
    return SimpleNamespace(dims=dims, sp_size=dims.sp)


# --- row: sp < 1, ulysses < 0, world % sp, sp % ulysses -> topology validation (tests/unit/test_topology.py
# covers the messages in detail; one smoke check here keeps the table complete in this file)
def test_row_topology_validation():
    for kwargs in [
        dict(world_size=4, sequence_parallel_size=0),
        dict(world_size=4, sequence_parallel_size=2, ulysses_degree=-1),
        dict(world_size=6, sequence_parallel_size=4),
        dict(world_size=4, sequence_parallel_size=4, ulysses_degree=3),
    ]:
        with pytest.raises(ValueError):
            ParallelDims(**kwargs)


# --- row: num_attention_heads % ulysses -> apply_sequence_parallel
def test_row_heads_not_divisible_by_ulysses():
    model = tiny_wan(num_attention_heads=3)
    with pytest.raises(
        ValueError, match=r"3 attention heads are not divisible by --ulysses-degree 2; choose one of \[1\]"
    ):
        apply_sequence_parallel(model, _fake_mesh(2, 2, 2))
    assert find_dispatch_module(model).dispatch_attention_fn.__name__ == "dispatch_attention_fn"
    assert not hasattr(find_dispatch_module(model).dispatch_attention_fn, "__miles_usp_original__")


# --- row: one model call shards two different lengths (a plan mixing lengths, or an activation-
# checkpointed block recomputed after a forward with another video size) -> the shard hook
def test_row_sequence_length_changes_within_a_call():
    model = tiny_wan()
    state = sequence_state(model)
    assert sequence_state(model) is state and sequence_state(tiny_wan()) is not state  # one per model
    state.record(37)
    state.record(37)
    with pytest.raises(ValueError, match="already sharded 37 tokens.*activation checkpointing"):
        state.record(40)


def test_pad_aware_flag_follows_the_attention_install():
    model = tiny_wan()
    remove = apply_dispatch_sp_attention(model, None, None)
    marker = model.blocks[0].attn1.processor._parallel_config
    assert marker.state is sequence_state(model) and marker.state.attention_pads
    remove()
    assert not sequence_state(model).attention_pads


# --- row: ring > 1 without torch's ring templates -> ModuleNotFoundError at the first ring call
def test_row_missing_ring_templates(monkeypatch):
    monkeypatch.setitem(sys.modules, _TEMPLATES_MODULE, None)  # makes the import raise ModuleNotFoundError
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ModuleNotFoundError, match="torch 2.11.*--ulysses-degree"):
        ring_attention(q, q, q, group=None)


def test_row_ring_templates_without_the_functions(monkeypatch):
    monkeypatch.setitem(sys.modules, _TEMPLATES_MODULE, types.ModuleType(_TEMPLATES_MODULE))
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ImportError, match="_templated_ring_attention"):
        ring_attention(q, q, q, group=None)


# --- row: ring > 1 with a backend outside RING_KERNELS -> validate_sp_args
@pytest.mark.parametrize("backend", ["_native_efficient", "_native_math", "flash", "sage", "flex"])
def test_row_unsupported_ring_backend(backend):
    dims = ParallelDims(world_size=4, sequence_parallel_size=4, ulysses_degree=2)
    with pytest.raises(ValueError, match=r"no ring-attention kernel.*'_native_flash', '_native_cudnn'"):
        validate_sp_args(dims, backend)
    # ring == 1 accepts any backend: the local attention is the ordinary dispatch
    validate_sp_args(ParallelDims(world_size=4, sequence_parallel_size=4, ulysses_degree=4), backend)


@pytest.mark.parametrize("backend", RING_BACKENDS)
def test_supported_ring_backends_pass(backend):
    validate_sp_args(ParallelDims(world_size=4, sequence_parallel_size=4, ulysses_degree=1), backend)


def test_unknown_backend_name_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        validate_sp_args(ParallelDims(world_size=2, sequence_parallel_size=2), "nope")


def test_ring_attention_rejects_unsupported_backend_at_call_time():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="has no ring kernel"):
        ring_attention(q, q, q, group=None, backend="_native_math")


# --- row: modeling module without dispatch_attention_fn and no family plan -> apply_dispatch_sp_attention
class _ModelWithoutDispatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_row_module_without_dispatch_attention_fn():
    with pytest.raises(ValueError, match="defines dispatch_attention_fn.*_miles_sp_plan"):
        apply_dispatch_sp_attention(_ModelWithoutDispatch(), None, None)


def test_install_refuses_model_without_processors(monkeypatch):
    # A module that has dispatch_attention_fn but no processor that could carry the marker
    # would silently attend only to the local chunk: refuse.
    monkeypatch.setattr(sys.modules[__name__], "dispatch_attention_fn", lambda *a, **k: None, raising=False)
    with pytest.raises(ValueError, match="no attention processor"):
        apply_dispatch_sp_attention(_ModelWithoutDispatch(), None, None)


# --- row: model backend without sequence_parallel_plan -> validate_sp_args
def test_row_model_backend_without_plan():
    dims = ParallelDims(world_size=2, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="needs a model backend with `sequence_parallel_plan`"):
        validate_sp_args(dims, None, model_backend=object())
    validate_sp_args(dims, None, model_backend=SimpleNamespace(sequence_parallel_plan=lambda model: None))
    validate_sp_args(ParallelDims(world_size=2, sequence_parallel_size=1), None, model_backend=object())


# --- row: model without _cp_plan, or wildcard plan keys -> plan construction
def test_row_model_without_cp_plan():
    with pytest.raises(ValueError, match="has no diffusers `_cp_plan`"):
        plan_from_cp_plan(_ModelWithoutDispatch())
    with pytest.raises(ValueError, match="has no diffusers `_cp_plan`"):
        sequence_parallel_plan(_ModelWithoutDispatch())


def test_row_wildcard_cp_plan_keys():
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    model = tiny_wan()
    model._cp_plan = {
        "blocks.*": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    with pytest.raises(ValueError, match=r"wildcard keys \['blocks.\*'\]"):
        plan_from_cp_plan(model)


# --- row: attn mask / dropout / is_causal / explicit scale on self-attention under SP -> wrapped dispatch
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)), "an attention mask"),
        (dict(dropout_p=0.1), "dropout_p=0.1"),
        (dict(is_causal=True), "is_causal=True"),
        (dict(scale=0.5), "explicit scale=0.5"),
    ],
)
def test_row_unsupported_self_attention_args(kwargs, match):
    model = tiny_wan()
    remove = apply_dispatch_sp_attention(model, None, None)
    try:
        module = find_dispatch_module(model)
        marker = model.blocks[0].attn1.processor._parallel_config
        assert isinstance(marker, _USPDispatchConfig)
        q = torch.randn(1, 8, 4, 16)
        with pytest.raises(ValueError, match=match):
            module.dispatch_attention_fn(q, q, q, parallel_config=marker, **kwargs)
        # the same arguments without the marker (cross-attention, other models) pass through
        module.dispatch_attention_fn(q, q, q, parallel_config=None, **kwargs)
    finally:
        remove()


# --- wiring: default plan, family plan, install/remove, MRO lookup, sp == 1 no-op
def test_default_plan_from_wan_cp_plan():
    plan = sequence_parallel_plan(tiny_wan())
    assert plan.num_attention_heads == 4
    assert plan.attention_installer is apply_dispatch_sp_attention
    assert plan.boundaries == {
        "rope": (ShardOutput(0, 1, 4), ShardOutput(1, 1, 4)),
        "blocks.0": (ShardInput("hidden_states", 1, 3),),
        "proj_out": (GatherOutput(0, 1, 3),),
        "": (ShardInput("timestep", 1, 2),),
    }


def test_family_plan_takes_precedence():
    model = _ModelWithoutDispatch()
    plan = SequenceParallelPlan(
        boundaries={"proj": (ShardInput("input", 1), GatherOutput(0, 1))},
        attention_installer=lambda m, u, r: lambda: None,
        num_attention_heads=2,
    )
    model._miles_sp_plan = plan
    assert sequence_parallel_plan(model) is plan
    model._miles_sp_plan = "not a plan"
    with pytest.raises(TypeError, match="must be a SequenceParallelPlan"):
        sequence_parallel_plan(model)


def test_install_and_remove_restore_dispatch_and_processors():
    model, other = tiny_wan(), tiny_wan()
    module = find_dispatch_module(model)
    original = module.dispatch_attention_fn
    remove_a = apply_dispatch_sp_attention(model, None, None)
    remove_b = apply_dispatch_sp_attention(other, None, None)  # two experts share the module global
    wrapped = module.dispatch_attention_fn
    assert wrapped is not original and wrapped.__miles_usp_original__ is original
    procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert procs and all(isinstance(p._parallel_config, _USPDispatchConfig) for p in procs)
    remove_a()
    assert module.dispatch_attention_fn is wrapped  # still used by `other`
    assert all(p._parallel_config is None and "_parallel_config" not in vars(p) for p in procs)
    remove_b()
    remove_b()  # idempotent
    assert module.dispatch_attention_fn is original


def test_dispatch_found_through_mro_after_class_swap():
    # FSDP2 swaps the class to a dynamically created FSDP<Name> defined in torch's module.
    model = tiny_wan()
    swapped = type("FSDPWanTransformer3DModel", (type(model),), {"__module__": "torch.distributed.fsdp"})
    model.__class__ = swapped
    assert find_dispatch_module(model).__name__ == "diffusers.models.transformers.transformer_wan"


def test_marked_local_attention_is_bitwise_the_stock_forward():
    """With groups of size 1 the marker path runs the original dispatch: bitwise the stock model."""
    model = tiny_wan()
    g = torch.Generator().manual_seed(3)
    x, ehs = torch.randn(1, 4, 2, 8, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    t = torch.tensor([500])
    ref = model(x, t, ehs, return_dict=False)[0]
    remove = apply_dispatch_sp_attention(model, None, None)
    try:
        out = model(x, t, ehs, return_dict=False)[0]
    finally:
        remove()
    assert torch.equal(out, ref)


def test_sp1_is_a_noop():
    model = tiny_wan()
    module = find_dispatch_module(model)
    original = module.dispatch_attention_fn
    handle = apply_sequence_parallel(model, _fake_mesh(4, 1, 0))
    assert not handle.enabled
    assert module.dispatch_attention_fn is original
    assert all(
        p._parallel_config is None for p in (m.processor for m in model.modules() if hasattr(m, "processor"))
    )
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    handle.remove()
