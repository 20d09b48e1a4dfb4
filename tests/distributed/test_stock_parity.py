"""The trainer's model is the stock model: bf16 compute under FSDP2 (with SP) gives bitwise the
output of ``WanTransformer3DModel.from_pretrained(..., dtype=bf16)`` called as ``WanPipeline`` calls
it — latents and text embeddings in bf16, the timestep in fp32 — at arbitrary fp32 timesteps.

The trainer builds its model from fp32 master weights, installs SP, shards it with
``apply_fsdp(param_dtype=bf16)`` and calls it through ``predict_velocity`` with fp32 latents, fp32
text embeddings and an fp32 timestep. FSDP2's default mixed-precision policy would cast every
floating forward input to bf16 — the timestep (937.7 → 938: bf16 values are 4 apart in [512,
1024)) and the fp32 RoPE tables — and its bf16 units would compute Wan's ``time_embedder`` in bf16,
which ``from_pretrained`` keeps in fp32; each of those changes the output.

The fp32-kept parameters that sit inside a bf16 FSDP unit (``scale_shift_table``, the blocks'
``norm2``) are computed from their bf16 cast; this test gives them bf16-exact values so that it
isolates how inputs and the fp32 units are handled (docs/validation.md gives the size of the
remaining difference for fp32 checkpoints). Layouts: dp2 (sp = 1) and sp2 (Ulysses 2), 2 ranks.
Timesteps: 1-D (Wan2.1 / A14B) and per-token 2-D (Wan2.2 TI2V's ``expand_timesteps``).

LTX-Video (the second family): its expert called through the family's ``routing.forward`` (latent
packed into tokens, the text's mask from its last channel) under its family SP plan is bitwise the
stock ``LTXVideoTransformer3DModel`` called as ``LTXPipeline`` calls it, in bf16; its fp32
gradients equal the stock model's within the SP parity bound (dp2: the rounding of FSDP's
weight-gradient matmul only).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from miles.models.tiny import TINY_TRANSFORMER
from miles.models.wan import WanRouting
from miles.parallel.topology import ParallelDims, build_parallel_mesh
from miles.rollout.sampler import predict_velocity
from miles.train.parallelize import parallelize_expert
from tests.dist_utils import run_pooled
from tests.models import TINY_LTX

pytestmark = pytest.mark.distributed

BF16 = torch.bfloat16
# fp32 timesteps that bf16 cannot hold (and 936, which it can)
TIMESTEPS = [937.7, 999.0, 612.3, 55.55, 0.8, 936.0]


def _fp32_checkpoint(folder: str, seed: int) -> None:
    """A tiny fp32 Wan transformer saved as a diffusers folder, as a checkpoint would be."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**TINY_TRANSFORMER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)  # no zero-initialised tensors: every input matters
            if "scale_shift_table" in name or ".norm2." in name:
                p.copy_(p.to(BF16).float())  # bf16-exact: FSDP's bf16 unit holds them unchanged
    model.save_pretrained(folder, safe_serialization=True)


def _body(rank: int, world_size: int, folder: str, seed: int) -> None:
    from diffusers import WanTransformer3DModel

    torch.use_deterministic_algorithms(True)
    stock = WanTransformer3DModel.from_pretrained(folder, dtype=BF16).eval()
    assert stock.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, 2, 8, 8, generator=g)  # fp32, as the sampler holds them
    text = torch.randn(1, 12, TINY_TRANSFORMER["text_dim"], generator=g)  # fp32 text-encoder output
    num_tokens = 2 * 4 * 4
    per_token = torch.rand(1, num_tokens, generator=g) * 1000  # arbitrary fp32 per-token timesteps

    for name, sp in (("dp2", 1), ("sp2-ulysses2", 2)):
        mesh = build_parallel_mesh(
            ParallelDims(world_size=world_size, sequence_parallel_size=sp, ulysses_degree=sp), "cpu"
        )
        model = WanTransformer3DModel.from_pretrained(folder, dtype=torch.float32).eval()
        parallelize_expert(model, mesh, param_dtype=BF16, reduce_dtype=torch.float32)
        with torch.no_grad():
            for t in TIMESTEPS:
                t32 = torch.tensor(t, dtype=torch.float32)
                for expand in (False, True):
                    got = predict_velocity([model], latents, t32, text, None, 1.0, WanRouting(None, expand))
                    ts = t32.expand(1) if not expand else t32.expand(1, num_tokens)
                    want = stock(latents.to(BF16), ts, text.to(BF16), return_dict=False)[0].float()
                    diff = (got - want).abs().max().item()
                    assert torch.equal(got, want), f"{name} t={t} 2-D={expand}: max diff {diff:.3g}"
            got = model(latents.to(BF16), per_token, text.to(BF16), return_dict=False)[0]
            want = stock(latents.to(BF16), per_token, text.to(BF16), return_dict=False)[0]
            assert torch.equal(got, want), f"{name} per-token timesteps: max diff {(got - want).abs().max()}"
        if rank == 0:
            print(f"[stock parity] {name}: bitwise at t = {TIMESTEPS} (1-D and 2-D)", flush=True)


def test_trainer_model_is_bitwise_the_stock_bf16_model():
    seed = 1234  # fixed: a failure reproduces
    with tempfile.TemporaryDirectory() as folder:
        _fp32_checkpoint(folder, seed)
        run_pooled(_body, 2, folder, seed)


# --- LTX-Video: the family's call (packed latent, text mask, RoPE scale) through the seam ----------


def _ltx_checkpoint(folder: str, seed: int) -> None:
    """The tiny fp32 LTX-Video transformer saved as a diffusers folder, every tensor perturbed."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(**TINY_LTX)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)


def _ltx_stock_call(stock, latents, t, embeds, mask, routing):
    """``stock`` called as ``LTXPipeline`` calls it (packed latents, mask, the latent's size)."""
    from diffusers import LTXPipeline

    _, _, f, h, w = latents.shape
    out = stock(
        hidden_states=LTXPipeline._pack_latents(latents).contiguous(),  # as after a scheduler step
        encoder_hidden_states=embeds,
        timestep=t,
        encoder_attention_mask=mask,
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=routing.rope_interpolation_scale,
        return_dict=False,
    )[0]
    return LTXPipeline._unpack_latents(out, f, h, w)


def _ltx_body(rank: int, world_size: int, folder: str, seed: int) -> None:
    """Outputs in bf16 (bitwise) and fp32 gradients (dp2 bitwise, sp2 within the SP bound) of the
    trainer's LTX expert (family SP plan, FSDP2) through ``predict_velocity`` vs the stock model."""
    from diffusers import LTXVideoTransformer3DModel

    from miles.models.ltx import LTXRouting, pack_text
    from miles.models.ltx_sp import ltx_sequence_parallel_plan

    torch.use_deterministic_algorithms(True)
    routing = LTXRouting((8 / 25, 32.0, 32.0))
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, TINY_LTX["in_channels"], 3, 3, 2, generator=g)  # 18 tokens: 9 per sp rank
    embeds = torch.randn(1, 10, TINY_LTX["caption_channels"], generator=g)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[:, 6:] = False  # 4 padding tokens: the mask changes the output
    text = pack_text(embeds, mask)
    weight = torch.randn(latents.shape, generator=g)
    stock = LTXVideoTransformer3DModel.from_pretrained(folder, dtype=BF16).eval()
    stock32 = LTXVideoTransformer3DModel.from_pretrained(folder, dtype=torch.float32)
    t_grad = torch.tensor(612.3)
    (_ltx_stock_call(stock32, latents, t_grad.expand(1), embeds, mask, routing) * weight).sum().backward()
    want_grads = {n: p.grad for n, p in stock32.named_parameters()}
    unmasked = _ltx_stock_call(stock, latents.to(BF16), t_grad.expand(1), embeds.to(BF16), None, routing)

    for name, sp in (("dp2", 1), ("sp2-ulysses2", 2)):
        mesh = build_parallel_mesh(
            ParallelDims(world_size=world_size, sequence_parallel_size=sp, ulysses_degree=sp), "cpu"
        )
        for dtype in (BF16, None):
            model = LTXVideoTransformer3DModel.from_pretrained(folder, dtype=torch.float32)
            plan = ltx_sequence_parallel_plan(model) if sp > 1 else None
            parallelize_expert(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32, sp_plan=plan)
            if dtype is BF16:
                with torch.no_grad():
                    for t in TIMESTEPS:
                        t32 = torch.tensor(t, dtype=torch.float32)
                        got = predict_velocity([model], latents, t32, text, None, 1.0, routing)
                        want = _ltx_stock_call(
                            stock, latents.to(BF16), t32.expand(1), embeds.to(BF16), mask, routing
                        ).float()
                        diff = (got - want).abs().max().item()
                        assert torch.equal(got, want), f"ltx {name} t={t}: max diff {diff:.3g}"
                        if t == 612.3:
                            assert not torch.equal(got, unmasked.float()), "the text mask changed nothing"
                continue
            v = predict_velocity([model], latents, t_grad, text, None, 1.0, routing)
            (v * weight).sum().backward()
            scale, worst = max(w.abs().max().item() for w in want_grads.values()), 0.0
            for pname, p in model.named_parameters():
                # FSDP2 computes dW = xᵀ·dy on its own storage and means the dp ranks' (equal)
                # gradients: equal up to the summation order; with sp the token axis is split too
                # (the SP parity bound of tests/distributed/test_usp_model.py)
                got, want = p.grad.full_tensor(), want_grads[pname]
                bound = 5e-5 * (want.abs().max().item() + 1e-2 * scale)
                diff = (got - want).abs().max().item()
                assert diff <= bound, f"ltx {name} grad {pname}: {diff:.3g} > {bound:.3g}"
                worst = max(worst, diff / max(want.abs().max().item(), 1e-2 * scale))
        if rank == 0:
            print(
                f"[stock parity] ltx {name}: bf16 outputs bitwise at t = {TIMESTEPS}; grads rel {worst:.1e}"
            )


def test_trainer_ltx_model_is_the_stock_model():
    seed = 4321
    with tempfile.TemporaryDirectory() as folder:
        _ltx_checkpoint(folder, seed)
        run_pooled(_ltx_body, 2, folder, seed)
