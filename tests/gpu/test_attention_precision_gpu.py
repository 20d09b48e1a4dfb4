"""INT8 rollout attention on a GPU (skipped without CUDA sm >= 80, sageattention and triton):
``rollout.attention_precision: sage_int8``'s kernel at Wan's head size 128.

- the kernel against its float formula (:func:`miles.rollout.attention.sage_int8_reference`) and
  against bf16 SDPA, both measured from exact float32 attention: the formula explains the kernel
  (its distance to the kernel is below the kernel's distance to exact attention), and the INT8
  error stays within a few percent; the caller's K is not modified (sageattn smooths in place);
- through a Wan transformer with USP installed (ring 1, one rank): the same output as without USP,
  close to bf16's, and bf16's again after the switch;
- a rollout through the trainer's wrapping: the bf16 rescoring of its SDE steps differs from its
  log-probs by a small nonzero gap (what the TIS correction sees).
The GPU machine runs these without pytest as well: every test is a plain function.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.wrapped_rollout import SMALL_WAN, rescored_rollouts, wan_expert, wrapped_expert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability() < (8, 0)
        or importlib.util.find_spec("sageattention") is None
        or importlib.util.find_spec("triton") is None,
        reason="SageAttention's Triton kernels need CUDA sm >= 80, sageattention and triton",
    ),
]

WAN_HEAD = dict(SMALL_WAN, attention_head_dim=128)  # Wan's head size


def _qkv(s=4096, h=12, d=128, seed=0):
    """bf16 (1, S, H, D) with K's first channels offset (the outliers SageAttention smooths)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", generator=g) for _ in range(3))
    k[..., :4] += 6.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def test_kernel_matches_its_float_formula_at_head_size_128():
    from miles.rollout.attention import KERNELS, sage_int8_reference

    q, k, v = _qkv()
    k_before = k.clone()
    kernel = KERNELS["sage_int8"].load()
    with torch.no_grad():
        out = kernel(q, k, v, None).float()
        ref = sage_int8_reference(q, k, v).float()
        exact = _sdpa(q.float(), k.float(), v.float())
        bf16 = _sdpa(q, k, v).float()
    assert torch.equal(k, k_before)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    scale = exact.abs().mean()
    err = {
        "kernel_vs_exact": float((out - exact).abs().mean() / scale),
        "kernel_vs_reference": float((out - ref).abs().mean() / scale),
        "reference_vs_exact": float((ref - exact).abs().mean() / scale),
        "bf16_vs_exact": float((bf16 - exact).abs().mean() / scale),
    }
    print(err)
    assert err["kernel_vs_reference"] < err["kernel_vs_exact"], err
    assert err["kernel_vs_reference"] < 0.5 * err["reference_vs_exact"], err
    assert 0 < err["kernel_vs_exact"] < 5e-2, err


def _model():
    return wan_expert(WAN_HEAD, torch.bfloat16).eval()


def test_through_the_model_under_usp_ring_1():
    from miles.rollout.attention import rollout_attention
    from miles.sequence_parallel.attention import apply_dispatch_sp_attention

    model = _model()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 16, 5, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g)
    ctx = torch.randn(1, 64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([600.0], device="cuda")
    with torch.no_grad():
        ref = model(x, t, ctx, return_dict=False)[0].float()
        with rollout_attention([model], "sage_int8"):
            plain = model(x, t, ctx, return_dict=False)[0].float()
        remove = apply_dispatch_sp_attention(model, None, None)
        try:
            with rollout_attention([model], "sage_int8"):
                usp = model(x, t, ctx, return_dict=False)[0].float()
            after = model(x, t, ctx, return_dict=False)[0].float()
        finally:
            remove()
    assert torch.equal(usp, plain)
    rel = float((plain - ref).norm() / ref.norm())
    assert 0 < rel < 0.1, rel
    assert torch.equal(after, ref)


def test_int8_rollout_through_the_trainer_wrapping():
    from miles.rollout.attention import rollout_attention

    model = wrapped_expert(WAN_HEAD, port="29544")
    runs = rescored_rollouts(model, rollout_attention, ("sage_int8", "bf16"))
    gaps = {precision: (lp - ro.log_probs).abs() for precision, (ro, lp) in runs.items()}
    assert float(gaps["bf16"].max()) < 1e-5, gaps["bf16"]  # the canary: bf16 recompute is exact
    assert 0 < float(gaps["sage_int8"].mean()) < 1.0, gaps["sage_int8"]
