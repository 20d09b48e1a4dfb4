"""``torch.compile`` per block (``apply_fsdp(compile_blocks=True)``) computes what eager mode does.

On the production wrapping path (SP install → activation checkpointing → compile → FSDP2), the
tiny Wan is built twice from one seed, eager and compiled, and run on the same fresh random
inputs: training forward + backward (outputs and every parameter's full gradient) and a no-grad
forward (the rollout's graph). Layouts: one process (blocks bare and wrapped for selective
checkpointing, whose policy Inductor must trace through ``torch.utils.checkpoint``) and two
processes at Ulysses sp=2 (the all-to-all a custom op with its own backward: as an autograd
Function around ``dist.all_to_all_single``, torch 2.11 traced it without its backward and this
case failed there) and at ring sp=2 (graph breaks around torch's ring templates, which run
eagerly).

Tolerance (fp32 on CPU): max|a - b| <= 1e-5 · max|b| per tensor. Inductor fuses and reorders
the element-wise ops (norms, modulation, RoPE), which changes rounding only. Each case also
checks that Dynamo captured the blocks (a graph per grad mode; no graph break except on the ring
path), so that a compile that silently fell back to eager mode cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from miles.parallel.compile import resolve_compile
from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.train.parallelize import parallelize_expert
from tests.dist_utils import run_pooled
from tests.models import TINY_WAN

pytestmark = pytest.mark.distributed


def _build(mesh, mode: str, compiled: bool):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN).train()
    parallelize_expert(
        model,
        mesh,
        reduce_dtype=torch.float32,
        checkpoint_modes=[mode] * 2,
        compile_blocks=compiled,
    )
    return model


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (a - b).abs().max().item()
    assert err <= 1e-5 * b.abs().max().item() + 1e-12, (
        f"{what}: max diff {err:.3e} vs max {b.abs().max():.3e}"
    )


def _body(rank: int, world_size: int, ulysses: int, modes: list[str], graph_breaks: bool = False) -> None:
    from torch._dynamo.utils import counters

    torch.use_deterministic_algorithms(True)
    mesh = build_parallel_mesh(
        ParallelDims(world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=ulysses), "cpu"
    )
    for mode in modes:
        g = torch.Generator().manual_seed(1000 + len(mode))  # fresh inputs per case, same on every rank
        x = torch.randn(2, 4, 3, 8, 8, generator=g)
        t = torch.rand(2, generator=g) * 1000
        ctx = torch.randn(2, 7, 32, generator=g)
        target = torch.randn(2, 4, 3, 8, 8, generator=g)
        results = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            model = _build(mesh, mode, compiled)
            out = model(x, t, ctx, return_dict=False)[0]
            (out - target).square().mean().backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            model.eval()
            with torch.no_grad():
                inference = model(x, t, ctx, return_dict=False)[0]
            results[compiled] = (out.detach(), grads, inference)
            if compiled:
                assert bool(counters["graph_break"]) == graph_breaks, dict(counters["graph_break"])
                assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # train + no-grad
        (out0, grads0, inf0), (out1, grads1, inf1) = results[False], results[True]
        _close(out1, out0, f"{mode}: output")
        _close(inf1, inf0, f"{mode}: no-grad output")
        assert grads0.keys() == grads1.keys()
        for name in grads0:
            _close(grads1[name], grads0[name], f"{mode}: grad {name}")


def test_compiled_blocks_match_eager_single_process():
    run_pooled(_body, 1, 1, ["none", "selective"])


def test_compiled_blocks_match_eager_ulysses():
    run_pooled(_body, 2, 2, ["none"])


def test_compiled_blocks_match_eager_ring():
    # torch's ring templates are not traceable: Dynamo breaks the graph around them, runs them
    # eagerly, and the blocks still compute what eager mode does.
    run_pooled(_body, 2, 1, ["none"], graph_breaks=True)


def test_resolve_compile():
    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile("on", torch.device("cpu")) is True
    assert resolve_compile("off", torch.device("cuda")) is False
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_compile("yes", torch.device("cpu"))
