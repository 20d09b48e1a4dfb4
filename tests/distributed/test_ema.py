"""The EMA of the weights (``train.ema_decay``) under FSDP2: the float64 recursion, checkpointed
and restored across a world-size change, applied and removed bit for bit.

Two gloo ranks shard a tiny Wan with ``apply_fsdp``; three AdamW steps on random losses, each
followed by ``EMA.update``. After every step each rank gathers the full weights, so the test keeps
the reference e ← decay·e + (1 − decay)·w in float64 on the full tensors and compares it with
the gathered EMA. Then the EMA is saved with ``save_checkpoint`` and loaded into a fresh model and
EMA on one rank (another layout), and ``applied()`` puts the EMA into the parameters and restores
the trained values exactly.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miles.parallel.fsdp import apply_fsdp
from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.train.checkpoint import has_ema, load_checkpoint, save_checkpoint
from miles.train.ema import EMA
from tests.dist_utils import run_pooled
from tests.models import TINY_WAN

pytestmark = pytest.mark.distributed
DECAY = 0.9


def _model(world_size: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN)
    mesh = build_parallel_mesh(ParallelDims(world_size=world_size, sequence_parallel_size=1), "cpu")
    apply_fsdp(model, mesh.fsdp_mesh)
    experts = nn.ModuleList([model])
    return experts, torch.optim.AdamW(experts.parameters(), lr=1e-2)


def _full(experts) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().double() for n, p in experts.named_parameters()}


def _save_body(rank: int, world_size: int, folder: str) -> None:
    experts, opt = _model(world_size)
    ema = EMA(experts.named_parameters(), DECAY)
    ref = _full(experts)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(1, 4, 2, 8, 8, generator=g)
        out = experts[0](x, torch.tensor([500.0]), torch.randn(1, 8, 32, generator=g), return_dict=False)[0]
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        ref = {n: DECAY * ref[n] + (1 - DECAY) * w for n, w in _full(experts).items()}
    got = {n: t.full_tensor().double() for n, t in ema.state_dict().items()}
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7, msg=n)
    trained = _full(experts)
    with ema.applied():
        assert all(torch.equal(w, got[n]) for n, w in _full(experts).items())  # fp32 EMA in place
    assert all(torch.equal(w, trained[n]) for n, w in _full(experts).items())  # restored exactly
    save_checkpoint(Path(folder), 3, experts, opt, {"step": 3}, keep=1, ema=ema)
    if rank == 0:
        torch.save({n: t.float() for n, t in got.items()}, Path(folder) / "ema_ref.pt")


def _load_body(rank: int, world_size: int, folder: str) -> None:
    experts, opt = _model(world_size)
    ema = EMA(experts.named_parameters(), DECAY)
    path = Path(folder) / "checkpoints" / "step_000003"
    assert has_ema(path)
    load_checkpoint(path, experts, opt, ema=ema)
    want = torch.load(Path(folder) / "ema_ref.pt")
    for n, t in ema.state_dict().items():
        assert torch.equal(t.full_tensor(), want[n]), n
    dist.barrier()


def test_ema_under_fsdp_checkpointed_across_layouts():
    with tempfile.TemporaryDirectory() as folder:
        run_pooled(_save_body, 2, folder)
        run_pooled(_load_body, 1, folder)


def test_ema_decay_is_validated():
    with pytest.raises(ValueError, match="ema_decay"):
        EMA([("w", nn.Parameter(torch.zeros(2)))], 1.0)
