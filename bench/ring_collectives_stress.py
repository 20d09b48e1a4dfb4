"""The ring templates' in-flight collectives, alone, in a loop: results checked, heap checks on.

    torchrun --standalone --nproc-per-node 4 bench/ring_collectives_stress.py --out runs/ring_coll.json
    LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 torchrun ... (the same)

With ring > 1 the only asynchronous collectives of a run are those of torch's ring templates
(``miles/sequence_parallel/ring.py``): in the backward, the K/V all-gather and the dK/dV permute
(an uneven all-to-all) are in flight on one gloo group at once, their inputs temporaries that
Python drops as soon as they are issued. This loop issues exactly that on the ring groups of u2r2
({0, 2} and {1, 3} of 4 ranks): two all-gathers and a permute of tcache-sized tensors (the sizes
vary every iteration), the inputs dropped at once, a matmul on the main thread and a thread
allocating and freeing small tensors beside, then waits and compares every result with its
expected value. Run it under ``MALLOC_CHECK_``/``MALLOC_PERTURB_`` or ASan (as above): a use after
free in these paths shows as a wrong value, a heap-check abort or an ASan report.

Rank 0 writes ``--out`` (JSON): iterations, wrong results (summed over ranks), seconds, the
environment's heap-check variables.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as ft_c

HEAP_CHECKS = ("LD_PRELOAD", "MALLOC_CHECK_", "MALLOC_PERTURB_")


def _allocate(stop: threading.Event) -> None:
    while not stop.is_set():
        blocks = [torch.empty(int(n)).fill_(1.0) for n in torch.randint(1, 250, (16,))]
        del blocks


@contextlib.contextmanager
def allocating_beside():
    """A thread allocating and freeing small tensors for the block (the reward worker's part)."""
    stop = threading.Event()
    beside = threading.Thread(target=_allocate, args=(stop,), daemon=True)
    beside.start()
    try:
        yield
    finally:
        stop.set()
        beside.join()


def ring_world() -> tuple[int, dist.ProcessGroup]:
    """gloo on 4 ranks (faulthandler on every thread): (rank, this rank's ring group of u2r2, {0, 2}
    or {1, 3})."""
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run with 4 processes (the ring groups of u2r2)")
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rank, rings[rank % 2]


def report(name: str, out: Path, result: dict) -> None:
    """Sum ``result["wrong_results"]`` (this rank's) over the ranks; rank 0 writes ``out`` (``result``
    with the sum, the heap checks of the environment) and prints it."""
    total = torch.tensor([result["wrong_results"]])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        env = {k: os.environ[k] for k in HEAP_CHECKS if k in os.environ}
        result = {**result, "wrong_results": int(total)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "env": env}, indent=2) + "\n")
        print(f"[{name}] {result}", flush=True)


def _iteration(it: int, group: dist.ProcessGroup, gen: torch.Generator) -> bool:
    """One round of the backward's pattern; True when every result is right."""
    me, other = dist.get_rank(group), 1 - dist.get_rank(group)
    n1, n2 = (int(v) for v in torch.randint(1, 200, (2,), generator=gen))
    a = torch.full((n1,), float(me * 1000 + it))
    b = torch.full((n2,), float(me * 1000 + it) + 0.5)
    gathered = ft_c.all_gather_single(torch.cat([a, a]), gather_dim=0, group=group)
    permuted = ft_c.permute_tensor(torch.cat([b, b]), [1, 0], group)
    doubled = ft_c.all_gather_single(a * 2, gather_dim=0, group=group)
    del a, b
    torch.randn(64, 64) @ torch.randn(64, 64)  # the main thread computes while they are in flight
    gathered, permuted, doubled = (t.wait() for t in (gathered, permuted, doubled))
    return (
        torch.equal(gathered, torch.cat([torch.full((2 * n1,), float(r * 1000 + it)) for r in range(2)]))
        and torch.equal(permuted, torch.full((2 * n2,), float(other * 1000 + it) + 0.5))
        and torch.equal(doubled, torch.cat([torch.full((n1,), 2.0 * (r * 1000 + it)) for r in range(2)]))
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    p.add_argument("--iterations", type=int, default=3000)
    args = p.parse_args()
    _, group = ring_world()
    with allocating_beside():
        gen = torch.Generator().manual_seed(1234)  # the same sizes on every rank
        t0 = time.perf_counter()
        wrong = sum(not _iteration(it, group, gen) for it in range(args.iterations))
        seconds = time.perf_counter() - t0
    result = {"iterations": args.iterations, "wrong_results": wrong, "seconds": round(seconds, 1)}
    report("ring_collectives_stress", args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As train_grpo.py: no interpreter finalization with gloo's worker threads still holding the ring
    # groups' tensors (pytorch/pytorch#179291).
    os._exit(0)
