"""CLIPScore (Hessel et al., 2021): prompt-frame agreement of a CLIP model, for videos.

``CLIP-S(frame, prompt) = w * max(cos(image_emb, text_emb), 0)`` with w = 2.5 (the paper's
rescaling); a video scores the mean over ``num_frames`` frames sampled uniformly in time.

Weights: ``reward.clipscore.model_path`` is a local save_pretrained folder of a transformers CLIP model
with its processor: ``openai/clip-vit-base-patch32`` (the paper's; any CLIP folder works, e.g.
``openai/clip-vit-large-patch14`` as torchmetrics uses).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from miles.rewards import clip_common as cc
from miles.rewards.base import Reward, check_num_frames, check_videos
from miles.rewards.pickscore import resolve_dtype
from miles.rewards.registry import register_reward
from miles.rewards.resources import ResourceCheck

CLIPSCORE_W = 2.5
REPO = "openai/clip-vit-base-patch32"


@dataclasses.dataclass(kw_only=True)
class CLIPScoreOptions:
    """``clipscore``: 2.5 * max(cos, 0) of a CLIP model, mean over ``reward.num_frames`` sampled frames."""

    model_path: str | None = None
    """Local folder of a transformers CLIP model + processor (openai/clip-vit-base-patch32)."""


@register_reward("clipscore", options=CLIPScoreOptions)
class CLIPScore(Reward):
    """``2.5 * max(cos, 0)`` between each sampled frame and the prompt, averaged over frames."""

    loads_weights = True  # check_resources names its weight files: the plan counts their bytes

    name = "clipscore"

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        num_frames: int | None = 4,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        self.num_frames = check_num_frames(num_frames)
        self.dtype = resolve_dtype(dtype)
        path = self.check_resources(model_path)
        self.processor = cc.load_processor(path, "reward.clipscore.model_path", REPO)
        self.model = cc.load_clip(path, "reward.clipscore.model_path", REPO, torch.device(device), self.dtype)

    @staticmethod
    def check_resources(model_path: str | os.PathLike | None = None, **_: object) -> str:
        files = ResourceCheck()
        groups = [("config.json",), cc.MODEL_FILES, *cc.PROCESSOR_FILES]
        path = cc.check_clip_folder(files, model_path, "reward.clipscore.model_path", REPO, groups)
        files.done()
        return path

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        image = cc.frame_embeddings(self.model, self.processor, videos, self.num_frames, self.dtype)
        text = cc.text_embeddings(self.model, self.processor, prompts)
        cos = torch.einsum("bkd,bd->bk", image, text)
        return (CLIPSCORE_W * cos.clamp(min=0)).mean(dim=1).to(videos.device)
