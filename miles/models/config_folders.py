"""Config-only diffusers Wan folders at the real sizes: what the dry run reads (no weights needed),
and what a rehearsal or benchmark loads with ``model.init: random`` (no weight file is read or written).

    python -m miles.models.config_folders OUT_DIR [--models wan2.2-t2v-a14b wan2.1-t2v-1.3b ...]
    python train_grpo.py --config configs/wan2_1_t2v_1_3b.yaml --model.path OUT_DIR/wan2.1-t2v-1.3b \
        --dry-run --world-size 8

writes ``OUT_DIR/<model>/`` with ``model_index.json`` and each component's ``config.json``
(``transformer``, ``transformer_2`` for A14B, ``vae``, ``text_encoder``, ``scheduler``) and a
tokenizer. The numbers are those of the published ``-Diffusers`` repos (diffusers'
``scripts/convert_wan_to_diffusers.py``; ``google/umt5-xxl``):

- ``wan2.2-t2v-a14b``: two 14B experts (40 heads x 128, ffn 13824, 40 layers), boundary_ratio 0.875,
  UMT5-XXL, the Wan2.1 VAE (z 16, 8x spatial);
- ``wan2.1-t2v-14b``: one such expert;
- ``wan2.2-ti2v-5b``: 24 heads x 128, ffn 14336, 30 layers, 48 latent channels, the Wan2.2 VAE
  (z 48, 16x spatial, patchified RGB), ``expand_timesteps``;
- ``wan2.1-t2v-1.3b``: 12 heads x 128, ffn 8960, 30 layers;
- ``tiny``: the embedded tiny two-expert model's configs (``miles.models.tiny``), for CPU tests;
- ``ltx-video-2b``, ``ltx-video-13b``: LTX-Video's ``LTXPipeline`` folders, the second model family
  (:mod:`miles.models.config_folders_ltx` gives their sources).

Departure: the tokenizer is the project's byte-level BPE (``miles.models.tiny.build_tokenizer``),
not UMT5's SentencePiece model (a download): token ids stay below 259, so the embedding table
is the real 256,384 x 4,096 but only its first rows are read. The scheduler is the
``FlowMatchEulerDiscreteScheduler(shift=3)`` the trainer's sampler replaces anyway.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles.models.config_folders_ltx import LTX_MODELS, T5_XXL, ltx_folder

_WAN_COMMON = dict(
    patch_size=[1, 2, 2],
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
WAN_14B = dict(
    _WAN_COMMON,
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    ffn_dim=13824,
    num_layers=40,
)
WAN_1_3B = dict(WAN_14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN_TI2V_5B = dict(
    WAN_14B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
)

# google/umt5-xxl (the encoder half is Wan's text encoder: 5.7B parameters): google/t5-v1_1-xxl's
# numbers (LTX-Video's text encoder) over UMT5's vocabulary.
UMT5_XXL = dict(T5_XXL, vocab_size=256384)
# AutoencoderKLWan's defaults are the Wan2.1 VAE (base_dim 96, z 16, latents_mean/std of Wan2.1).
VAE_WAN21: dict = {}
VAE_WAN22 = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    # fmt: off
    latents_mean=[
        -0.2289,
        -0.0052,
        -0.1323,
        -0.2339,
        -0.2799,
        0.0174,
        0.1838,
        0.1557,
        -0.1382,
        0.0542,
        0.2813,
        0.0891,
        0.1570,
        -0.0098,
        0.0375,
        -0.1825,
        -0.2246,
        -0.1207,
        -0.0698,
        0.5109,
        0.2665,
        -0.2108,
        -0.2158,
        0.2502,
        -0.2055,
        -0.0322,
        0.1109,
        0.1567,
        -0.0729,
        0.0899,
        -0.2799,
        -0.1230,
        -0.0313,
        -0.1649,
        0.0117,
        0.0723,
        -0.2839,
        -0.2083,
        -0.0520,
        0.3748,
        0.0152,
        0.1957,
        0.1433,
        -0.2944,
        0.3573,
        -0.0548,
        -0.1681,
        -0.0667,
    ],
    latents_std=[
        0.4765,
        1.0364,
        0.4514,
        1.1677,
        0.5313,
        0.4990,
        0.4818,
        0.5013,
        0.8158,
        1.0344,
        0.5894,
        1.0901,
        0.6885,
        0.6165,
        0.8454,
        0.4978,
        0.5759,
        0.3523,
        0.7135,
        0.6804,
        0.5833,
        1.4146,
        0.8986,
        0.5659,
        0.7069,
        0.5338,
        0.4889,
        0.4917,
        0.4069,
        0.4999,
        0.6866,
        0.4093,
        0.5709,
        0.6065,
        0.6415,
        0.4944,
        0.5726,
        1.2042,
        0.5458,
        1.6887,
        0.3971,
        1.0600,
        0.3943,
        0.5537,
        0.5444,
        0.4089,
        0.7468,
        0.7744,
    ],
    # fmt: on
)


def _tiny() -> dict:
    from miles.models.tiny_t2v import BOUNDARY_RATIO, TINY_TRANSFORMER, TINY_VAE, text_encoder_config

    transformer = dict(TINY_TRANSFORMER, patch_size=list(TINY_TRANSFORMER["patch_size"]))
    text = text_encoder_config(259)
    return dict(
        transformer=transformer, experts=2, boundary_ratio=BOUNDARY_RATIO, text_encoder=text, vae=TINY_VAE
    )


MODELS = {
    "wan2.2-t2v-a14b": dict(
        transformer=WAN_14B, experts=2, boundary_ratio=0.875, text_encoder=UMT5_XXL, vae=VAE_WAN21
    ),
    "wan2.1-t2v-14b": dict(transformer=WAN_14B, experts=1, text_encoder=UMT5_XXL, vae=VAE_WAN21),
    "wan2.2-ti2v-5b": dict(
        transformer=WAN_TI2V_5B, experts=1, text_encoder=UMT5_XXL, vae=VAE_WAN22, expand_timesteps=True
    ),
    "wan2.1-t2v-1.3b": dict(transformer=WAN_1_3B, experts=1, text_encoder=UMT5_XXL, vae=VAE_WAN21),
    **LTX_MODELS,
}


def model_spec(name: str) -> dict:
    """The configs of ``name`` (one of :data:`MODELS` or ``tiny``)."""
    if name == "tiny":
        return _tiny()
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS) + ['tiny']}")
    return MODELS[name]


def per_token_timesteps(spec: dict) -> bool:
    """Whether the model of ``spec`` takes one timestep per token (Wan2.2 TI2V's ``expand_timesteps``)."""
    return bool(spec.get("expand_timesteps", False))


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _wan_folder(spec: dict) -> dict:
    """The parts of the config-only Wan folder of ``spec``, as :func:`write_config_folder` writes them
    (:func:`~miles.models.config_folders_ltx.ltx_folder` gives LTX's)."""
    experts = ["transformer", "transformer_2"][: spec["experts"]]
    models = {sub: ("WanTransformer3DModel", spec["transformer"]) for sub in experts}
    index = {"boundary_ratio": spec.get("boundary_ratio"), "expand_timesteps": per_token_timesteps(spec)}
    if "transformer_2" not in experts:
        index["transformer_2"] = [None, None]  # WanPipeline's second expert, absent
    return dict(
        pipeline="WanPipeline",
        models={**models, "vae": ("AutoencoderKLWan", spec["vae"])},
        text_encoder=("UMT5Config", "UMT5EncoderModel"),
        scheduler=dict(shift=3.0),
        index=index,
    )


def write_config_folder(name: str, dest: str | Path) -> Path:
    """Write the config-only diffusers folder of ``name`` to ``dest``; returns ``dest``.

    Each config goes through its class's own ``save_config``/``save_pretrained`` (built on the
    meta device: no memory), so the files are exactly what ``from_pretrained`` reads back.
    """
    import diffusers
    import torch
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from miles.models.tiny import build_tokenizer

    spec, dest = model_spec(name), Path(dest)
    parts = ltx_folder(spec) if spec.get("family") == "ltx" else _wan_folder(spec)
    with torch.device("meta"):
        for sub, (cls, config) in parts["models"].items():
            getattr(diffusers, cls).from_config(config).save_config(dest / sub)
    config_class, encoder_class = parts["text_encoder"]
    getattr(transformers, config_class)(**spec["text_encoder"]).save_pretrained(dest / "text_encoder")
    _set_architectures(dest / "text_encoder" / "config.json", encoder_class)
    FlowMatchEulerDiscreteScheduler(**parts["scheduler"]).save_config(dest / "scheduler")
    build_tokenizer().save_pretrained(dest / "tokenizer")
    index = {
        "_class_name": parts["pipeline"],
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", encoder_class],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        **{sub: ["diffusers", cls] for sub, (cls, _) in parts["models"].items()},
        **parts["index"],
    }
    _write_json(dest / "model_index.json", index)
    return dest


def _set_architectures(path: Path, encoder_class: str) -> None:
    config = json.loads(path.read_text())
    config["architectures"] = [encoder_class]
    _write_json(path, config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write <model>/ folders into")
    ap.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS) + ["tiny"])
    args = ap.parse_args()
    for name in args.models:
        print(write_config_folder(name, Path(args.out) / name))


if __name__ == "__main__":
    main()
