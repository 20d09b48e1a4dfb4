"""The embedded tiny Wan pipeline: a complete diffusers folder built from configs, no download.

    python -m miles.models.tiny .cache/tiny-wan      # or: make tiny-model

writes two ordinary diffusers Wan folders (safetensors) with fixed seeds:

- ``two_expert/``: the Wan2.2 A14B layout — ``transformer`` (high noise), ``transformer_2``
  (low noise) and ``boundary_ratio`` in ``model_index.json``;
- ``single_expert/``: the Wan2.1 layout — one ``transformer``;

and the image-to-video variants of ``miles.models.tiny_i2v`` (``i2v``, ``i2v_two_expert``,
``ti2v``).

Each has a UMT5 text encoder, a byte-level BPE tokenizer (built in code, reloads through
``AutoTokenizer``), an ``AutoencoderKLWan`` with Wan's 4x temporal / 8x spatial compression,
and a flow-matching scheduler. They load through the same ``WanPipeline.from_pretrained(dir)``
path real Wan checkpoints use. The transformer has 4 heads x 16 (Ulysses degrees 2 and 4
divide them) and 2 blocks: a CPU forward+backward at ~1k tokens takes well under a second.
Building twice gives byte-identical files.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

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
ALL_VARIANTS = (*VARIANTS, "i2v", "i2v_two_expert", "ti2v")  # + miles.models.tiny_i2v.I2V_VARIANTS
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


def build_pipeline(variant: str = "two_expert"):
    """Construct the tiny WanPipeline (or an I2V variant's pipeline) in memory with fixed seeds."""
    from miles.models.tiny_i2v import I2V_VARIANTS, build_i2v_pipeline

    if variant in I2V_VARIANTS:
        return build_i2v_pipeline(variant)
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
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, **TINY_TEXT_ENCODER)
    ).eval()
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


def build_tiny_models(root: str | Path, force: bool = False) -> Path:
    """Write every variant under ``root`` (atomically: a half-written folder never appears)."""
    root = Path(root)
    for variant in ALL_VARIANTS:
        dest = root / variant
        if dest.is_dir() and (dest / "model_index.json").is_file() and not force:
            continue
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{variant}-"))
        try:
            build_pipeline(variant).save_pretrained(tmp, safe_serialization=True)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def tiny_model_path(root: str | Path, variant: str) -> Path:
    """The folder of a tiny variant, building the tiny models first if they are missing."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {ALL_VARIANTS}")
    build_tiny_models(root)
    return Path(root) / variant


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-wan"
    build_tiny_models(out, force="--force" in sys.argv)
    print(f"tiny Wan pipelines written to {out}/{{{','.join(ALL_VARIANTS)}}}")
