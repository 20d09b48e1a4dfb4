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
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability() < (8, 9)
        or importlib.util.find_spec("torchao") is None,
        reason="FP8 needs CUDA sm >= 89 and torchao",
    ),
]

SMALL_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=256,
    freq_dim=256,
    ffn_dim=1024,
    num_layers=2,
    rope_max_seq_len=1024,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def _model(dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**SMALL_WAN).to("cuda", dtype)


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


def _nccl_world() -> None:
    """A world of one rank over NCCL (not a fixture: the GPU machine runs these without pytest)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29543")
        dist.init_process_group("nccl", rank=0, world_size=1)


def test_fp8_rollout_through_the_trainer_wrapping():
    from miles.grpo.tis import DriftStats
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.parallel.topology import ParallelDims, build_parallel_mesh
    from miles.rollout.precision import rollout_precision
    from miles.rollout.sampler import compute_log_prob, sample_with_logprob
    from miles.train.parallelize import parallelize_expert

    _nccl_world()
    mesh = build_parallel_mesh(ParallelDims(world_size=1, sequence_parallel_size=1), "cuda")
    model = _model(torch.float32)
    parallelize_expert(model, mesh, attention_backend="_native_cudnn", param_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(2, 64, 256, generator=g).to("cuda", torch.bfloat16)
    neg = torch.randn(1, 64, 256, generator=g).to("cuda", torch.bfloat16)
    init = torch.randn(2, 16, 5, 32, 32, generator=g).cuda()
    options = dict(
        num_steps=6,
        shift=3.0,
        guidance_scales=[5.0],
        noise_level=0.7,
        latents=init,
        sde_steps=[0, 1, 2],
    )
    rollouts = {}
    with torch.no_grad():
        for precision in ("fp8", "bf16"):
            with unsharded_for_rollout([model]), rollout_precision([model], precision):
                gen = torch.Generator(device="cuda").manual_seed(1)
                rollouts[precision] = sample_with_logprob(
                    [model], pos, neg, (16, 5, 32, 32), generator=gen, **options
                )
        gaps = {}
        for precision, ro in rollouts.items():
            with unsharded_for_rollout([model]):
                lp = torch.stack(
                    [compute_log_prob([model], ro, k, pos, neg, [5.0], None, 0.7)[0] for k in range(3)], dim=1
                )
            gaps[precision] = (lp - ro.log_probs).abs()
            if precision == "fp8":
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
