"""FP8 rollouts on a GPU (skipped without CUDA sm >= 89 and torchao): the float8 copy of a Wan
transformer's block Linear layers through torchao, as ``rollout.precision: fp8`` samples.

- its forward is close to the bf16 forward but not equal to it, the swapped layers hold torchao
  float8 weights, and leaving the context restores the bf16 forward bit for bit;
- through the trainer's wrapping (``parallelize_expert``, ``unsharded_for_rollout``) an FP8 rollout
  runs and the bf16 rescoring of its SDE steps differs from its log-probs by a small, nonzero gap
  (what the TIS correction sees), while a bf16 rollout's rescoring is exact.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu.wrapped_rollout import SMALL_WAN, rescored_rollouts, wan_expert, wrapped_expert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability() < (8, 9)
        or importlib.util.find_spec("torchao") is None,
        reason="FP8 needs CUDA sm >= 89 and torchao",
    ),
]


def _model(dtype):
    return wan_expert(SMALL_WAN, dtype)


def test_fp8_forward_is_close_and_restored():
    from miles.rollout.precision import quantizable_linears, rollout_precision

    model = _model(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 16, 5, 32, 32, device="cuda", dtype=torch.bfloat16, generator=g)
    ctx = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([700.0, 300.0], device="cuda")
    with torch.no_grad():
        ref = model(x, t, ctx, return_dict=False)[0].float()
        originals = [lin for _, _, lin in quantizable_linears(model)]
        with rollout_precision([model], "fp8"):
            kinds = {type(lin.weight).__name__ for _, _, lin in quantizable_linears(model)}
            out = model(x, t, ctx, return_dict=False)[0].float()
        after = model(x, t, ctx, return_dict=False)[0].float()
    assert len(originals) == 2 * 10 and kinds == {"Float8Tensor"}, kinds
    assert [lin for _, _, lin in quantizable_linears(model)] == originals
    assert all(lin.weight.dtype == torch.bfloat16 for lin in originals)
    rel = float((out - ref).norm() / ref.norm())
    assert 0 < rel < 0.1, rel
    assert torch.equal(after, ref)


def test_fp8_rollout_through_the_trainer_wrapping():
    from miles.grpo.tis import DriftStats
    from miles.rollout.precision import rollout_precision

    model = wrapped_expert(SMALL_WAN, port="29543")
    runs = rescored_rollouts(model, rollout_precision, ("fp8", "bf16"))
    gaps = {precision: (lp - ro.log_probs).abs() for precision, (ro, lp) in runs.items()}
    ro, lp = runs["fp8"]
    stats = DriftStats()
    for k in range(3):
        stats.add(lp[:, k], ro.log_probs[:, k], 2.0, 1 / 3)
    assert float(gaps["bf16"].max()) < 1e-5, gaps["bf16"]  # eager bf16: the recompute is exact (canary 0)
    assert 0 < float(gaps["fp8"].mean()) < 1.0, gaps["fp8"]
    assert 0.5 < stats.metrics()["tis_weight_mean"] < 2.0


def test_an_all_zero_activation_row_gives_the_bias():
    """A zero input row has the per-row float8 scale floor (not 0, whose quantized row is 0/0 =
    NaN): its output is the bias, the other rows are close to bf16's."""
    from miles.rollout.precision import fp8_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128).to("cuda", torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x[7] = 0
    with torch.no_grad():
        out, ref = fp8_linear(lin)(x), lin(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[7], lin.bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=0.1, atol=0.15)
