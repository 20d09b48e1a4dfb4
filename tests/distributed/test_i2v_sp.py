"""Image-to-video under sequence parallelism: the conditioned, guided velocity at sp = 2 vs sp = 1.

The tiny I2V models (Wan2.1-I2V, Wan2.2-I2V-A14B and TI2V-5B layouts) run ``predict_velocity``
with the image condition and CFG — the very call of rollout and training — once as stock models
and once with SP installed (Ulysses u2r1 and ring u1r2, gloo, fp32). The condition enters before
the shard boundary (the 36-channel concatenation and TI2V's clean first frame act on the latent
video, before patchify; TI2V's per-token timesteps, 0 on the first frame, are sharded with the
tokens) and Wan2.1-I2V's image embeddings go through the stock cross-attention (replicated K/V).
9 frames at 48x48 are 3 x 3 x 3 = 27 tokens: sp 2 pads them to 28, and the first frame's 9
tokens lie on rank 0. Both experts of the two-expert model are exercised (t = 950 and 300).

Tolerances as ``test_usp_model.py``: Ulysses output bitwise, ring output max|diff| / max|ref|
<= 1e-5; weight gradients, averaged over the sp group, within 5e-5 of the stock ones (summation
order over the split token axis); the attention key biases, whose exact gradient is 0 (softmax is
shift-invariant), within 5e-5 of the largest gradient (both runs hold only rounding noise there).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config import ModelConfig
from miles.models.tiny import tiny_model_path
from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.rollout.sampler import predict_velocity
from miles.sequence_parallel import apply_sequence_parallel
from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

VARIANTS = ("i2v", "i2v_two_expert", "ti2v")
FRAMES, SIZE = 9, 48
OUT_RING_TOL, GRAD_TOL = 1e-5, 5e-5


def _velocity_and_grads(transformers, x, t, pos, neg, condition, weight, model):
    for m in transformers:
        m.zero_grad(set_to_none=True)
    scales = [4.0] * len(transformers)
    v = predict_velocity(transformers, x, t, pos, neg, scales, model.routing, condition)
    (v * weight).sum().backward()
    grads = {
        f"{i}.{n}": p.grad.clone()
        for i, m in enumerate(transformers)
        for n, p in m.named_parameters()
        if p.grad is not None
    }
    return v.detach(), grads


def _body(rank, world_size, root):
    from miles.models.wan import load_wan

    torch.use_deterministic_algorithms(True)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 56, 3), dtype=np.uint8))
    for variant in VARIANTS:
        model = load_wan(
            ModelConfig(tiny_variant=variant, tiny_model_dir=root, task="i2v"), torch.device("cpu")
        )
        shape = model.latent_shape(FRAMES, SIZE, SIZE)
        condition = model.encode_images([image, image], FRAMES, SIZE, SIZE, "cpu")
        pos, neg = model.encode_prompts(["a red ball", "a blue ball"], "", 512, "cpu")
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, *shape, generator=g)
        weight = torch.randn(2, *shape, generator=g)
        for t in (950.0, 300.0):
            t = torch.tensor(t)
            ref_v, ref_grads = _velocity_and_grads(
                model.transformers, x, t, pos, neg, condition, weight, model
            )
            for u in (2, 1):
                dims = ParallelDims(
                    world_size=world_size, sequence_parallel_size=world_size, ulysses_degree=u
                )
                mesh = build_parallel_mesh(dims, "cpu")
                experts = [copy.deepcopy(m) for m in model.transformers]
                handles = [apply_sequence_parallel(m, mesh) for m in experts]
                v, grads = _velocity_and_grads(experts, x, t, pos, neg, condition, weight, model)
                for h in handles:
                    h.remove()
                name = f"{variant} t={float(t)} u{dims.ulysses}r{dims.ring}"
                diff = (v - ref_v).abs().max().item()
                if dims.ring == 1:
                    assert torch.equal(v, ref_v), f"{name}: Ulysses velocity must be bitwise, diff {diff}"
                else:
                    assert diff <= OUT_RING_TOL * ref_v.abs().max().item(), f"{name}: velocity diff {diff}"
                assert grads.keys() == ref_grads.keys(), f"{name}: other parameters got gradients"
                scale = max(gr.abs().max().item() for gr in ref_grads.values())
                for pname, grad in grads.items():
                    torch.distributed.all_reduce(grad)
                    grad /= world_size
                    err = (grad - ref_grads[pname]).abs().max().item()
                    ref_max = ref_grads[pname].abs().max().item()
                    # A key bias shifts every logit of a query alike: softmax ignores it, so its exact
                    # gradient is 0 and both runs hold rounding noise of the summed terms (scale).
                    bound = scale if pname.endswith("to_k.bias") else ref_max + 1e-2 * scale
                    assert err <= GRAD_TOL * bound, f"{name}: grad {pname} diff {err:.3g}"
                if rank == 0:
                    print(f"[i2v_sp] {name}: velocity max abs diff {diff:.2e}", flush=True)


def test_i2v_velocity_and_gradients_sp2_match_sp1():
    root = ".cache/tiny-wan"
    for variant in VARIANTS:  # built here, not by two ranks at once
        tiny_model_path(root, variant)
    run_pooled(_body, 2, root)
