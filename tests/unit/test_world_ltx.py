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


def test_pretraining_writes_an_ltx_pipeline_the_family_loads(tmp_path):
    """The whole pretraining at a few steps: an ``LTXPipeline`` folder that the family seam loads,
    its VAE's latent normalisation the encoded dataset's, evaluated at LTX's shift for 8 tokens."""
    from diffusers import AutoencoderKLLTXVideo

    from miles.models.family import family_of
    from miles.pretrain_world_ltx import PretrainLTXConfig, flow_shift, pretrain

    cfg = PretrainLTXConfig(
        vae_steps=2,
        vae_crop_steps=1,
        dit_steps=2,
        videos_per_prompt=1,
        vae_pool_per_prompt=1,
        eval_seeds_heldout=1,
        eval_seeds_train=1,
        num_threads=1,
    )
    report = pretrain(tmp_path / "pipeline_ltx", cfg)
    assert family_of(tmp_path / "pipeline_ltx").name == "ltx"
    assert report["vae_check"]["latent"] == [128, 2, 2, 2]
    assert report["heldout"]["shift"] == pytest.approx(flow_shift(8), abs=1e-4)
    assert report["heldout"]["num_samples"] == 8 and report["train"]["num_samples"] == 24
    vae = AutoencoderKLLTXVideo.from_pretrained(tmp_path / "pipeline_ltx" / "vae", torch_dtype=torch.float32)
    assert vae.latents_mean.abs().max() > 1e-3  # the defaults are 0 and 1
    assert (vae.latents_std - 1).abs().max() > 1e-3
