"""HPSv2.1 (Human Preference Score v2.1, Wu et al., 2023) for videos.

``score = cos(image_emb, text_emb)`` of the HPSv2.1-tuned OpenCLIP ViT-H-14 (HPSv2's
``diag(image_features @ text_features.T)``, about 0.2..0.35), averaged over ``num_frames``
frames sampled uniformly in time.

Departure from HPSv2's code: it runs through ``open_clip``, whose image transforms need
torchvision, which has no wheel matching this project's CPU torch. Instead the OpenCLIP-format
checkpoint (``HPS_v2.1_compressed.pt``: ``{"state_dict": ...}`` with OpenCLIP's key names) is
converted, tensor for tensor, into a transformers ``CLIPModel`` of the architecture in the
processor folder's ``config.json`` (laion's ViT-H-14 folder ships it). OpenCLIP's fused attention
projection ``in_proj_weight`` splits into q/k/v; its ``proj`` matrices are the transposed
projection weights. The processor (resize shortest side bicubic, centre crop, the OpenAI CLIP
mean/std; CLIP's BPE) is what OpenCLIP's eval transform and tokenizer do.

Weights: ``reward.hpsv2.model_path`` holds ``HPS_v2.1_compressed.pt`` (``xswu/HPSv2``);
``reward.hpsv2.processor_path`` is ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (config + processor).
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

HPS_REPO = "xswu/HPSv2"
HPS_FILES = ("HPS_v2.1_compressed.pt", "HPS_v2_compressed.pt")
ARCH_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

_BLOCK = {  # OpenCLIP resblock names -> transformers CLIPEncoderLayer names (q/k/v split apart)
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_TOP = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}


def _block_key(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One OpenCLIP resblock tensor under its transformers name(s)."""
    if key.startswith("visual."):
        tower, rest = "vision_model", key.removeprefix("visual.transformer.")
    else:
        tower, rest = "text_model", key.removeprefix("transformer.")
    _, layer, name = rest.split(".", 2)  # resblocks.N.name
    prefix = f"{tower}.encoder.layers.{layer}."
    if name.startswith("attn.in_proj_"):
        q, k, v = value.chunk(3, dim=0)
        kind = name.rsplit("_", 1)[1]  # weight | bias
        return {f"{prefix}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))}
    module, kind = name.rsplit(".", 1)
    if module not in _BLOCK:
        raise KeyError(f"unexpected OpenCLIP tensor {key}")
    return {f"{prefix}{_BLOCK[module]}.{kind}": value}


def open_clip_to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenCLIP CLIP state dict (``model.state_dict()``) as a transformers ``CLIPModel``'s."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in _TOP:
            out[_TOP[key]] = value
        elif key == "visual.proj":  # x @ proj  ==  Linear(weight = proj.T)
            out["visual_projection.weight"] = value.t().contiguous()
        elif key == "text_projection":
            out["text_projection.weight"] = value.t().contiguous()
        elif key.startswith(("visual.transformer.resblocks.", "transformer.resblocks.")):
            out.update(_block_key(key, value))
        elif key != "attn_mask":
            raise KeyError(f"unexpected OpenCLIP tensor {key}")
    return out


def clip_config(arch: str) -> object:
    """The transformers ``CLIPConfig`` of the folder ``arch`` (the architecture the checkpoint fills)."""
    from transformers import CLIPConfig

    try:
        return CLIPConfig.from_pretrained(arch, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"could not read a CLIPConfig from reward.hpsv2.processor_path={arch!r} ({e}); expected {ARCH_REPO}'s"
        ) from e


@dataclasses.dataclass(kw_only=True)
class HPSv2Options:
    """``hpsv2``: HPSv2.1, the cosine of a tuned OpenCLIP ViT-H-14, mean over ``reward.num_frames`` frames."""

    model_path: str | None = None
    """HPS_v2.1_compressed.pt (xswu/HPSv2), or a folder holding it (an OpenCLIP checkpoint)."""
    processor_path: str | None = None
    """Local folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its config.json and processor)."""


@register_reward("hpsv2", options=HPSv2Options)
class HPSv2(Reward):
    """HPSv2.1: the cosine between each sampled frame and the prompt, averaged over frames."""

    loads_weights = True  # check_resources names its weight files: the plan counts their bytes

    name = "hpsv2"

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        processor_path: str | os.PathLike | None = None,
        num_frames: int | None = 4,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        from transformers import CLIPModel

        self.num_frames = check_num_frames(num_frames)
        self.dtype = resolve_dtype(dtype)
        ckpt, arch = self.check_resources(model_path, processor_path)
        self.processor = cc.load_processor(arch, "reward.hpsv2.processor_path", ARCH_REPO)
        model = CLIPModel(clip_config(arch))
        try:
            raw = torch.load(ckpt, map_location="cpu", weights_only=True)
            missing, unexpected = model.load_state_dict(
                open_clip_to_transformers(raw.get("state_dict", raw)), strict=False
            )
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise KeyError(f"missing {missing[:4]}, unexpected {unexpected[:4]}")
        except (OSError, RuntimeError, KeyError, AttributeError, ValueError) as e:
            raise ValueError(
                f"{ckpt!r} is not an OpenCLIP checkpoint of the architecture in "
                f"reward.hpsv2.processor_path={arch!r} ({e}); expected {HPS_FILES[0]} from {HPS_REPO} "
                f"with {ARCH_REPO}'s folder"
            ) from e
        self.model = model.to(device=torch.device(device), dtype=self.dtype).eval().requires_grad_(False)

    @staticmethod
    def check_resources(
        model_path: str | os.PathLike | None = None,
        processor_path: str | os.PathLike | None = None,
        **_: object,
    ) -> tuple[str, str]:
        files = ResourceCheck()
        ckpt = files.file(model_path, "reward.hpsv2.model_path", HPS_REPO, HPS_FILES)
        groups = [("config.json",), *cc.PROCESSOR_FILES]
        arch = cc.check_clip_folder(files, processor_path, "reward.hpsv2.processor_path", ARCH_REPO, groups)
        if arch is not None:
            files.attempt(clip_config, arch)
        files.done()
        return ckpt, arch

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        image = cc.frame_embeddings(self.model, self.processor, videos, self.num_frames, self.dtype)
        text = cc.text_embeddings(self.model, self.processor, prompts)
        return torch.einsum("bkd,bd->bk", image, text).mean(dim=1).to(videos.device)
