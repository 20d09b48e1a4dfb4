"""The world through the LTX-Video family (``miles/pretrain_world_ltx.py``): the VAE has LTX-Video's
compression (9 x 64 x 64 -> 8 tokens of 128 channels), the prior is trained through the trainer's
call of an LTX expert, and the latent normalisation is the dataset's. (The VAE check's result, that
this VAE did not learn to carry the world on the CPU budget: docs/learning.md, "The LTX world".)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

TINY_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-wan"


def test_the_world_vae_has_ltx_compression_and_8_tokens():
    from diffusers import AutoencoderKLLTXVideo

    from miles.pretrain_world_ltx import WORLD_LTX_VAE, PretrainLTXConfig, flow_shift

    cfg = PretrainLTXConfig()
    scaling = dict(spatio_temporal_scaling=cfg.vae_scaling, decoder_spatio_temporal_scaling=cfg.vae_scaling)
    vae = AutoencoderKLLTXVideo(**WORLD_LTX_VAE, **scaling).eval()
    assert (vae.temporal_compression_ratio, vae.spatial_compression_ratio) == (8, 32)
    x = torch.zeros(1, 3, *cfg.shape)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert tuple(z.shape[1:]) == (128, 2, 2, 2)  # 8 tokens at patch size 1
        assert tuple(vae.decode(z).sample.shape) == tuple(x.shape)
    # LTXPipeline's token-count shift at 8 tokens (exp(calculate_shift(8)) under the tiny scheduler)
    assert flow_shift(8) == pytest.approx(1.797, abs=1e-3)


def test_routed_expert_is_the_trainers_call():
    """``flow_loss`` calls the prior as the trainer calls an LTX expert (``LTXRouting.forward``:
    packed tokens, the text's mask, the RoPE scales of the VAE's compression)."""
    from miles.models.family import family_of
    from miles.models.tiny import tiny_model_path
    from miles.pretrain_world_ltx import RoutedExpert

    path = tiny_model_path(TINY_DIR, "ltx")
    cfg = SimpleNamespace(
        path=str(path),
        task="auto",
        text_encoder_dtype="float32",
        vae_dtype="float32",
        text_encoder_offload=False,
        vae_tiling=False,
        init="pretrained",
    )
    model = family_of(Path(path)).load(cfg, torch.device("cpu"))
    transformer = model.transformers[0]
    expert = RoutedExpert(transformer, model.pipeline.vae)
    assert expert.routing == model.routing
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 2, 3, 4, generator=g)
    text, _ = model.encode_prompts(["a big red ball moving left"] * 2, "", 64, torch.device("cpu"))
    t = torch.tensor([300.0, 800.0])
    ours = expert(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
    assert torch.equal(ours, model.routing.forward(transformer, x, t, text))
    assert not torch.equal(ours, model.routing.forward(transformer, x, t.flip(0), text))


def test_latent_buffers_normalise_the_dataset():
    from diffusers import AutoencoderKLLTXVideo

    from miles.pretrain_world_ltx import WORLD_LTX_VAE, set_latent_buffers

    vae = AutoencoderKLLTXVideo(**WORLD_LTX_VAE)
    g = torch.Generator().manual_seed(0)
    latents = 3 + 2 * torch.randn(16, 128, 2, 2, 2, generator=g)
    set_latent_buffers(vae, latents)
    z = (latents - vae.latents_mean.view(1, -1, 1, 1, 1)) / vae.latents_std.view(1, -1, 1, 1, 1)
    assert z.mean(dim=(0, 2, 3, 4)).abs().max() < 1e-5
    assert (z.std(dim=(0, 2, 3, 4)) - 1).abs().max() < 1e-5
