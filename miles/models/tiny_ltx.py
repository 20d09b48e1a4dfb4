"""The embedded tiny LTX-Video pipeline (``ltx`` of :mod:`miles.models.tiny`): a complete diffusers
``LTXPipeline`` folder built from configs with fixed seeds, no download.

Its parts keep LTX-Video's structure at a small width: an ``LTXVideoTransformer3DModel`` with
patch size 1, 4 heads x 16 (Ulysses degrees 2 and 4 divide them; the RoPE width 64 is not a
multiple of 6, so its padding path runs) and 2 blocks; an ``AutoencoderKLLTXVideo`` with LTX's
32x spatial / 8x temporal compression and 8 latent channels; a T5 encoder with the tiny Wan's
UMT5 numbers and its byte-level tokenizer (:func:`miles.models.tiny_t2v.text_encoder_config`,
:func:`~miles.models.tiny_t2v.build_tokenizer`); the flow-matching scheduler with LTX's dynamic
(token-count) shift.
"""

from __future__ import annotations

import torch

TINY_LTX_TRANSFORMER = dict(
    in_channels=8,
    out_channels=8,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=4,
    attention_head_dim=16,
    cross_attention_dim=64,  # = heads x head_dim: the caption projection maps the text to the model width
    num_layers=2,
    caption_channels=32,  # the T5's d_model
)
TINY_LTX_VAE = dict(
    latent_channels=8,
    block_out_channels=(8, 16, 32, 32),
    decoder_block_out_channels=(8, 16, 32, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
)
# LTX-Video's scheduler (Lightricks/LTX-Video scheduler/scheduler_config.json): the shift comes
# from the token count (``LTXPipeline``'s ``calculate_shift``), not from a fixed ``shift``.
LTX_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)


def build_ltx_pipeline():
    """Construct the tiny LTXPipeline in memory with fixed seeds."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    from miles.models.tiny_t2v import build_tokenizer, text_encoder_config

    tokenizer = build_tokenizer()
    torch.manual_seed(10)
    text_encoder = T5EncoderModel(T5Config(**text_encoder_config(len(tokenizer)))).eval()
    torch.manual_seed(11)
    vae = AutoencoderKLLTXVideo(**TINY_LTX_VAE).eval()
    with torch.no_grad():  # a non-trivial latent normalisation, so that a test can see it applied
        g = torch.Generator().manual_seed(12)
        vae.latents_mean.copy_(0.1 * torch.randn(vae.latents_mean.shape, generator=g))
        vae.latents_std.copy_(0.5 + torch.rand(vae.latents_std.shape, generator=g))
    torch.manual_seed(13)
    transformer = LTXVideoTransformer3DModel(**TINY_LTX_TRANSFORMER)
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
