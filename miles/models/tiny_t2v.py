"""The tiny text-to-video Wan pipelines' parts: the configs, the tokenizer (built in code) and the
in-memory build of ``two_expert`` and ``single_expert`` (:mod:`miles.models.tiny` writes them as
diffusers folders; :mod:`miles.models.tiny_i2v` builds its variants on these parts)."""

from __future__ import annotations

import torch

TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=128,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
TINY_TEXT_ENCODER = dict(
    d_model=32,
    d_kv=16,
    d_ff=64,
    num_layers=2,
    num_heads=2,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu",
)
"""The tiny UMT5's numbers, the tiny LTX's T5's too (``text_encoder_config``)."""
TINY_VAE = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
BOUNDARY_RATIO = 0.875
VARIANTS = ("two_expert", "single_expert")
_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]


def build_tokenizer():
    """A byte-level BPE with the 256 byte tokens and no merges: deterministic, no training data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def text_encoder_config(vocab_size: int) -> dict:
    """The tiny text encoder's config over ``vocab_size`` tokens (the tokenizer's: pad 0, eos 1), for
    ``UMT5Config`` (Wan) and ``T5Config`` (LTX) alike."""
    return dict(TINY_TEXT_ENCODER, vocab_size=vocab_size, pad_token_id=0, eos_token_id=1)


def build_t2v_pipeline(variant: str = "two_expert"):
    """Construct the tiny text-to-video WanPipeline in memory with fixed seeds."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {VARIANTS}")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(**text_encoder_config(len(tokenizer)))).eval()
    torch.manual_seed(1)
    vae = AutoencoderKLWan(**TINY_VAE).eval()
    torch.manual_seed(2)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
    transformer_2 = None
    if variant == "two_expert":
        torch.manual_seed(3)
        transformer_2 = WanTransformer3DModel(**TINY_TRANSFORMER)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=BOUNDARY_RATIO if variant == "two_expert" else None,
    )
