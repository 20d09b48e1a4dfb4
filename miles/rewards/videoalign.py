"""A VideoAlign-style video reward: a Qwen2-VL model with a linear reward head reads the clip.

VideoReward (Liu et al., 2025, "Improving Video Generation with Human Feedback") puts three
special tokens in the question, ``<|VQ_reward|>``, ``<|MQ_reward|>``, ``<|TA_reward|>``, runs
Qwen2-VL over the video and the question, applies ``rm_head`` (Linear(hidden, 3), no bias) to the
last hidden state at those three positions and keeps the diagonal: visual quality (VQ), motion
quality (MQ) and text alignment (TA). Each is standardised with VideoReward's published means and
stds; ``overall`` is their sum. ``reward.videoalign.dimension`` picks what the reward returns.

The video goes in as Qwen2-VL video patches: ``reward.videoalign.num_frames`` frames sampled uniformly
(the last repeated to an even count), resized with ``smart_resize`` to a multiple of 28 within
``max_pixels`` (bicubic), scaled to [0, 1], normalised with the folder's
``image_mean``/``image_std``, and cut into (2 x 14 x 14) patches as Qwen2VLImageProcessor does.
This is done here because transformers' video processor needs torchvision, which has no wheel
for this project's CPU torch. One video is scored per forward (no padding).

Weights: ``reward.videoalign.model_path`` is a save_pretrained folder of the reward model: a
``Qwen2VLForConditionalGeneration`` checkpoint whose state dict also holds ``rm_head.weight``
(3, hidden), its tokenizer with the three special tokens, and ``preprocessor_config.json``;
built from ``KwaiVGI/VideoReward`` (on ``Qwen/Qwen2-VL-2B-Instruct``). Departure: the question
is miles' own template (:data:`QUESTION`), not VideoReward's, so its scores are those of the
weights under this wording.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
import torch
from PIL import Image

from miles.models.fingerprint import safetensors_header
from miles.rewards.base import Reward, check_num_frames, check_videos, frames_to_uint8, sample_frame_indices
from miles.rewards.pickscore import resolve_dtype
from miles.rewards.registry import register_reward
from miles.rewards.resources import ResourceCheck

REPO = "KwaiVGI/VideoReward"
KEY = "reward.videoalign.model_path"
SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
MEAN = (3.6757, 1.1646, 2.8105)  # VideoReward's VQ, MQ, TA standardisation
STD = (2.2476, 1.3811, 2.5121)
DIMENSIONS = ("overall", "vq", "mq", "ta")
QUESTION = (
    'This video was generated from the caption "{prompt}". Rate its visual quality <|VQ_reward|>, '
    "its motion quality <|MQ_reward|> and how well it follows the caption <|TA_reward|>."
)
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|>{video}<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)


def load_tokenizer(path: str) -> tuple[object, list[int]]:
    """The reward model's tokenizer and the ids of its three reward tokens (ValueError if it lacks one)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer of {KEY}={path!r} ({e}); expected {REPO}'s") from e
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if tokenizer.unk_token_id in ids or None in ids:
        raise ValueError(f"the tokenizer in {KEY}={path!r} lacks {SPECIAL_TOKENS}")
    return tokenizer, ids


def tensor_names(path: str) -> set[str]:
    """The tensor names of the folder's weights, from the safetensors header or the index (no weights read)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    return set(json.loads(safetensors_header(os.path.join(path, "model.safetensors")))) - {"__metadata__"}


def video_patches(
    frames: np.ndarray, proc: dict, max_pixels: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames (T, H, W, 3) uint8 -> Qwen2-VL video patches (t*h*w, 3*tp*p*p) float32 and (t, h, w)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    p, tp, merge = proc["patch_size"], proc["temporal_patch_size"], proc["merge_size"]
    if len(frames) % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - len(frames) % tp, axis=0)])
    min_pixels = proc.get("min_pixels", (proc.get("size") or {}).get("shortest_edge", 56 * 56))
    h, w = smart_resize(frames.shape[1], frames.shape[2], p * merge, min_pixels, max_pixels)
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in frames])
    mean, std = np.asarray(proc["image_mean"]), np.asarray(proc["image_std"])
    x = (
        ((resized.astype(np.float32) / 255 - mean) / std).astype(np.float32).transpose(0, 3, 1, 2)
    )  # (T, C, H, W)
    t, gh, gw = len(x) // tp, h // p, w // p
    x = x.reshape(t, tp, 3, gh // merge, merge, p, gw // merge, merge, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, tp, p, p): merge groups adjacent
    return torch.from_numpy(np.ascontiguousarray(x.reshape(t * gh * gw, 3 * tp * p * p))), (t, gh, gw)


@functools.cache
def reward_model_class() -> type:
    """``Qwen2VLForConditionalGeneration`` plus VideoReward's ``rm_head`` (defined on first use)."""
    from torch import nn
    from transformers import Qwen2VLForConditionalGeneration

    class Qwen2VLRewardModel(Qwen2VLForConditionalGeneration):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.rm_head = nn.Linear(config.text_config.hidden_size, len(SPECIAL_TOKENS), bias=False)

    return Qwen2VLRewardModel


@dataclasses.dataclass(kw_only=True)
class VideoAlignOptions:
    """``videoalign``: a Qwen2-VL reward model with ``rm_head`` (VideoReward's VQ, MQ, TA)."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_frames": ("[1, 4097]", ""),
        "max_pixels": ("[784, 67108864]", "28 x 28 to 8192 x 8192"),
    }

    model_path: str | None = None
    """Local save_pretrained folder of a Qwen2-VL reward model with ``rm_head`` (KwaiVGI/VideoReward)."""
    dimension: Literal["overall", "vq", "mq", "ta"] = "overall"
    """What it returns: standardised visual quality, motion quality, text alignment, or their sum."""
    num_frames: int = 8
    """Frames per video fed to Qwen2-VL, sampled uniformly (paired by its temporal patch of 2); this
    reward's own, not reward.num_frames."""
    max_pixels: int = 448 * 448
    """Frames are resized to a multiple of 28 within this many pixels (smart_resize)."""


@register_reward("videoalign", options=VideoAlignOptions)
class VideoAlign(Reward):
    """VideoReward's standardised VQ, MQ, TA (or their sum) of each video."""

    loads_weights = True  # check_resources names its weight files: the plan counts their bytes

    name = "videoalign"

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        dimension: str = "overall",
        num_frames: int | None = 8,
        max_pixels: int = 448 * 448,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        if dimension not in DIMENSIONS:
            raise ValueError(f"reward.videoalign.dimension must be one of {DIMENSIONS}; got {dimension!r}")
        self.dimension, self.num_frames = dimension, check_num_frames(num_frames)
        self.max_pixels, self.dtype = int(max_pixels), resolve_dtype(dtype)
        path = self.check_resources(model_path)
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            self.proc = json.load(f)
        self.tokenizer, ids = load_tokenizer(path)
        self.special_ids = torch.tensor(ids)
        model, info = reward_model_class().from_pretrained(
            path, local_files_only=True, output_loading_info=True
        )
        if "rm_head.weight" in info["missing_keys"]:
            raise ValueError(
                f"reward.videoalign.model_path={path!r} holds no rm_head.weight: not a {REPO}-style reward model"
            )
        self.model = model.to(device=torch.device(device), dtype=self.dtype).eval().requires_grad_(False)

    @staticmethod
    def check_resources(model_path: str | os.PathLike | None = None, **_: object) -> str:
        """The folder as the constructor reads it (files whole, the tokenizer loaded, ``rm_head.weight``
        among the weights' names; no weights read), every problem listed."""
        files = ResourceCheck()
        groups = [("config.json",), ("model.safetensors", "model.safetensors.index.json")]
        groups += [("preprocessor_config.json",), ("tokenizer.json",)]
        path = files.folder(model_path, KEY, REPO, groups)
        if path is not None:
            files.attempt(load_tokenizer, path)
            if "rm_head.weight" not in tensor_names(path):
                files.problems.append(
                    f"{KEY}={path!r} holds no rm_head.weight: not a {REPO}-style reward model"
                )
        files.done()
        return path

    @torch.no_grad()
    def scores(self, video: torch.Tensor, prompt: str) -> torch.Tensor:
        """One video (F, C, H, W) in [0, 1]: standardised (VQ, MQ, TA), (3,) float32."""
        idx = sample_frame_indices(video.shape[0], self.num_frames)
        patches, grid = video_patches(
            frames_to_uint8(video[idx.to(video.device)]), self.proc, self.max_pixels
        )
        num_tokens = grid[0] * grid[1] * grid[2] // self.proc["merge_size"] ** 2
        text = CHAT.format(video="<|video_pad|>" * num_tokens, question=QUESTION.format(prompt=prompt))
        device = self.model.device
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]], device=device)
        video_token = self.model.config.video_token_id
        hidden = self.model.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values_videos=patches.to(device=device, dtype=self.dtype),
            video_grid_thw=torch.tensor([grid], device=device),
            mm_token_type_ids=(ids == video_token).long() * 2,
        ).last_hidden_state[0]  # (L, hidden)
        positions = [int((ids[0] == t).nonzero()[-1]) for t in self.special_ids.tolist()]
        raw = self.model.rm_head(hidden[positions]).float().diagonal()  # (3,): token i reads output i
        return (raw.cpu() - torch.tensor(MEAN)) / torch.tensor(STD)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        per_video = torch.stack([self.scores(v, p) for v, p in zip(videos, prompts)])  # (B, 3)
        out = (
            per_video.sum(dim=1)
            if self.dimension == "overall"
            else per_video[:, DIMENSIONS.index(self.dimension) - 1]
        )
        return out.to(videos.device)
