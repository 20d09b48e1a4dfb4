"""PickScore reward (Kirstain et al., 2023) for videos, computed as flow_grpo does for images.

``score = logit_scale.exp() * cos(text_emb, image_emb) / 26`` with the CLIP-H PickScore_v1
model; the /26 brings the typical range near 1. Departure from flow_grpo: a video scores the
mean over ``num_frames`` frames sampled uniformly in time (``round(linspace(0, F-1, K))``).

Weights are loaded only from local folders (``local_files_only``): ``reward.pickscore.model_path``
is a copy of ``yuvalkirstain/PickScore_v1`` and ``reward.pickscore.processor_path`` (default: the
model folder) one of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s processor. Tests and the tiny
recipe use ``miles.rewards.tiny_clip.tiny_clip`` to make a random stand-in of the same layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
from PIL import Image

from miles.rewards import clip_common as cc
from miles.rewards.base import Reward, check_num_frames, check_videos, frames_to_uint8, sample_frame_indices
from miles.rewards.registry import register_reward
from miles.rewards.resources import ResourceCheck

PICKSCORE_REPO = "yuvalkirstain/PickScore_v1"
PROCESSOR_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

# flow_grpo divides PickScore by 26 so that rewards sit near 1 (PickScore_v1 logit_scale.exp() = 100).
PICKSCORE_SCALE = 26.0

_MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or one of ``"float32" | "bfloat16" | "float16"`` (and fp32/bf16/fp16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"reward.dtype must be a torch dtype or one of {sorted(_DTYPES)}; got {dtype!r}")


@dataclasses.dataclass(kw_only=True)
class PickScoreOptions:
    """``pickscore``: PickScore_v1 (a CLIP-H), mean over ``reward.num_frames`` sampled frames."""

    model_path: str | None = None
    """Local folder of a PickScore CLIP model (yuvalkirstain/PickScore_v1)."""
    processor_path: str | None = None
    """Local folder of its processor (laion/CLIP-ViT-H-14-laion2B-s32B-b79K); None: model_path."""


@register_reward("pickscore", options=PickScoreOptions)
class PickScore(Reward):
    """PickScore of each video against its prompt, averaged over ``num_frames`` sampled frames."""

    loads_weights = True  # check_resources names its weight files: the plan counts their bytes

    name = "pickscore"

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        processor_path: str | os.PathLike | None = None,
        num_frames: int | None = 4,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        # Validate everything before loading anything: a typo must not cost a CLIP-H load.
        self.num_frames = check_num_frames(num_frames)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        model_path, processor_key, processor_path = self.check_resources(model_path, processor_path)

        from transformers import CLIPModel  # deferred: importing transformers is slow

        self.processor = cc.load_processor(processor_path, processor_key, PROCESSOR_REPO)
        try:
            model = CLIPModel.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"could not load a CLIPModel from reward.pickscore.model_path={model_path!r} ({e}); it must be a "
                f"save_pretrained folder of a CLIP model, e.g. {PICKSCORE_REPO}"
            ) from e
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        # Truncate prompts to what the text tower can embed (77 for CLIP).
        self.max_text_length = self.model.config.text_config.max_position_embeddings

    @staticmethod
    def check_resources(
        model_path: str | os.PathLike | None = None,
        processor_path: str | os.PathLike | None = None,
        **_: object,
    ) -> tuple[str, str, str]:
        """Check the local folders as the constructor reads them (the files whole, the processor loaded;
        no weights read), listing every problem: ``(model path, processor key, processor path)``."""
        files = ResourceCheck()
        model_key = "reward.pickscore.model_path"
        model = files.folder(model_path, model_key, PICKSCORE_REPO, [("config.json",), _MODEL_FILES])
        if processor_path is None:  # the processor from the model folder, if that is one
            processor_key, processor_path = model_key, model_path
            check_processor = model_path is not None and os.path.isdir(model_path)
        else:
            processor_key, check_processor = "reward.pickscore.processor_path", True
        processor = None
        if check_processor:
            groups = [_IMAGE_PROCESSOR_FILES, _TOKENIZER_FILES]
            processor = cc.check_clip_folder(files, processor_path, processor_key, PROCESSOR_REPO, groups)
        files.done()
        return model, processor_key, processor

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        batch = videos.shape[0]
        idx = sample_frame_indices(videos.shape[1], self.num_frames)
        num_sampled = len(idx)
        # (B, K, C, H, W) in [0, 1] -> B*K uint8 PIL images: the processor then resizes, crops,
        # rescales by 1/255 and normalises exactly as for the photos PickScore was trained on.
        frames = frames_to_uint8(videos[:, idx.to(videos.device)])  # (B, K, H, W, C)
        images = [Image.fromarray(frame) for video in frames for frame in video]
        pixel_values = self.processor(images=images, return_tensors="pt")["pixel_values"]
        text = self.processor(
            text=list(prompts),
            padding=True,
            truncation=True,
            max_length=self.max_text_length,
            return_tensors="pt",
        )

        # transformers 5: get_*_features return a BaseModelOutputWithPooling whose pooler_output
        # is the projected embedding (transformers 4 returned the tensor itself).
        image_emb = self.model.get_image_features(
            pixel_values=pixel_values.to(device=self.device, dtype=self.dtype)
        ).pooler_output.float()  # (B*K, D)
        text_emb = self.model.get_text_features(
            input_ids=text["input_ids"].to(self.device), attention_mask=text["attention_mask"].to(self.device)
        ).pooler_output.float()  # (B, D)
        image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True)
        text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)

        cos = (image_emb.view(batch, num_sampled, -1) * text_emb[:, None, :]).sum(dim=-1)  # (B, K)
        scores = self.model.logit_scale.float().exp() * cos.mean(dim=1) / PICKSCORE_SCALE
        return scores
