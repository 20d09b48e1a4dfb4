"""The tiny models the tests share: the transformer configs of the SP and FSDP tests (4 heads x 16,
2 blocks), Wan and LTX-Video, and the embedded tiny LTX loaded through the family seam."""

from pathlib import Path
from types import SimpleNamespace

import torch

from miles.models.tiny_ltx import TINY_LTX_TRANSFORMER

TINY_DIR = Path(__file__).resolve().parents[1] / ".cache" / "tiny-wan"

TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,  # Ulysses degrees 2 and 4 divide it
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)

TINY_LTX = dict(TINY_LTX_TRANSFORMER)  # the embedded tiny LTX's transformer (patch size 1, 8 channels)


def load_tiny_ltx():
    """The embedded tiny LTX (``.cache/tiny-wan/ltx``, built on demand) as the family loads it: an
    ``LTXModel`` on the CPU, fp32, the text encoder resident."""
    from miles.models.family import family_of
    from miles.models.tiny import tiny_model_path

    cfg = SimpleNamespace(
        path=str(tiny_model_path(TINY_DIR, "ltx")),
        task="auto",
        text_encoder_dtype="float32",
        vae_dtype="float32",
        text_encoder_offload=False,
        vae_tiling=False,
        init="pretrained",
    )
    return family_of(Path(cfg.path)).load(cfg, torch.device("cpu"))
