"""HSDP (``parallel.replicate_size``) against plain FSDP2, on the production wrapping path.

World 4 over gloo, the tiny 2-block Wan transformer, SP installed then ``apply_fsdp`` exactly as
``miles.train.parallelize`` does, over ``mesh.fsdp_mesh`` — 1-D for plain FSDP, the 2-D
``(replicate, shard)`` mesh for HSDP. Layouts at world 4: dp4 vs HSDP R=2 (shards of 2 ranks) and
R=4 (shards of one rank: DDP-like), and dp2 x sp2 vs HSDP R=2 (each shard group is one sp group).

1. Gradients: the same global batch, split by dp_rank, one backward. HSDP reduce-scatters over
   the shard group and all-reduces over the replicas; plain FSDP reduce-scatters over all ranks.
   Both take a mean over the 4 ranks, so the gradients differ only by the order of a 4-term sum:
   per element |g_hsdp - g_fsdp| <= 2 · eps32 · max|g| of the tensor (ulps of the largest
   partial). Measured at seed 173205: at most 1.09 eps32 · max|g| (printed per pair).
2. Training: 5 AdamW steps on fixed batches; the loss trajectories and the gradient norms that
   clipping sees (``clip_grad_norm_`` on the DTensors, as the trainer calls it: replicas must not
   count a shard twice) agree to rtol 1e-5 (the per-step gradient differences are ulps; Adam's
   update is sign-like, so an ulp can move an element whose gradient is rounding noise by up to
   2·lr — the loss barely sees it).
3. Checkpoints: a DCP checkpoint saved under HSDP (``miles.train.checkpoint.save_checkpoint``:
   weights + AdamW state after a step) loads under plain FSDP bitwise, and vice versa.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.train.parallelize import parallelize_expert
from tests.dist_utils import FIXED_SEEDS, run_pooled
from tests.distributed.test_grad_sync import make_batch, tiny_wan

pytestmark = pytest.mark.distributed

# (name, sequence_parallel_size, ulysses_degree, replicate_size) pairs: (plain FSDP, HSDP)
PAIRS = [
    (("dp4", 1, 1, 1), ("dp4-hsdp2", 1, 1, 2)),
    (("dp4", 1, 1, 1), ("dp4-hsdp4", 1, 1, 4)),
    (("dp2xu2", 2, 2, 1), ("dp2xu2-hsdp2", 2, 2, 2)),
]
ULPS = 2
STEPS, LR = 5, 1e-3
LOSS_RTOL = 1e-5


def _build(base, world_size: int, sp: int, ulysses: int, replicate: int):
    dims = ParallelDims(
        world_size=world_size, sequence_parallel_size=sp, ulysses_degree=ulysses, replicate_size=replicate
    )
    mesh = build_parallel_mesh(dims, "cpu")
    assert mesh.fsdp_mesh.ndim == (2 if replicate > 1 else 1)
    model = copy.deepcopy(base)
    handle = parallelize_expert(model, mesh, reduce_dtype=torch.float32)
    return dims, mesh, model, handle


def _local(inputs: dict, target: torch.Tensor, mesh, dims) -> tuple[dict, torch.Tensor]:
    n = target.shape[0] // dims.dp
    sl = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
    return {k: v[sl] for k, v in inputs.items()}, target[sl]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _run(base, world_size: int, layout: tuple, seed: int) -> tuple[dict, list[float], list[float]]:
    """First-step full gradients, and the loss (global-batch mean) and gradient norm (as
    ``Trainer._clip_grad_norm`` computes it) of each of STEPS AdamW steps."""
    _, sp, ulysses, replicate = layout
    dims, mesh, model, handle = _build(base, world_size, sp, ulysses, replicate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first_grads, losses, norms = None, [], []
    for step in range(STEPS):
        inputs, target = _local(*make_batch(seed + step), mesh, dims)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(**inputs, return_dict=False)[0], target)
        loss.backward()
        if first_grads is None:
            first_grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9, foreach=True)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # sp peers repeat their dp rank's loss: the mean over ranks is the global one
        losses.append(mean.item() / world_size)
    handle.remove()
    return first_grads, losses, norms


def _hsdp_vs_fsdp_body(rank: int, world_size: int, seed: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    base = tiny_wan()
    for plain, hsdp in PAIRS:
        grads, losses, norms = _run(base, world_size, plain, seed)
        h_grads, h_losses, h_norms = _run(base, world_size, hsdp, seed)
        # the norm of replicated shards is counted once, not once per replica
        torch.testing.assert_close(torch.tensor(h_norms), torch.tensor(norms), rtol=LOSS_RTOL, atol=0)
        worst = 0.0
        for name, g in grads.items():
            scale = g.abs().max().item() * torch.finfo(torch.float32).eps
            diff = (h_grads[name] - g).abs().max().item()
            assert diff <= ULPS * scale, f"{hsdp[0]} vs {plain[0]}: grad {name} differs by {diff:.3g}"
            worst = max(worst, diff / scale if scale else 0.0)
        assert all(g.abs().max() > 0 for g in grads.values() if g.numel() > 16)
        torch.testing.assert_close(torch.tensor(h_losses), torch.tensor(losses), rtol=LOSS_RTOL, atol=0)
        if rank == 0:
            print(
                f"[hsdp] {hsdp[0]} vs {plain[0]}: grads max diff {worst:.2f} eps32·max|g|; losses "
                f"{' '.join(f'{v:.6f}' for v in h_losses)} vs {' '.join(f'{v:.6f}' for v in losses)}",
                flush=True,
            )


def test_hsdp_gradients_and_losses_match_fsdp_world4():
    run_pooled(_hsdp_vs_fsdp_body, 4, FIXED_SEEDS[3])


def _state(model, optimizer) -> dict:
    """Every parameter and AdamW moment, full (unsharded)."""
    out = {f"w.{n}": _full(p.detach()) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{names[id(p)]}"] = _full(st[key])
    return out


def _checkpoint_body(rank: int, world_size: int, seed: int, run_dir: str) -> None:
    from pathlib import Path

    from miles.train.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(seed)
    base = tiny_wan()
    for i, (src, dst) in enumerate([(2, 1), (1, 2)]):  # HSDP -> FSDP, FSDP -> HSDP
        states = []
        for replicate in (src, dst):
            dims, mesh, model, handle = _build(base, world_size, 1, 1, replicate)
            experts = torch.nn.ModuleList([model])
            optimizer = torch.optim.AdamW(experts.parameters(), lr=LR)
            if replicate == src:  # train one step with its own data, then save
                inputs, target = _local(*make_batch(seed + 7 + i), mesh, dims)
                F.mse_loss(model(**inputs, return_dict=False)[0], target).backward()
                optimizer.step()
                path = save_checkpoint(Path(run_dir) / str(i), 1, experts, optimizer, {"step": 1}, keep=1)
            else:  # a fresh model and optimizer (get_state_dict initialises the AdamW state)
                assert load_checkpoint(path, experts, optimizer)["step"] == 1
            states.append(_state(model, optimizer))
            handle.remove()
        saved, loaded = states
        assert saved.keys() == loaded.keys() and len(saved) > 3 * len(list(base.parameters())) - 1
        for key, value in saved.items():
            assert torch.equal(value, loaded[key]), f"replicate {src} -> {dst}: {key} not bitwise equal"
        dist.barrier()


def test_dcp_checkpoint_moves_between_hsdp_and_fsdp_bitwise(tmp_path):
    run_pooled(_checkpoint_body, 4, FIXED_SEEDS[4], str(tmp_path))
