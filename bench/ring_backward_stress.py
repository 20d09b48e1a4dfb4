"""Ring attention forward and backward, alone, in a loop on u2r2's ring groups: results checked, heap checks on.

    torchrun --standalone --nproc-per-node 4 bench/ring_backward_stress.py --out runs/ring_bwd.json
    MALLOC_PERTURB_=165 torchrun ... (the same; sp_stress's --check perturb)

Issue 46's crash was reproduced by ``bench/sp_stress.py`` (u2r2, ``MALLOC_PERTURB_``): one rank
aborted with ``malloc(): unaligned tcache chunk detected`` in the ring attention backward
(``miles/sequence_parallel/ring.py``), waiting for the last dK/dV permute of torch's ring template.
This loop runs exactly that — :func:`miles.sequence_parallel.ring.ring_attention` on the ring
groups of u2r2 ({0, 2} and {1, 3} of 4 ranks), forward and backward, at the tiny band model's
attention shapes — with a thread allocating beside (the reward worker's part), and checks every
iteration's output and gradients against the first iteration's (the inputs are the same each time:
any difference is memory read after it was freed or overwritten). ``--variant``:

- ``as_is``: the ring as the trainer runs it;
- ``math``: the same ring with its per-step kernel replaced by a plain-torch attention (no fused
  CPU kernel), to tell a kernel's out-of-bounds write from a collective's.

``--with-others`` adds, around each iteration, what else a u2r2 training step runs on other groups:
an FSDP-like all-gather and reduce-scatter on all 4 ranks and the Ulysses all-to-alls on {0, 1} and
{2, 3} (their results checked too).

Rank 0 writes ``--out`` (JSON): iterations, wrong results (summed over ranks), seconds, the heap
checks of the environment. A heap-check abort ends the launch instead (its exit code).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ring_collectives_stress import allocating_beside, report, ring_world  # noqa: E402


def _math_kernel():
    from miles.sequence_parallel import ring

    def forward(query, key, value, *, is_causal, scale):
        s = (query @ key.transpose(-1, -2)) * (scale or query.shape[-1] ** -0.5)
        lse = torch.logsumexp(s, dim=-1)
        return torch.softmax(s, dim=-1) @ value, lse, {}

    def backward(*, grad_out, query, key, value, out, logsumexp, is_causal, scale):
        sc = scale or query.shape[-1] ** -0.5
        p = torch.exp((query @ key.transpose(-1, -2)) * sc - logsumexp.unsqueeze(-1))
        dv = p.transpose(-1, -2) @ grad_out
        dp = grad_out @ value.transpose(-1, -2)
        ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
        return ds @ key * sc, ds.transpose(-1, -2) @ query * sc, dv

    return ring.RingKernel("math", forward, backward)


def _others(it: int, ulysses: dist.ProcessGroup) -> bool:
    """An FSDP-like all-gather and reduce-scatter on every rank and a Ulysses all-to-all; True when right."""
    rank = dist.get_rank()
    n = 37 + it % 29
    shard = torch.full((n,), float(rank + it))
    full = torch.empty(4 * n)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, shard)  # FSDP2's
    ok = torch.equal(full, torch.cat([torch.full((n,), float(r + it)) for r in range(4)]))
    reduced = torch.empty(n)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(reduced, torch.ones(4 * n))
    ok &= torch.equal(reduced, torch.full((n,), 4.0))
    sent = torch.arange(2 * n, dtype=torch.float32) + 1000 * rank
    got = torch.empty(2 * n)
    dist.all_to_all_single(got, sent, group=ulysses)
    me = dist.get_rank(ulysses)
    peers = dist.get_process_group_ranks(ulysses)
    want = torch.cat([torch.arange(me * n, (me + 1) * n, dtype=torch.float32) + 1000 * r for r in peers])
    return bool(ok and torch.equal(got, want))


def main() -> None:
    from miles.sequence_parallel import ring

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    p.add_argument("--iterations", type=int, default=5000)
    p.add_argument("--variant", choices=("as_is", "math"), default="as_is")
    p.add_argument("--shape", default="2,16,2,16", help="B,n,H,D of each rank's queries (ring rank's tokens)")
    p.add_argument("--with-others", action="store_true", help="FSDP-like and Ulysses collectives around each")
    args = p.parse_args()
    rank, group = ring_world()
    ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    if args.variant == "math":
        kernel = _math_kernel()
        ring.select_ring_kernel = lambda backend, device: kernel
    b, n, h, d = (int(v) for v in args.shape.split(","))
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    grad = torch.randn(b, n, h, d, generator=gen)
    with allocating_beside():
        reference = None
        wrong = 0
        t0 = time.perf_counter()
        for it in range(args.iterations):
            if args.with_others:
                wrong += not _others(it, ulysses)
            qi, ki, vi = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = ring.ring_attention(qi, ki, vi, group)
            out.backward(grad)
            result = (out.detach(), qi.grad, ki.grad, vi.grad)
            if reference is None:
                reference = result
            else:
                wrong += not all(torch.equal(a, r) for a, r in zip(result, reference))
        seconds = time.perf_counter() - t0
    result = {
        "variant": args.variant,
        "with_others": args.with_others,
        "shape_BnHD": [b, n, h, d],
        "iterations": args.iterations,
        "wrong_results": wrong,
        "seconds": round(seconds, 1),
    }
    report("ring_backward_stress", args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as train_grpo.py (pytorch/pytorch#179291)
