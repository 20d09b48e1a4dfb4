"""Sequence lengths that sp does not divide, and head counts that sp does not divide.

Padding (docs/sequence_parallel.md, "Uneven lengths"): S tokens are zero-padded at the end to
sp·c, c = ceil(S/sp); pad keys are excluded from attention, pad tokens are dropped by the
gather. Claims under test, against the unsharded reference:

- op level (usp_attention vs full-sequence attention, fp32 and bf16): real rows of the output
  and of dQ/dK/dV as for even shards (Ulysses bitwise, ring within RING_TOL); gradients of pad
  rows exactly zero; pad outputs finite; deterministic double runs bitwise. Lengths include
  ranks that hold pads only and ring ranks whose whole chunk is pads.
- model level (tiny Wan and tiny LTX-Video with its family plan, fp32, incl. 2-D timesteps and
  gradient checkpointing): outputs
  (Ulysses bitwise, ring <= 1e-5 rel) and every parameter gradient (5e-5 rel, as for even
  shards); double runs bitwise; outputs identical across sp ranks.
- heads % sp != 0: 6 heads at sp 4 resolve to Ulysses 2 x ring 2 (auto) and match the
  reference (an explicit degree that does not divide the heads: tests/unit/test_topology.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from miles.parallel.topology import ParallelDims, build_parallel_mesh, resolve_ulysses_degree
from miles.sequence_parallel import apply_sequence_parallel, shard_sequence, usp_attention
from miles.sequence_parallel.comm import padded_chunk
from tests.dist_utils import FIXED_SEEDS, run_pooled
from tests.distributed.test_usp_attention import RING_TOL, _full_reference
from tests.distributed.test_usp_model import (
    GRAD_TOL,
    OUT_RING_TOL,
    forward_backward,
    ltx_inputs,
    sp_plan,
    tiny_wan,
)

pytestmark = pytest.mark.distributed


def _rel(a, b):
    diff = (a.float() - b.float()).abs().max().item()
    return diff, diff / max(b.float().abs().max().item(), 1e-30)


# --- op level -------------------------------------------------------------------------------------


def _usp_run(q, k, v, grad_out, mesh, seq_len):
    ql, kl, vl = (shard_sequence(t, 1, mesh.sp_group).requires_grad_() for t in (q, k, v))
    out = usp_attention(
        ql, kl, vl, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group, seq_len=seq_len
    )
    out.backward(shard_sequence(grad_out, 1, mesh.sp_group))  # pad rows: zero output gradient
    return out.detach(), ql.grad, kl.grad, vl.grad


def _op_body(rank, world_size, cases, seed):
    """cases: (ulysses, S, dtype). Compares this rank's real rows; pads must get zero gradients."""
    torch.use_deterministic_algorithms(True)
    meshes = {}
    for idx, (u, s, dtype) in enumerate(cases):
        if u not in meshes:
            dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=u)
            meshes[u] = build_parallel_mesh(dims, "cpu")
        mesh = meshes[u]
        g = torch.Generator().manual_seed(seed + idx)
        q, k, v, grad_out = (torch.randn(2, s, 4, 16, generator=g).to(dtype) for _ in range(4))
        ref = [shard_sequence(t, 1, mesh.sp_group) for t in _full_reference(q, k, v, grad_out)]
        got, again = (_usp_run(q, k, v, grad_out, mesh, s) for _ in range(2))
        c = padded_chunk(s, world_size)
        real = min(max(s - rank * c, 0), c)  # real rows of this rank's chunk
        name = f"u{u}r{world_size // u} S={s} {dtype} seed={seed + idx} rank={rank} real={real}/{c}"
        stats = []
        for label, x, y, z in zip(("out", "dq", "dk", "dv"), got, ref, again):
            assert x.dtype == dtype and x.shape == y.shape, (name, label, x.shape, y.shape)
            assert torch.equal(x, z), f"{name} {label}: deterministic double run differs"
            assert torch.isfinite(x).all(), f"{name} {label}: non-finite values"
            if label != "out":
                assert not x[:, real:].any(), f"{name} {label}: pad rows got a gradient"
            if real == 0:
                continue
            xr, yr = x[:, :real], y[:, :real]
            if u == world_size:
                assert torch.equal(xr, yr), f"{name} {label}: Ulysses must be bitwise, diff {_rel(xr, yr)}"
            else:
                abs_diff, rel_diff = _rel(xr, yr)
                assert rel_diff <= RING_TOL[dtype], (
                    f"{name} {label}: max abs {abs_diff:.3g} rel {rel_diff:.3g}"
                )
            stats.append(_rel(xr, yr)[1])
        # worst relative deviation over the sp group, printed by rank 0
        worst = torch.tensor([max(stats, default=0.0)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"[usp_uneven op] u{u}r{world_size // u} S={s} {dtype}: worst rel {worst.item():.2e}",
                flush=True,
            )


# --- model level ----------------------------------------------------------------------------------


def _cpu_lone_query_row(num_queries: int) -> bool:
    """Whether the CPU flash kernel computes the last query row in a block of its own.

    It splits queries into blocks of 32 (< 192 rows), 64 (< 768) or 256; a block of ONE row
    goes through a different GEMM path (GEMV) and rounds differently from the same row inside
    a larger block. Measured on torch 2.13 CPU; GPU kernels compute each row the same way.
    """
    split = 256 if num_queries >= 768 else 64 if num_queries >= 192 else 32
    return num_queries % min(split, num_queries) == 1 or num_queries == 1


def _inputs(frames, height, width, seed, ts2d=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, frames, height, width, generator=g)
    tokens = frames * (height // 2) * (width // 2)
    inputs = dict(
        hidden_states=x,
        timestep=torch.randint(0, 1000, (1, tokens) if ts2d else (1,), generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
    )
    return inputs, torch.randn(x.shape, generator=g), tokens


def _tiny(family: str, heads: int):
    """The tiny transformer of ``family`` (``t2v``: Wan, ``ltx``: LTX-Video) with ``heads`` heads."""
    model = tiny_wan(family)
    if heads != model.config.num_attention_heads:
        config = {**model.config, "num_attention_heads": heads}
        if family == "ltx":  # the text is projected to the model width
            config["cross_attention_dim"] = heads * model.config.attention_head_dim
        model = type(model).from_config(config)
    return model


def _model_body(rank, world_size, cases, seed):
    """cases: (num_heads, requested ulysses (0 = auto), latent (frames, height, width), ts2d,
    checkpointing[, family]): Wan's (frames, height, width) before its 2x2 patchify, LTX's tokens."""
    torch.use_deterministic_algorithms(True)
    for idx, (heads, requested, shape, ts2d, checkpointing, *family) in enumerate(cases):
        family = family[0] if family else "t2v"
        torch.manual_seed(seed + idx)
        model = _tiny(family, heads)
        if family == "ltx":
            inputs, weight, tokens = ltx_inputs(seed + 100 + idx, *shape)
        else:
            inputs, weight, tokens = _inputs(*shape, seed + 100 + idx, ts2d)
        ref_out, ref_grads = forward_backward(model, inputs, weight)

        u = resolve_ulysses_degree(world_size, requested, heads)
        dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=u)
        mesh = build_parallel_mesh(dims, "cpu")
        sp_model = copy.deepcopy(model)
        handle = apply_sequence_parallel(sp_model, mesh, plan=sp_plan(sp_model))
        if checkpointing:
            sp_model.enable_gradient_checkpointing()
        out, grads = forward_backward(sp_model, inputs, weight)
        out2, grads2 = forward_backward(sp_model, inputs, weight)
        handle.remove()
        name = (
            f"{family} {heads}h u{dims.ulysses}r{dims.ring} S={tokens}{' ts2d' if ts2d else ''}"
            f"{' ckpt' if checkpointing else ''} seed={seed + idx}"
        )
        assert tokens % world_size != 0, name
        assert torch.equal(out, out2) and all(torch.equal(grads[n], grads2[n]) for n in grads), (
            f"{name}: deterministic double run differs"
        )
        copies = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(copies, out)
        assert all(torch.equal(c, out) for c in copies), f"{name}: outputs differ across sp ranks"
        out_abs, out_rel = _rel(out, ref_out)
        # Cross-attention runs locally on c = ceil(S/sp) queries vs S in the reference: bitwise
        # unless one side has a one-row query block in the CPU kernel (see _cpu_lone_query_row).
        lone = _cpu_lone_query_row(tokens) or _cpu_lone_query_row(padded_chunk(tokens, world_size))
        if dims.ring == 1 and not lone:
            assert torch.equal(out, ref_out), f"{name}: Ulysses output must be bitwise, diff {out_abs}"
        else:
            assert out_rel <= OUT_RING_TOL, f"{name}: output max abs {out_abs:.3g} rel {out_rel:.3g}"
        scale = max(g.abs().max().item() for g in ref_grads.values())
        worst = (0.0, 0.0, "")
        for pname, grad in grads.items():
            dist.all_reduce(grad, group=mesh.sp_group)
            grad /= dims.sp
            abs_diff, rel_diff = _rel(grad, ref_grads[pname])
            ref_max = ref_grads[pname].abs().max().item()
            assert abs_diff <= GRAD_TOL * (ref_max + 1e-2 * scale), (
                f"{name}: grad {pname} max abs {abs_diff:.3g} rel {rel_diff:.3g}"
            )
            # attn2.to_k.bias: its exact gradient is zero (softmax ignores a key bias), so only rounding
            if ref_max >= 1e-2 * scale and not pname.endswith("attn2.to_k.bias"):
                worst = max(worst, (rel_diff, abs_diff, pname))
        if rank == 0:
            print(
                f"[usp_uneven model] {name}: out max abs/rel {out_abs:.2e}/{out_rel:.2e}; "
                f"weight grads worst rel {worst[0]:.2e} ({worst[2]})",
                flush=True,
            )


# One spawn per world size (process start-up dominates on 2 cores): op cases, then model cases.
def _body(rank, world_size, op_cases, model_cases, seed):
    _op_body(rank, world_size, op_cases, seed)
    _model_body(rank, world_size, model_cases, seed)


def test_usp_uneven_world4():
    op_cases = [
        (u, s, dtype)
        for u in (4, 2, 1)  # u4r1, u2r2, u1r4
        for s, dtype in ((30, torch.float32), (33, torch.bfloat16), (37, torch.float32))
    ]
    # tiny lengths: at S=9 (c=3) rank 3 holds pads only; at S=2 u2r2 ring rank 1's chunk is all pads
    op_cases += [(1, 9, torch.float32), (2, 9, torch.float32), (2, 2, torch.float32), (1, 5, torch.bfloat16)]
    model_cases = [
        (4, 4, (1, 2, 74), False, False),  # S = 37, u4r1: bitwise
        (6, 0, (2, 6, 10), True, False),  # S = 30, 6 heads -> auto u2r2, 2-D timestep
        (4, 1, (3, 2, 22), False, False),  # S = 33, u1r4
        (4, 4, (1, 3, 7), False, False, "ltx"),  # LTX S = 21, u4r1
        (6, 0, (2, 3, 5), False, False, "ltx"),  # LTX S = 30, 6 heads -> auto u2r2
    ]
    run_pooled(_body, 4, op_cases, model_cases, FIXED_SEEDS[4])


def test_usp_uneven_world2():
    op_cases = [(u, s, dtype) for u in (2, 1) for s in (31, 33) for dtype in (torch.float32, torch.bfloat16)]
    model_cases = [
        # S = 33, u2r1, 2-D timestep, gradient checkpointing. Not bitwise on CPU: the reference's
        # cross-attention has a one-row query block (33 = 32 + 1), see _cpu_lone_query_row.
        (4, 2, (3, 2, 22), True, True),
        (4, 2, (1, 2, 74), False, False),  # S = 37, u2r1: bitwise
        (4, 1, (1, 2, 74), False, True),  # S = 37, u1r2, gradient checkpointing
        (4, 2, (3, 3, 3), False, True, "ltx"),  # LTX S = 27, u2r1, gradient checkpointing
    ]
    run_pooled(_body, 2, op_cases, model_cases, FIXED_SEEDS[5])


# --- the padded ring step with every kernel, one process ------------------------------------------


def _simulated_ring(kernel, q, k, v, grad_out, ring, seq_len):
    """Ring attention of ``ring`` simulated ranks in one process: the templates' schedule (step i
    of rank r attends to the K/V chunk of rank (r - i) mod ring), torch's own merger, and
    ``_PaddedRingStep`` around ``kernel``. (B, H, ring·n, D) in; out, dQ, dK, dV (padded) out."""
    from miles.sequence_parallel.ring import _PaddedRingStep, _ring_templates

    templates = _ring_templates()
    n = q.shape[2] // ring
    qs, ks, vs, dos = (list(t.split(n, dim=2)) for t in (q, k, v, grad_out))
    outs, lses, extras = [], [], []
    for r in range(ring):
        step = _PaddedRingStep(kernel, r, ring, n, seq_len)
        merger = templates._SDPAMerger(True, seq_dim=2)
        for i in range(ring):
            src = (r - i) % ring
            out, lse, extra = step.forward(qs[r], ks[src], vs[src], is_causal=False, scale=None)
            merger.step(out, lse, False)
        out, lse = merger.results()
        outs.append(out)
        lses.append(lse)
        extras.append(extra)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for r in range(ring):
        step = _PaddedRingStep(kernel, r, ring, n, seq_len)
        for i in range(ring):
            src = (r - i) % ring
            dq_, dk_, dv_ = step.backward(
                grad_out=dos[r],
                query=qs[r],
                key=ks[src],
                value=vs[src],
                out=outs[r],
                logsumexp=lses[r],
                is_causal=False,
                scale=None,
                **extras[r],
            )
            dq[:, :, r * n : (r + 1) * n] += dq_
            dk[:, :, src * n : (src + 1) * n] += dk_
            dv[:, :, src * n : (src + 1) * n] += dv_
    return torch.cat(outs, dim=2), dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_CUDA_KERNELS = [
    pytest.param(b, marks=[pytest.mark.gpu, _NEEDS_CUDA]) for b in ("_native_flash", "_native_cudnn")
]


@pytest.mark.parametrize("ring,seq_len", [(4, 37), (4, 31), (4, 9), (2, 3), (4, 64)])
@pytest.mark.parametrize("backend", ["cpu", *_CUDA_KERNELS])
def test_padded_ring_step_matches_full_attention(backend, ring, seq_len):
    """Real rows of out/dQ/dK/dV match full attention on the S real tokens; pads get zero gradient.

    (ring, S): 37 in 4 chunks of 10 (last chunk 7 real); 31 (last chunk 1 real key); 9 in 4
    chunks of 3 (last chunk all pads: rank 3 holds pad queries only); 3 in 2 chunks of 2; 64 in
    4 chunks of 16 (no pads). (cuDNN rejects a 1 x 1 attention, so no chunk of one token here:
    it needs S <= ring, which no video meets.)
    """
    from miles.sequence_parallel.ring import CPU_RING_KERNEL, RING_KERNELS

    kernel = CPU_RING_KERNEL if backend == "cpu" else RING_KERNELS[backend]
    device, dtype = ("cpu", torch.float32) if backend == "cpu" else ("cuda", torch.bfloat16)
    n = padded_chunk(seq_len, ring)
    g = torch.Generator().manual_seed(seq_len)
    q, k, v, grad_out = (torch.randn(2, 4, seq_len, 64, generator=g).to(device, dtype) for _ in range(4))

    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref_inputs)
    ref_out.backward(grad_out)
    ref = [ref_out.detach(), *(t.grad for t in ref_inputs)]

    def pad(t):  # (B, H, S, D) -> (B, H, ring·n, D), zeros at the end
        return torch.nn.functional.pad(t, (0, 0, 0, ring * n - seq_len))

    got = _simulated_ring(kernel, pad(q), pad(k), pad(v), pad(grad_out), ring, seq_len)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    stats = []
    for label, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(x).all(), f"{backend} {label}: non-finite values"
        if label != "out":
            assert not x[:, :, seq_len:].any(), f"{backend} {label}: pad rows got a gradient"
        abs_diff, rel_diff = _rel(x[:, :, :seq_len], y)
        stats.append(f"{label}={rel_diff:.2e}")
        assert rel_diff <= tol, (
            f"{backend} ring={ring} S={seq_len} {label}: max abs {abs_diff:.3g} rel {rel_diff:.3g}"
        )
    print(f"[padded ring step] {backend} ring={ring} S={seq_len} rel: {' '.join(stats)}", flush=True)
