"""Model-level parity: a tiny diffusers video transformer of each model family (Wan; LTX-Video,
``variant`` ``ltx``, with its family plan) with SP installed vs without.

Every rank builds the same model (seeded) and the same random inputs (fixed seeds), runs the stock
model on the full sequence as reference, then a deep copy with SP installed. Loss =
sum(output * w) with a fixed random w, identical on all ranks.

Gradient identity under test: the gather after proj_out sums the output gradient over the
sp group, so each rank's parameter gradient is sp x its share of the full gradient; the mean
over the sp group of the SP gradients equals the reference gradient:

    (1/sp) · Σ_sp g_sp-rank  ==  g_ref          (sp a power of two: the division is exact)

FSDP's mean over dp x sp then gives (1/dp) · Σ_dp g. Tolerances:
- outputs: Ulysses (ring = 1) bitwise; ring bands max|diff| / max|ref| <= 1e-5 (fp32).
- weight gradients: any band, per tensor max|diff| <= 5e-5 · (max|ref| + 1e-2 · largest max|ref|)
  (fp32): dW = xᵀ·dy sums over the token axis, which SP splits, so the summation order changes.
- outputs are bitwise identical on every sp rank; deterministic double runs are bitwise.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.sequence_parallel import apply_sequence_parallel, sequence_parallel_plan
from miles.sequence_parallel.attention import find_dispatch_module
from tests.dist_utils import FIXED_SEEDS, run_pooled
from tests.models import TINY_LTX, TINY_WAN

pytestmark = pytest.mark.distributed

OUT_RING_TOL = 1e-5
GRAD_TOL = 5e-5


def tiny_wan(variant: str):
    """The tiny transformer of ``variant``: Wan (``t2v``, ``i2v``, ``ts2d``) or LTX-Video (``ltx``)."""
    from diffusers import LTXVideoTransformer3DModel, WanTransformer3DModel

    if variant == "ltx":
        return LTXVideoTransformer3DModel(**TINY_LTX)
    config = dict(TINY_WAN)
    if variant == "i2v":
        config.update(image_dim=24, added_kv_proj_dim=64)
    return WanTransformer3DModel(**config)


def sp_plan(model):
    """The family's SP plan of ``model`` (LTX-Video's :mod:`miles.models.ltx_sp`), else None: the
    engine's default from ``_cp_plan`` (Wan)."""
    from diffusers import LTXVideoTransformer3DModel

    from miles.models.ltx_sp import ltx_sequence_parallel_plan

    return ltx_sequence_parallel_plan(model) if isinstance(model, LTXVideoTransformer3DModel) else None


def ltx_inputs(seed: int, frames: int, height: int, width: int, text_tokens: int = 8):
    """Inputs as ``LTXPipeline`` passes them: packed tokens, the text with its mask (the last 3
    tokens padding), the RoPE grid's size and interpolation scale; and a fixed output weight."""
    g = torch.Generator().manual_seed(seed)
    tokens = frames * height * width
    mask = torch.ones(1, text_tokens, dtype=torch.bool)
    mask[:, -3:] = False
    inputs = dict(
        hidden_states=torch.randn(1, tokens, TINY_LTX["in_channels"], generator=g),
        timestep=torch.rand(1, generator=g) * 1000,
        encoder_hidden_states=torch.randn(1, text_tokens, TINY_LTX["caption_channels"], generator=g),
        encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
    )
    return inputs, torch.randn(1, tokens, TINY_LTX["out_channels"], generator=g), tokens


def make_inputs(variant: str, seed: int, frames: int = 2, size: int = 8):
    if variant == "ltx":
        return ltx_inputs(seed, frames, size // 2, size // 2)[:2]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, frames, size, size, generator=g)
    num_tokens = frames * (size // 2) ** 2
    # Wan's I2V branch splits the context at a hard-coded 512 text tokens.
    text_tokens = 512 if variant == "i2v" else 8
    inputs = dict(
        hidden_states=x,
        timestep=torch.randint(0, 1000, (1, num_tokens) if variant == "ts2d" else (1,), generator=g),
        encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g),
        encoder_hidden_states_image=torch.randn(1, 4, 24, generator=g) if variant == "i2v" else None,
    )
    return inputs, torch.randn(x.shape, generator=g)


def forward_backward(model, inputs, weight):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    (out * weight).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    diff = (a - b).abs().max().item()
    return diff, diff / max(b.abs().max().item(), 1e-30)


def _model_body(rank, world_size, variant, ulysses_degrees, seed, checkpointing=False):
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    model = tiny_wan(variant)
    inputs, weight = make_inputs(variant, seed + 1)
    ref_out, ref_grads = forward_backward(model, inputs, weight)
    assert all(g is not None for g in ref_grads.values())
    dispatch_module = find_dispatch_module(model)
    original_dispatch = dispatch_module.dispatch_attention_fn

    for u in ulysses_degrees:
        dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=u)
        mesh = build_parallel_mesh(dims, "cpu")
        sp_model = copy.deepcopy(model)
        handle = apply_sequence_parallel(sp_model, mesh, plan=sp_plan(sp_model))
        if checkpointing:  # the boundary hooks re-run when a checkpointed block is recomputed
            sp_model.enable_gradient_checkpointing()
        out, grads = forward_backward(sp_model, inputs, weight)
        out2, grads2 = forward_backward(sp_model, inputs, weight)
        handle.remove()
        name = f"{variant} u{dims.ulysses}r{dims.ring}{' ckpt' if checkpointing else ''} seed={seed}"

        assert torch.equal(out, out2) and all(torch.equal(grads[n], grads2[n]) for n in grads), (
            f"{name}: deterministic double run differs"
        )
        copies = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(copies, out)
        assert all(torch.equal(c, out) for c in copies), f"{name}: outputs differ across sp ranks"
        out_abs, out_rel = _rel(out, ref_out)
        if dims.ring == 1:
            assert torch.equal(out, ref_out), f"{name}: Ulysses output must be bitwise, diff {out_abs}"
        else:
            assert out_rel <= OUT_RING_TOL, f"{name}: output max abs {out_abs:.3g} rel {out_rel:.3g}"

        # Per tensor: |diff| <= GRAD_TOL * max|ref| + GRAD_TOL * 1e-2 * (largest max|ref| of the model).
        # The second term covers gradients that are zero up to rounding (e.g. attn2.to_k.bias: softmax
        # is invariant to a key bias), whose relative error is meaningless.
        scale = max(g.abs().max().item() for g in ref_grads.values())
        worst = (0.0, 0.0, "")
        for pname, grad in grads.items():
            assert grad is not None, f"{name}: {pname} got no gradient"
            dist.all_reduce(grad, group=mesh.sp_group)
            grad /= dims.sp
            abs_diff, rel_diff = _rel(grad, ref_grads[pname])
            ref_max = ref_grads[pname].abs().max().item()
            assert abs_diff <= GRAD_TOL * (ref_max + 1e-2 * scale), (
                f"{name}: grad {pname} max abs {abs_diff:.3g} rel {rel_diff:.3g}"
            )
            if ref_max >= 1e-2 * scale:
                worst = max(worst, (rel_diff, abs_diff, pname))
        if rank == 0:
            print(
                f"[usp_model] {name}: out max abs/rel {out_abs:.2e}/{out_rel:.2e}; "
                f"weight grads worst rel {worst[0]:.2e} (abs {worst[1]:.2e}, {worst[2]})",
                flush=True,
            )
    # remove() restored the stock dispatch; the reference model is unchanged
    assert dispatch_module.dispatch_attention_fn is original_dispatch
    assert torch.equal(forward_backward(model, inputs, weight)[0], ref_out)


def _sp1_and_failures_body(rank, world_size, seed):
    torch.manual_seed(seed)
    model = tiny_wan("t2v")
    inputs, weight = make_inputs("t2v", seed + 1)
    ref_out, ref_grads = forward_backward(model, inputs, weight)

    # sp == 1 (dp == world): nothing installed, bitwise identical outputs and gradients
    mesh1 = build_parallel_mesh(ParallelDims(world_size=world_size, sequence_parallel_size=1), "cpu")
    handle = apply_sequence_parallel(model, mesh1)
    assert not handle.enabled
    out, grads = forward_backward(model, inputs, weight)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)

    # S % sp != 0 is padded (tests/distributed/test_usp_uneven.py has the parity bands): 9 tokens
    # at sp 2 (c = 5, Ulysses only) give the reference output bitwise
    mesh = build_parallel_mesh(ParallelDims(world_size=world_size, sequence_parallel_size=world_size), "cpu")
    sp_model = copy.deepcopy(model)
    odd_inputs, odd_weight = make_inputs("t2v", seed, frames=1, size=6)  # 1 * 3 * 3 = 9 tokens
    odd_ref = forward_backward(model, odd_inputs, odd_weight)[0]
    handle = apply_sequence_parallel(sp_model, mesh)
    assert torch.equal(forward_backward(sp_model, odd_inputs, odd_weight)[0], odd_ref)
    handle.remove()
    # ... unless a family's attention installer does not exclude pads: then it raises at the shard
    unaware = dataclasses.replace(
        sequence_parallel_plan(sp_model), attention_installer=lambda model, u, r: lambda: None
    )
    handle = apply_sequence_parallel(sp_model, mesh, plan=unaware)
    with pytest.raises(
        ValueError, match=r"sequence length 9 is not divisible .* does not exclude pad tokens"
    ):
        sp_model(**odd_inputs, return_dict=False)
    handle.remove()

    # heads % ulysses != 0 raises in apply_sequence_parallel (3 heads, ulysses 2)
    from diffusers import WanTransformer3DModel

    three_heads = WanTransformer3DModel(
        num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32, freq_dim=32,
        ffn_dim=64, num_layers=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="3 attention heads are not divisible by --ulysses-degree 2"):
        apply_sequence_parallel(three_heads, mesh)


def test_usp_model_t2v_world4():
    # u4r1 Ulysses, u2r2 hybrid, u1r4 ring
    run_pooled(_model_body, 4, "t2v", [4, 2, 1], FIXED_SEEDS[6])


def test_usp_model_ltx_world4():
    # LTX-Video's family plan (the text and its mask whole on every rank, USP in self-attention
    # only); u4r1, u2r2, u1r4, and u2r2 with gradient checkpointing
    run_pooled(_model_body, 4, "ltx", [4, 2, 1], FIXED_SEEDS[6])
    run_pooled(_model_body, 4, "ltx", [2], FIXED_SEEDS[7], True)


def test_usp_model_i2v_and_2d_timestep_with_checkpointing_world2():
    seed = FIXED_SEEDS[7]
    run_pooled(_model_body, 2, "i2v", [2, 1], seed)
    run_pooled(_model_body, 2, "ts2d", [2, 1], seed, True)


def test_usp_model_sp1_noop_and_failures_world2():
    run_pooled(_sp1_and_failures_body, 2, FIXED_SEEDS[8])
