"""The LAION aesthetic predictor (improved-aesthetic-predictor, "sac+logos+ava1-l14-linearMSE").

``score = MLP(unit(CLIP ViT-L/14 image embedding))`` on a 1..10 scale (DDPO's and flow_grpo's
aesthetic reward), averaged over ``num_frames`` frames sampled uniformly in time. The head is
five Linear layers with dropout between them and no activation (768 -> 1024 -> 128 -> 64 -> 16
-> 1), stored as a torch state dict with keys ``layers.{0,2,4,6,7}.{weight,bias}``; its sizes
are read from the file, so a head for another CLIP width loads too.

Weights: ``reward.aesthetic.clip_path`` is a save_pretrained folder of ``openai/clip-vit-large-patch14``
(model and processor); ``reward.aesthetic.head_path`` is ``sac+logos+ava1-l14-linearMSE.pth``
(from ``camenduru/improved-aesthetic-predictor``, or the LAION GitHub repo) or a folder holding it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
from torch import nn

from miles.rewards import clip_common as cc
from miles.rewards.base import Reward, check_num_frames, check_videos
from miles.rewards.pickscore import resolve_dtype
from miles.rewards.registry import register_reward
from miles.rewards.resources import ResourceCheck

CLIP_REPO = "openai/clip-vit-large-patch14"
HEAD_REPO = "camenduru/improved-aesthetic-predictor"
HEAD_FILES = ("sac+logos+ava1-l14-linearMSE.pth", "aesthetic-model.pth")
_LINEARS = (0, 2, 4, 6, 7)  # the nn.Sequential indices of the Linear layers (Dropouts between)


def aesthetic_head(state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The predictor's MLP with the layer sizes of ``state`` (its ``layers.*`` keys), loaded strictly."""
    dims = [state["layers.0.weight"].shape[1], *(state[f"layers.{i}.weight"].shape[0] for i in _LINEARS)]
    lin = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
    head = nn.Sequential(
        lin[0], nn.Dropout(0.2), lin[1], nn.Dropout(0.2), lin[2], nn.Dropout(0.1), lin[3], lin[4]
    )
    head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()}, strict=True)
    return head.eval().requires_grad_(False)


@dataclasses.dataclass(kw_only=True)
class AestheticOptions:
    """``aesthetic``: the LAION aesthetic MLP on CLIP L/14 embeddings, mean over ``reward.num_frames`` frames."""

    clip_path: str | None = None
    """Local folder of openai/clip-vit-large-patch14 (model + processor)."""
    head_path: str | None = None
    """sac+logos+ava1-l14-linearMSE.pth (camenduru/improved-aesthetic-predictor), or its folder."""


@register_reward("aesthetic", options=AestheticOptions)
class Aesthetic(Reward):
    """The LAION aesthetic score (about 1..10) of sampled frames, averaged."""

    loads_weights = True  # check_resources names its weight files: the plan counts their bytes

    name = "aesthetic"

    def __init__(
        self,
        clip_path: str | os.PathLike | None = None,
        head_path: str | os.PathLike | None = None,
        num_frames: int | None = 4,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        self.num_frames = check_num_frames(num_frames)
        self.dtype = resolve_dtype(dtype)
        clip_path, head_path = self.check_resources(clip_path, head_path)
        device = torch.device(device)
        self.processor = cc.load_processor(clip_path, "reward.aesthetic.clip_path", CLIP_REPO)
        self.model = cc.load_clip(clip_path, "reward.aesthetic.clip_path", CLIP_REPO, device, self.dtype)
        try:
            state = torch.load(head_path, map_location="cpu", weights_only=True)
            state = {k.removeprefix("module."): v for k, v in state.get("state_dict", state).items()}
            self.head = aesthetic_head(state).to(device)
        except (OSError, RuntimeError, KeyError, AttributeError) as e:
            raise ValueError(
                f"reward.aesthetic.head_path={head_path!r} is not the LAION aesthetic head ({e}); "
                f"expected {HEAD_FILES[0]} from {HEAD_REPO}"
            ) from e

    @staticmethod
    def check_resources(
        clip_path: str | os.PathLike | None = None,
        head_path: str | os.PathLike | None = None,
        **_: object,
    ) -> tuple[str, str]:
        files = ResourceCheck()
        groups = [("config.json",), cc.MODEL_FILES, *cc.PROCESSOR_FILES]
        clip = cc.check_clip_folder(files, clip_path, "reward.aesthetic.clip_path", CLIP_REPO, groups)
        head = files.file(head_path, "reward.aesthetic.head_path", HEAD_REPO, HEAD_FILES)
        files.done()
        return clip, head

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        emb = cc.frame_embeddings(self.model, self.processor, videos, self.num_frames, self.dtype)
        scores = self.head(emb.to(next(self.head.parameters()).device)).squeeze(-1)  # (B, K)
        return scores.mean(dim=1).float().to(videos.device)
