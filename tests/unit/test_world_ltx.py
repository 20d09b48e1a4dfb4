"""The world through the LTX-Video family (``miles/pretrain_world_ltx.py``): the VAE is LTX-Video's class
at 8x / 2x (9 x 64 x 64 -> 320 tokens of 128 channels; LTX-Video's published 32x / 8x, 8 tokens, did
not carry the world: docs/learning.md, "The LTX world"), the prior is trained through the trainer's
call of an LTX expert, the latent normalisation is the dataset's, and the recipe on the committed
pipeline dry-runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import load_tiny_ltx


@pytest.mark.parametrize(
    "scaling, ratios, latent",
    [
        (None, (2, 8), (128, 5, 8, 8)),  # the default (the committed world): 320 tokens
        ("published", (8, 32), (128, 2, 2, 2)),  # LTX-Video's 32x / 8x: 8 tokens
    ],
)
def test_the_world_vae_compression_and_token_count(scaling, ratios, latent):
    from diffusers import AutoencoderKLLTXVideo

    from miles.pretrain_world_ltx import LTX_SCALING, WORLD_LTX_VAE, PretrainLTXConfig

    cfg = PretrainLTXConfig()
    st = LTX_SCALING if scaling == "published" else cfg.vae_scaling
    vae = AutoencoderKLLTXVideo(
        **WORLD_LTX_VAE, spatio_temporal_scaling=st, decoder_spatio_temporal_scaling=st
    ).eval()
    assert (vae.temporal_compression_ratio, vae.spatial_compression_ratio) == ratios
    x = torch.zeros(1, 3, *cfg.shape)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert tuple(z.shape[1:]) == latent  # tokens at patch size 1: F x H x W
        assert tuple(vae.decode(z).sample.shape) == tuple(x.shape)


def test_the_token_count_shift_is_ltx_pipelines():
    """LTXPipeline's token-count shift exp(calculate_shift(n)) under the tiny scheduler, by hand."""
    import math

    from miles.models.tiny_ltx import LTX_SCHEDULER
    from miles.pretrain_world_ltx import flow_shift

    c = LTX_SCHEDULER
    for n in (8, 320):
        m = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
        mu = n * m + c["base_shift"] - m * c["base_image_seq_len"]
        assert flow_shift(n) == pytest.approx(math.exp(mu), rel=1e-6)
    assert flow_shift(8) == pytest.approx(1.797, abs=1e-3)


def test_routed_expert_is_the_trainers_call():
    """``flow_loss`` calls the prior as the trainer calls an LTX expert (``LTXRouting.forward``:
    packed tokens, the text's mask, the RoPE scales of the VAE's compression)."""
    from miles.pretrain_world_ltx import RoutedExpert

    model = load_tiny_ltx()
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
    its VAE's latent normalisation the encoded dataset's, evaluated at LTX's shift for 320 tokens."""
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
    assert report["vae_check"]["latent"] == [128, 5, 8, 8]
    assert report["heldout"]["shift"] == pytest.approx(flow_shift(320), abs=1e-4)
    assert report["vae_training"]["steps"] == 2 and report["prior_training"]["steps"] == 2
    assert report["heldout"]["num_samples"] == 8 and report["train"]["num_samples"] == 24
    vae = AutoencoderKLLTXVideo.from_pretrained(tmp_path / "pipeline_ltx" / "vae", torch_dtype=torch.float32)
    assert vae.latents_mean.abs().max() > 1e-3  # the defaults are 0 and 1
    assert (vae.latents_std - 1).abs().max() > 1e-3


def test_the_world_ltx_recipe_dry_runs_on_the_committed_pipeline(tmp_path, monkeypatch):
    """``configs/world_ltx_cpu.yaml`` plans on the committed LTX world (bench/learning.py's dp4): the
    family from the folder, 320 tokens, the folder's schedule; a hand-set shift is refused."""
    from miles.config import parse_args
    from miles.models.family import family_of
    from miles.train.dry_run import dry_run, format_report
    from miles.train.plan import PlanError

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    base = ["--config", "configs/world_ltx_cpu.yaml", "--run.output-dir", str(tmp_path)]
    cfg = parse_args(base)[0]
    assert family_of(repo / cfg.model.path).name == "ltx"
    report = dry_run(cfg, world_size=4, device_type="cpu", verbose=False)
    assert "at 320 tokens" in format_report(report)
    with pytest.raises(PlanError, match="an LTX-Video folder sets its own noise schedule"):
        dry_run(
            parse_args([*base, "--rollout.shift", "2.0"])[0], world_size=4, device_type="cpu", verbose=False
        )
