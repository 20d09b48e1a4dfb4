"""A tiny random CLIP saved in the layout of a local PickScore folder, for tests and tiny recipes.

``tiny_clip(path)`` writes a ``CLIPModel`` (hidden 32, 2 layers, 2 heads, 32x32 images in 8x8
patches, projection 16; fixed seed) and a ``CLIPProcessor`` whose byte-level BPE tokenizer is
built in place (no download, no merges: one token per byte) with ``save_pretrained``, so it
loads back through ``reward.pickscore.model_path`` exactly like a copy of PickScore_v1. Scores are
meaningless; the plumbing is real.

    python -m miles.rewards.tiny_clip runs/tiny_clip
"""

from __future__ import annotations

import os
import sys

import torch

IMAGE_SIZE = 32
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _byte_level_vocab() -> dict[str, int]:
    """Specials, then every byte-level symbol alone and as a word end (CLIP's ``</w>`` suffix)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [BOS, EOS, *alphabet, *(a + "</w>" for a in alphabet)]
    return {token: i for i, token in enumerate(tokens)}


def tiny_clip(path: str | os.PathLike, seed: int = 0) -> str:
    """Save a tiny random CLIP model and processor to ``path`` (created if needed); return it as str."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    path = os.fspath(path)
    vocab = _byte_level_vocab()
    tokenizer = CLIPTokenizer(
        vocab=vocab, merges=[], bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
    )
    tokenizer.model_max_length = 77
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(
            **tower,
            vocab_size=len(vocab),
            max_position_embeddings=77,
            bos_token_id=vocab[BOS],
            eos_token_id=vocab[EOS],
            pad_token_id=vocab[EOS],
        ),
        vision_config=dict(**tower, image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()

    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m miles.rewards.tiny_clip OUTPUT_DIR")
    print(tiny_clip(sys.argv[1]))
