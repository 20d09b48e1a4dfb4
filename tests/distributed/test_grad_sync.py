"""Grad-sync parity under FSDP2 over dp x sp, on the production wrapping path.

One world-4 spawn loops over six layouts — dp4, dp2 x sp2 (u2r1 and u1r2), dp1 x sp4 (u4r1,
u2r2, u1r4) — building a fresh mesh and model per layout exactly as ``miles.train.parallelize``
does (``miles.train.parallelize.parallelize_expert``: SP install, then ``apply_fsdp``) over
``mesh.fsdp_mesh`` (fp32 reduce). The same global batch of 4 random samples (a fixed seed) is split by
dp_rank (sp peers get the same samples); loss = MSE of the output against a random target,
a mean over the rank's samples. What FSDP leaves in the gradients is the identity

    (1/(dp·sp)) · Σ_dp Σ_sp sp·g_local  ==  (1/dp) · Σ_dp g

(the SP gather's backward sums over sp; FSDP's default mean runs over all dp·sp ranks), i.e. the
gradient of the global-batch mean loss. Checked against two references: a single-process,
unsharded model run on the whole global batch on every rank, and the dp-only layout (dp4).
Then one AdamW step on the sharded parameters is compared with the same step on the reference.

Compared: the full (unsharded) gradient of every parameter (``p.grad.full_tensor()``) and every
parameter after the step (``p.full_tensor()``), fp32 on CPU, deterministic algorithms on.

Tolerances (fp32):
- gradients, per tensor: max|g - g_ref| <= 2e-5 · (max|g_ref| + 1e-2 · max over tensors of
  max|g_ref|). The layouts change only summation order: dW = xᵀ·dy sums over tokens (split by
  sp) and samples (split by dp), and FSDP's reduce-scatter adds the rank partials in another
  order. The floor term covers gradients that are zero up to rounding (``attn2.to_k.bias``:
  softmax is invariant to a key bias). Measured max per-tensor deviation relative to the
  tensor's max (tensors above the floor): ≤ 1.7e-6 over all layouts (see docs/validation.md).
- weights after one AdamW step, per element: |w - w_ref| <= 2·lr·|g - g_ref| / (max(|g|,
  |g_ref|) + eps) + 1e-6·(|w_ref| + lr). Adam's first update is lr·g/(|g| + eps), a sign-like
  function, whose sensitivity to a gradient difference is at most 2·|Δg| / (max(|g|, |g_ref|)
  + eps); the second term is a few fp32 ulps of the update arithmetic. Elements whose gradient
  is rounding noise may therefore move by up to 2·lr, and nothing else may; measured max |Δw| is
  reported per layout, and the fraction of elements outside 1e-6·lr of the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.sequence_parallel.attention import find_dispatch_module
from miles.train.parallelize import parallelize_expert
from tests.dist_utils import FIXED_SEEDS, run_pooled
from tests.models import TINY_WAN

pytestmark = pytest.mark.distributed

# (name, sequence_parallel_size, ulysses_degree) at world size 4
LAYOUTS = [
    ("dp4", 1, 1),
    ("dp2xu2", 2, 2),
    ("dp2xr2", 2, 1),
    ("u4r1", 4, 4),
    ("u2r2", 4, 2),
    ("u1r4", 4, 1),
]
GLOBAL_BATCH = 4
GRAD_TOL = 2e-5
GRAD_FLOOR = 1e-2
LR, EPS, WEIGHT_DECAY = 1e-3, 1e-8, 1e-2
STEP_SLACK = 1e-6


def tiny_wan():
    """A 2-block tiny Wan T2V transformer, 4 heads x 16 (so Ulysses 4 divides the heads)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TINY_WAN)


def make_batch(seed: int, batch: int = GLOBAL_BATCH) -> tuple[dict, torch.Tensor]:
    """A global batch: latents (B, 4, 2, 8, 8) = 2 x 4 x 4 = 32 tokens per sample, and a target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 2, 8, 8, generator=g)
    inputs = dict(
        hidden_states=x,
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        encoder_hidden_states=torch.randn(batch, 8, 32, generator=g),
    )
    return inputs, torch.randn(x.shape, generator=g)


def local_slice(inputs: dict, target: torch.Tensor, dp_rank: int, dp: int) -> tuple[dict, torch.Tensor]:
    n = target.shape[0] // dp
    sl = slice(dp_rank * n, (dp_rank + 1) * n)
    return {k: v[sl] for k, v in inputs.items()}, target[sl]


def make_optimizer(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)


def build_layout(
    base: torch.nn.Module, world_size: int, sp: int, ulysses: int, param_dtype: torch.dtype | None = None
):
    """A fresh copy of ``base`` parallelised as the trainer does (``parallelize_expert``)."""
    dims = ParallelDims(world_size=world_size, sequence_parallel_size=sp, ulysses_degree=ulysses)
    mesh = build_parallel_mesh(dims, "cpu")
    model = copy.deepcopy(base)
    handle = parallelize_expert(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
    return dims, mesh, model, handle


def train_step(model, inputs: dict, target: torch.Tensor) -> tuple[dict, dict]:
    """Forward, MSE backward, one AdamW step; returns full gradients and full weights after the step."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    F.mse_loss(out, target).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    make_optimizer(model.parameters()).step()
    weights = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return grads, weights


def _full(t: torch.Tensor) -> torch.Tensor:
    assert t is not None
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def compare_grads(name: str, grads: dict, ref: dict) -> tuple[float, float]:
    """Assert the per-tensor tolerance; returns (max abs diff, max rel diff over tensors above the floor)."""
    assert grads.keys() == ref.keys(), f"{name}: parameter names differ"
    scale = max(g.abs().max().item() for g in ref.values())
    worst_abs = worst_rel = 0.0
    for pname, g in grads.items():
        r = ref[pname]
        assert g.shape == r.shape and g.dtype == r.dtype, f"{name}: {pname} {g.shape}/{g.dtype} vs {r.shape}"
        diff = (g - r).abs().max().item()
        ref_max = r.abs().max().item()
        assert diff <= GRAD_TOL * (ref_max + GRAD_FLOOR * scale), (
            f"{name}: grad {pname} max abs diff {diff:.3g} (ref max {ref_max:.3g}, model max {scale:.3g})"
        )
        worst_abs = max(worst_abs, diff)
        if ref_max >= GRAD_FLOOR * scale:
            worst_rel = max(worst_rel, diff / ref_max)
    return worst_abs, worst_rel


def compare_weights(name: str, weights: dict, ref_weights: dict, grads: dict, ref_grads: dict) -> dict:
    """Assert the per-element AdamW bound; returns max |Δw| and the share of elements moved > 1e-6·lr."""
    worst, moved, total = 0.0, 0, 0
    for pname, w in weights.items():
        w_ref, g, g_ref = ref_weights[pname], grads[pname], ref_grads[pname]
        assert w.shape == w_ref.shape and w.dtype == w_ref.dtype
        diff = (w - w_ref).abs()
        bound = 2 * LR * (g - g_ref).abs() / (torch.maximum(g.abs(), g_ref.abs()) + EPS)
        bound += STEP_SLACK * (w_ref.abs() + LR)
        bad = diff > bound
        assert not bad.any(), (
            f"{name}: weight {pname} after AdamW: {int(bad.sum())} elements outside the bound, "
            f"max excess {(diff - bound).max().item():.3g}"
        )
        worst = max(worst, diff.max().item())
        moved += int((diff > 1e-6 * LR).sum())
        total += diff.numel()
    return {"max_abs": worst, "frac_moved": moved / total}


def _grad_sync_body(rank: int, world_size: int, seed: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    base = tiny_wan()
    inputs, target = make_batch(seed + 1)
    dispatch_module = find_dispatch_module(base)
    original_dispatch = dispatch_module.dispatch_attention_fn

    # Single-process reference: the unsharded model on the whole global batch, on every rank.
    ref_grads, ref_weights = train_step(copy.deepcopy(base), inputs, target)
    assert all(g.abs().max() > 0 for n, g in ref_grads.items() if "attn2.to_k.bias" not in n)

    dp_only = None
    for name, sp, ulysses in LAYOUTS:
        dims, mesh, model, handle = build_layout(base, world_size, sp, ulysses)
        assert (dims.sp, dims.ulysses) == (sp, ulysses)
        grads, weights = train_step(model, *local_slice(inputs, target, mesh.dp_rank, dims.dp))
        handle.remove()
        vs_ref = compare_grads(f"{name} vs single-process", grads, ref_grads)
        step = compare_weights(f"{name} vs single-process", weights, ref_weights, grads, ref_grads)
        if dp_only is None:
            dp_only = (grads, weights)
            vs_dp = (0.0, 0.0)
        else:
            vs_dp = compare_grads(f"{name} vs dp4", grads, dp_only[0])
            compare_weights(f"{name} vs dp4", weights, dp_only[1], grads, dp_only[0])
        # Every rank holds the same full gradients and weights.
        digest = torch.stack(
            [sum(g.double().sum() for g in grads.values()), sum(w.double().sum() for w in weights.values())]
        )
        copies = [torch.empty_like(digest) for _ in range(world_size)]
        dist.all_gather(copies, digest)
        assert all(torch.equal(c, digest) for c in copies), f"{name}: ranks disagree on the full gradients"
        if rank == 0:
            print(
                f"[grad_sync] {name} (dp{dims.dp} x u{dims.ulysses}r{dims.ring}) seed={seed}: grads vs "
                f"single-process max abs {vs_ref[0]:.2e} rel {vs_ref[1]:.2e}; vs dp4 max abs {vs_dp[0]:.2e} "
                f"rel {vs_dp[1]:.2e}; weights after AdamW max abs {step['max_abs']:.2e} "
                f"({step['max_abs'] / LR:.2g} lr), moved > 1e-6 lr: {step['frac_moved']:.2%}",
                flush=True,
            )
    assert dispatch_module.dispatch_attention_fn is original_dispatch


def test_grad_sync_parity_six_layouts_world4():
    run_pooled(_grad_sync_body, 4, FIXED_SEEDS[2])
