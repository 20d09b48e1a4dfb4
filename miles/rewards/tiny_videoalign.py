"""A tiny random VideoAlign-style reward model saved in the layout ``reward.videoalign.model_path`` loads.

``tiny_videoalign(path)`` writes a Qwen2-VL (2 text layers of 32, 2 vision blocks of 32, patch 14,
merge 2, temporal patch 2; fixed seed) with a random ``rm_head``, a byte-level BPE tokenizer with
Qwen2-VL's chat and vision tokens and VideoReward's three reward tokens (built in place: no
download), and a ``preprocessor_config.json``. Scores are meaningless; the plumbing is real.

    python -m miles.rewards.tiny_videoalign runs/tiny_videoalign
"""

from __future__ import annotations

import json
import os
import sys

import torch

from miles.rewards.videoalign import SPECIAL_TOKENS, reward_model_class

CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>")
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = [*CHAT_TOKENS, *VISION_TOKENS, *SPECIAL_TOKENS]
    vocab = {token: i for i, token in enumerate([*specials, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    return fast, vocab


def tiny_videoalign(path: str | os.PathLike, seed: int = 0) -> str:
    """Save the tiny reward model, tokenizer and preprocessor config to ``path``; return it as str."""
    from transformers import Qwen2VLConfig

    path = os.fspath(path)
    tokenizer, vocab = _tokenizer()
    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=len(vocab),
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            bos_token_id=vocab["<|endoftext|>"],
            eos_token_id=vocab["<|im_end|>"],
            pad_token_id=vocab["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
        ),
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = reward_model_class()(config).eval()
    with torch.no_grad():
        model.rm_head.weight.normal_(0, 1.0)  # O(1) head outputs: scores far from the standardisation mean
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    proc = dict(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    )
    proc.update(
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, image_processor_type="Qwen2VLImageProcessor"
    )
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(proc, f, indent=1)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m miles.rewards.tiny_videoalign OUTPUT_DIR")
    print(tiny_videoalign(sys.argv[1]))
