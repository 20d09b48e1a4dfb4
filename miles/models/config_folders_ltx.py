"""Config-only diffusers LTX-Video folders (``LTXPipeline``) at the published sizes, written by
:mod:`miles.models.config_folders` (``ltx-video-2b``, ``ltx-video-13b``): what the dry run and a
``model.init: random`` rehearsal read.

Sources: diffusers 0.42.1's ``LTXVideoTransformer3DModel`` defaults are LTX-Video 2B's transformer
(32 heads x 64, 28 layers, cross-attention 2048, T5 4096 channels; ``scripts/convert_ltx_to_diffusers.py``
builds 0.9.0/0.9.1 with them); the 13B (0.9.7) transformer is 32 heads x 128, 48 layers,
cross-attention 4096 (Lightricks/LTX-Video ``ltxv-13b`` config, as diffusers converts it). The VAE
is the 0.9.1 ``AutoencoderKLLTXVideo`` of the conversion script (128 latent channels, 32x spatial /
8x temporal, timestep-conditioned decoder) for both sizes — a departure for the 13B, whose 0.9.7
VAE has other decoder widths (the dry run reads its compression, the same, and its parameter
count). The scheduler is the conversion script's (dynamic shift, base 0.95 / max 2.05 over 1024 /
4096 tokens, ``shift_terminal`` 0.1); the text encoder google/t5-v1_1-xxl's encoder; the tokenizer
the project's byte-level BPE, as for the Wan folders.
"""

from __future__ import annotations

LTX_2B = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=64,
    cross_attention_dim=2048,
    num_layers=28,
    caption_channels=4096,
)
LTX_13B = dict(LTX_2B, attention_head_dim=128, cross_attention_dim=4096, num_layers=48)
VAE_LTX_091 = dict(
    latent_channels=128,
    block_out_channels=(128, 256, 512, 512),
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 3, 3, 3, 4),
    decoder_layers_per_block=(5, 6, 7, 8),
    spatio_temporal_scaling=(True, True, True, False),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, True, True, True),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=True,
)
# google/t5-v1_1-xxl (its encoder is LTX-Video's text encoder: 4.8B parameters)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.1,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
LTX_MODELS = {
    "ltx-video-2b": dict(family="ltx", transformer=LTX_2B, vae=VAE_LTX_091, text_encoder=T5_XXL),
    "ltx-video-13b": dict(family="ltx", transformer=LTX_13B, vae=VAE_LTX_091, text_encoder=T5_XXL),
}


def ltx_folder(spec: dict) -> dict:
    """The parts of the config-only ``LTXPipeline`` folder of ``spec`` (an ``LTX_MODELS`` entry), as
    :func:`miles.models.config_folders.write_config_folder` writes them: each model folder's class
    and config, the text encoder's classes, the scheduler's config, what else ``model_index.json`` holds."""
    from miles.models.tiny_ltx import LTX_SCHEDULER

    models = {
        "transformer": ("LTXVideoTransformer3DModel", spec["transformer"]),
        "vae": ("AutoencoderKLLTXVideo", spec["vae"]),
    }
    return dict(
        pipeline="LTXPipeline",
        models=models,
        text_encoder=("T5Config", "T5EncoderModel"),
        scheduler=LTX_SCHEDULER,
        index={},
    )
