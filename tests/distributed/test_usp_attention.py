"""Op-level parity of usp_attention against full-sequence attention, on CPU over gloo.

Every rank draws the same random full-sequence Q, K, V and output gradient (a fixed seed from
``tests.dist_utils.FIXED_SEEDS``, so a failure reproduces), computes the reference on the full sequence, and compares its own chunk of the
output and of dQ/dK/dV with what usp_attention produced from the sharded inputs.

- Ulysses only (ring = 1): bitwise. The reference is the same local kernel (diffusers'
  dispatch, default backend) on the full sequence; the all-to-all is a permutation and each
  head runs whole on one rank.
- Ring > 1: online-softmax merge of ring chunks (torch's ring templates with the CPU flash
  kernel). Tolerance on max|diff| / max|ref| per tensor: fp32 2e-6, bf16 2e-2 (about 2.5 bf16
  ulps; ring merges in fp32 and rounds once, the reference rounds differently).
- Deterministic mode: a second run in every band is bitwise identical to the first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.sequence_parallel import gather_sequence, shard_sequence, usp_attention
from tests.dist_utils import FIXED_SEEDS, run_pooled

pytestmark = pytest.mark.distributed

RING_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.bfloat16)


def _full_reference(q, k, v, grad_out):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = dispatch_attention_fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _usp_run(q, k, v, grad_out, mesh):
    ql, kl, vl = (shard_sequence(t, 1, mesh.sp_group).requires_grad_() for t in (q, k, v))
    out = usp_attention(ql, kl, vl, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group)
    out.backward(shard_sequence(grad_out, 1, mesh.sp_group))
    return out.detach(), ql.grad, kl.grad, vl.grad


def _rel(a, b):
    diff = (a.float() - b.float()).abs().max().item()
    return diff, diff / max(b.float().abs().max().item(), 1e-30)


def _bands_body(rank, world_size, bands, seed):
    torch.use_deterministic_algorithms(True)
    for band_idx, (u, dtype) in enumerate(bands):
        dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=u)
        mesh = build_parallel_mesh(dims, "cpu")
        g = torch.Generator().manual_seed(seed + band_idx)
        b, s, h, d = 2, 16 * world_size, 4, 16
        q, k, v, grad_out = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(4))
        ref = [shard_sequence(t, 1, mesh.sp_group) for t in _full_reference(q, k, v, grad_out)]
        got = _usp_run(q, k, v, grad_out, mesh)
        again = _usp_run(q, k, v, grad_out, mesh)
        name = f"u{dims.ulysses}r{dims.ring} {dtype} seed={seed + band_idx}"
        for label, x, y, z in zip(("out", "dq", "dk", "dv"), got, ref, again):
            assert x.dtype == dtype and x.shape == y.shape, (name, label, x.dtype, x.shape, y.shape)
            assert torch.equal(x, z), f"{name} {label}: deterministic double run differs"
            if dims.ring == 1:
                assert torch.equal(x, y), f"{name} {label}: Ulysses must be bitwise, diff {_rel(x, y)}"
            else:
                abs_diff, rel_diff = _rel(x, y)
                assert rel_diff <= RING_TOL[dtype], (
                    f"{name} {label}: max abs {abs_diff:.3g} rel {rel_diff:.3g}"
                )
        if rank == 0:
            stats = " ".join(
                f"{lab}={_rel(x, y)[0]:.2e}/{_rel(x, y)[1]:.2e}"
                for lab, x, y in zip(("out", "dq", "dk", "dv"), got, ref)
            )
            print(f"[usp_attention] {name}: max abs/rel {stats}", flush=True)


def _gather_backward_body(rank, world_size):
    """gather_sequence backward = local slice of the SUM over sp of the full gradients."""
    dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size)
    mesh = build_parallel_mesh(dims, "cpu")
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    local = shard_sequence(full, 1, mesh.sp_group).requires_grad_()
    gathered = gather_sequence(local, 1, mesh.sp_group)
    assert torch.equal(gathered, full)
    grads = [torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    gathered.backward(grads[rank])
    expected = shard_sequence(sum(grads), 1, mesh.sp_group)
    torch.testing.assert_close(local.grad, expected, rtol=0, atol=1e-6)
    # output bitwise identical on every sp rank
    copies = [torch.empty_like(gathered) for _ in range(world_size)]
    dist.all_gather(copies, gathered.detach().contiguous())
    assert all(torch.equal(c, copies[0]) for c in copies)


def _one_gloo_worker_body(rank, world_size):
    """Issue 46's fix: every gloo group of an SP mesh (the world, the ring's, Ulysses', dp's) runs one
    worker thread, so no two collectives of a group finish at once in torch's racy ``runLoop``, and
    the ring's collectives are still in flight beside the attention kernel (its overlap is kept)."""
    import miles.sequence_parallel.ring as ring_mod
    from miles.parallel.gloo import gloo_worker_threads

    dims = ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=1)
    mesh = build_parallel_mesh(dims, "cpu")
    groups = {
        "world": dist.group.WORLD,
        "ring": mesh.ring_group,
        "ulysses": mesh.ulysses_group,
        "dp": mesh.dp_group,
        "sp (flattened)": mesh.sp_group,
        "fsdp (flattened)": mesh.fsdp_mesh.get_group(mesh.fsdp_mesh.ndim - 1),
    }
    threads = {name: gloo_worker_threads(group) for name, group in groups.items()}
    assert set(threads.values()) == {1}, threads
    g = torch.Generator().manual_seed(FIXED_SEEDS[2])
    q, k, v, grad_out = (torch.randn(2, 16 * world_size, 4, 16, generator=g) for _ in range(4))
    registry = torch._C._distributed_c10d._get_work_registry_size
    kernel, seen = ring_mod.CPU_RING_KERNEL, []

    def counted(fn):
        def call(*args, **kwargs):
            seen.append(registry())  # functional-collective works issued and not yet waited
            return fn(*args, **kwargs)

        return call

    ring_mod.CPU_RING_KERNEL = ring_mod.RingKernel(
        kernel.name, counted(kernel.forward), counted(kernel.backward)
    )
    try:
        _usp_run(q, k, v, grad_out, mesh)
    finally:
        ring_mod.CPU_RING_KERNEL = kernel
    assert seen and max(seen) >= 1, f"the ring had nothing in flight beside the kernel: {seen}"


def test_usp_attention_world4():
    seed = FIXED_SEEDS[0]
    bands = [(u, dtype) for u in (4, 2, 1) for dtype in DTYPES]  # u4r1, u2r2, u1r4
    run_pooled(_bands_body, 4, bands, seed)


def test_usp_attention_world2_and_gather_backward():
    seed = FIXED_SEEDS[1]
    bands = [(u, dtype) for u in (2, 1) for dtype in DTYPES]  # u2r1, u1r2
    run_pooled(_bands_body, 2, bands, seed)
    run_pooled(_gather_backward_body, 2)
    run_pooled(_one_gloo_worker_body, 2)
