"""Which image condition a Wan folder takes, and loading its image-to-video pipeline.

- ``WanImageToVideoPipeline`` folders whose transformer takes more input channels than it
  predicts (Wan2.1-I2V: 36 in, 16 out, with a CLIP image encoder; Wan2.2-I2V-A14B: the same,
  two experts, no image encoder) take the ``concat`` condition;
- a folder with ``expand_timesteps`` (Wan2.2-TI2V-5B, a ``WanPipeline`` folder) takes the
  ``first_frame`` condition in its image mode (``model.task: i2v``); ``t2v`` (or ``auto``)
  keeps it text-to-video.

``model.task: auto`` picks image-to-video exactly for ``WanImageToVideoPipeline`` folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miles.rollout.condition import ImageCondition

TASKS = ("auto", "t2v", "i2v")


def _transformer_config(path: Path) -> dict:
    config = path / "transformer" / "config.json"
    try:
        return json.loads(config.read_text()) if config.is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:  # the same message as miles.models.wan.read_json
        raise ValueError(
            f"{config} is not valid JSON ({e}); restore it from the model's original files"
        ) from None


def condition_mode(path: Path, index: dict, task: str = "auto") -> str | None:
    """``concat``, ``first_frame`` or None (text-to-video) for the folder at ``path`` with
    ``model_index.json`` contents ``index``; a clear error where ``task`` cannot be run."""
    if task not in TASKS:
        raise ValueError(f"model.task must be one of {TASKS}, got {task!r}")
    config = _transformer_config(path)
    in_ch, out_ch = config.get("in_channels"), config.get("out_channels", config.get("in_channels"))
    concat = in_ch is not None and in_ch != out_ch
    is_i2v_class = index.get("_class_name") == "WanImageToVideoPipeline"
    expand = bool(index.get("expand_timesteps", False))
    if task == "t2v" and (concat or (is_i2v_class and not expand)):
        raise ValueError(
            f"model.task t2v: {path} is an image-to-video folder ({index.get('_class_name')}, transformer "
            f"in_channels {in_ch} != out_channels {out_ch}); it needs an image per prompt (model.task i2v)"
        )
    if task == "t2v" or (task == "auto" and not is_i2v_class):
        return None
    if concat:
        return "concat"
    if expand:
        return "first_frame"
    raise ValueError(
        f"model.task i2v: {path} is a text-to-video folder (transformer in_channels {in_ch} = out_channels "
        f"{out_ch}, no expand_timesteps): it cannot take an image. Use a Wan2.1-I2V, Wan2.2-I2V-A14B or "
        "Wan2.2-TI2V-5B folder"
    )


def text_pipeline(image_pipeline):
    """A ``WanPipeline`` sharing the I2V pipeline's modules: the project encodes prompts and
    decodes latents through it for both tasks (the I2V pipeline's prompt cleaning needs ftfy)."""
    from diffusers import WanPipeline

    pipe = WanPipeline(
        tokenizer=image_pipeline.tokenizer,
        text_encoder=image_pipeline.text_encoder,
        vae=image_pipeline.vae,
        scheduler=image_pipeline.scheduler,
        transformer=image_pipeline.transformer,
        transformer_2=image_pipeline.transformer_2,
        boundary_ratio=image_pipeline.config.boundary_ratio,
        expand_timesteps=image_pipeline.config.expand_timesteps,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def check_i2v_run(path: Path, index: dict, mode: str | None, max_sequence_length: int) -> None:
    """What an image-to-video run of the folder refuses before any weights load: Wan2.1-I2V's
    image branch with a text length other than 512 (diffusers' Wan attention splits the context
    at a hard-coded 512 text tokens: another length splits it silently and wrongly), and a
    transformer with an image branch in a folder without its image encoder."""
    if mode is None:
        return
    config = _transformer_config(path)
    if config.get("image_dim") is None:
        return
    if max_sequence_length != 512:
        raise ValueError(
            f"{path}: the transformer has Wan2.1-I2V's image cross-attention, which assumes 512 text tokens; "
            f"set data.max_sequence_length 512 (got {max_sequence_length})"
        )
    if not (index.get("image_encoder") or [None])[0] or not (path / "image_encoder").is_dir():
        raise ValueError(
            f"{path}: the transformer takes CLIP image embeddings (image_dim {config['image_dim']}) but the "
            "folder has no image_encoder: use the complete Wan2.1-I2V -Diffusers folder"
        )


@torch.no_grad()
def encode_image_condition(
    pipe, image, mode: str, *, num_frames: int, height: int, width: int, device: torch.device
) -> ImageCondition:
    """The condition of one image (a PIL image), batch 1, through the I2V pipeline's own steps:
    ``encode_image`` (CLIP, where the transformer has ``image_dim``), ``video_processor.preprocess``
    (resized to height x width) and ``prepare_latents`` (VAE encode, normalise, frame mask).

    ``pipe`` is a ``WanImageToVideoPipeline`` (its config's ``expand_timesteps`` must match ``mode``).
    """
    if bool(pipe.config.expand_timesteps) != (mode == "first_frame"):
        raise ValueError(
            f"condition mode {mode!r} does not match expand_timesteps={pipe.config.expand_timesteps}"
        )
    transformer = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    image_embeds = None
    if transformer.config.image_dim is not None:
        image_embeds = pipe.encode_image(image, device).float()  # (1, N, D)
    pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(
        device, dtype=torch.float32
    )
    z = pipe.vae.config.z_dim
    t, s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    placeholder = torch.zeros(1, z, (num_frames - 1) // t + 1, height // s, width // s, device=device)
    out = pipe.prepare_latents(
        pixels, 1, z, height, width, num_frames, torch.float32, device, None, placeholder
    )
    return ImageCondition(mode=mode, latents=out[1].float(), image_embeds=image_embeds)
