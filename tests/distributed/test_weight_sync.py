"""Weight-sync parity: after an optimizer step, the weights the rollout uses are bitwise the trained weights.

The trainer samples inside ``miles.parallel.fsdp.unsharded_for_rollout``, which unshards every
FSDP module once for the whole rollout instead of all-gathering per block per denoising step.
Per layout (the six of test_grad_sync: dp4, dp2 x u2, dp2 x r2, u4r1, u2r2, u1r4, in one world-4
spawn), on a model parallelised as in the trainer (SP install → ``apply_fsdp``), after one
forward/backward/AdamW step on random data (a fixed seed):

- inside the context, every parameter of the FSDP modules is a plain (unsharded) tensor whose
  checksum — sha256 of dtype, shape and raw bytes — equals that of the trained weight
  (``full_tensor()`` of the sharded parameter after the step, cast to FSDP's ``param_dtype``
  when mixed precision is on, i.e. exactly what the training forward computes with);
- it stays unsharded across several forwards (no per-forward reshard), and on exit every
  parameter is sharded again with its checksum unchanged;
- a no-grad forward inside the context is bitwise equal to the same forward without it, and
  to a second forward inside it.

Also one mixed-precision layout (u2r2, fp32 master weights, bf16 ``param_dtype``: the GPU
production setting), where the rollout's weights must be the bf16 casts of the trained weights.
Tolerance: none — everything here is bitwise.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from miles.parallel.fsdp import unsharded_for_rollout
from tests.dist_utils import FIXED_SEEDS, run_pooled
from tests.distributed.test_grad_sync import (
    LAYOUTS,
    build_layout,
    local_slice,
    make_batch,
    make_optimizer,
    tiny_wan,
)

pytestmark = pytest.mark.distributed

# the six fp32 layouts, plus u2r2 with bf16 compute over fp32 master weights
CASES = [(name, sp, u, None) for name, sp, u in LAYOUTS] + [("u2r2-bf16", 4, 2, torch.bfloat16)]


def checksum(t: torch.Tensor) -> str:
    """sha256 of dtype, shape and raw bytes: differs for a cast, a reshape or any bit."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    # clone: a numpy view would pin the storage, and FSDP frees unsharded storage on reshard
    h.update(t.detach().reshape(-1).view(torch.uint8).clone().numpy().tobytes())
    return h.hexdigest()


CAST = ("hidden_states", "encoder_hidden_states")


def _kept_fp32(model, name: str) -> bool:
    """Outside the blocks, a parameter diffusers keeps in fp32 (``_keep_in_fp32_modules``)."""
    return not name.startswith("blocks.") and bool(set(name.split(".")) & set(model._keep_in_fp32_modules))


def _forward(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].clone()


def _weight_sync_body(rank: int, world_size: int, seed: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    base = tiny_wan()
    inputs, target = make_batch(seed + 1)
    probe, _ = make_batch(seed + 2)  # the "rollout" inputs, other than the training batch

    for name, sp, ulysses, param_dtype in CASES:
        dims, mesh, model, handle = build_layout(base, world_size, sp, ulysses, param_dtype)
        local_inputs, local_target = local_slice(inputs, target, mesh.dp_rank, dims.dp)
        local_probe, _ = local_slice(probe, target, mesh.dp_rank, dims.dp)
        compute_dtype = param_dtype or torch.float32
        # As the trainer passes them: latents and text in the compute dtype, the timestep as is.
        local_inputs, local_probe = (
            {k: v.to(compute_dtype) if k in CAST else v for k, v in d.items()}
            for d in (local_inputs, local_probe)
        )
        out = model(**local_inputs, return_dict=False)[0]
        F.mse_loss(out.float(), local_target).backward()
        make_optimizer(model.parameters()).step()
        model.zero_grad(set_to_none=True)

        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values()), f"{name}: parameters are not sharded"
        # diffusers' fp32-kept parameters outside the blocks stay fp32 (miles.parallel.fsdp)
        dtypes = {n: torch.float32 if _kept_fp32(model, n) else compute_dtype for n in params}
        trained = {n: checksum(p.full_tensor().to(dtypes[n])) for n, p in params.items()}
        master = {n: checksum(p.full_tensor()) for n, p in params.items()}
        shapes = {n: p.shape for n, p in params.items()}
        plain = _forward(model, local_probe)

        with unsharded_for_rollout([model]):
            for i in range(2):  # stays unsharded across forwards, as over a rollout's denoising steps
                rollout_params = dict(model.named_parameters())
                assert rollout_params.keys() == trained.keys(), f"{name}: parameter names changed"
                for n, p in rollout_params.items():
                    assert not isinstance(p, DTensor), (
                        f"{name}: {n} is still sharded in the rollout (pass {i})"
                    )
                    assert p.shape == shapes[n] and p.dtype == dtypes[n], (
                        f"{name}: {n} is {tuple(p.shape)} {p.dtype} in the rollout, trained "
                        f"{tuple(shapes[n])} {dtypes[n]}"
                    )
                    assert checksum(p) == trained[n], (
                        f"{name}: rollout weight {n} differs from the trained weight"
                    )
                rolled = _forward(model, local_probe)
                assert torch.equal(rolled, plain), (
                    f"{name}: rollout forward differs from the sharded forward (pass {i}), max abs diff "
                    f"{(rolled.float() - plain.float()).abs().max().item():.3g}"
                )
        after = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in after.values()), f"{name}: not resharded after the rollout"
        assert {n: checksum(p.full_tensor()) for n, p in after.items()} == master, f"{name}: weights changed"
        assert torch.equal(_forward(model, local_probe), plain), f"{name}: forward changed after the rollout"
        handle.remove()

        # The sp peers of a dp rank see the same rollout output (they share the samples).
        copies = [torch.empty_like(plain) for _ in range(world_size)]
        dist.all_gather(copies, plain)
        peers = [copies[r] for r in range(world_size) if r // dims.sp == mesh.dp_rank]
        assert all(torch.equal(c, plain) for c in peers), f"{name}: sp peers' rollout outputs differ"
        if rank == 0:
            print(
                f"[weight_sync] {name} (dp{dims.dp} x u{dims.ulysses}r{dims.ring}, compute {compute_dtype}) "
                f"seed={seed}: {len(trained)} tensors bitwise, rollout forward bitwise",
                flush=True,
            )


def test_weight_sync_parity_world4():
    run_pooled(_weight_sync_body, 4, FIXED_SEEDS[3])
