"""The tiny transformer configs the SP and FSDP tests share (4 heads x 16, 2 blocks): Wan and LTX-Video."""

from miles.models.tiny_ltx import TINY_LTX_TRANSFORMER

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
