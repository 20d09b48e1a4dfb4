"""The image condition of image-to-video Wan models, built and applied as diffusers'
``WanImageToVideoPipeline`` (0.42) builds and applies it.

Two ways to condition on a first frame:

- ``concat`` (Wan2.1-I2V, Wan2.2-I2V-A14B): the image followed by zero frames is VAE-encoded
  (``argmax`` of the latent distribution, normalised by the VAE's ``latents_mean``/``std``) and
  concatenated, behind a 4-channel frame mask (1 on the first frame), to the noise latents on
  the channel axis: the model sees 16 + 4 + 16 = 36 channels and predicts 16. Every latent frame
  is generated (and trained on). Wan2.1-I2V also feeds CLIP image embeddings (the vision
  tower's penultimate hidden states) to its cross-attention's ``add_k_proj`` branch.
- ``first_frame`` (Wan2.2-TI2V-5B's image mode, per-token timesteps): the image alone is
  encoded to one latent frame that replaces the first latent frame of the model input, whose
  tokens get the timestep 0: the first frame is clean throughout. Here it is also kept clean
  in the sampler's state, and the SDE steps and their log-probabilities cover only the
  generated frames 1..F-1: the condition's tokens are never trained on.

The model family encodes an image into its condition (Wan: ``miles.models.i2v.encode_image_condition``).
A condition is computed once per prompt (with batch 1, as the pipeline encodes it) and
repeated over the prompt's group: every sample of a group, and every denoising step, sees the
same condition. Sequence parallelism needs nothing here: the channel concatenation and the
first-frame replacement happen on the latent video, before patchify and so before the shard
boundary, and the image embeddings enter cross-attention, which runs stock (replicated K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("concat", "first_frame")


@dataclass
class ImageCondition:
    """The image condition of a batch of samples (one row per sample); fp32 tensors."""

    mode: str
    latents: Tensor
    """``concat``: (B, 4 + C, F, H, W), frame mask then image latents; ``first_frame``: (B, C, 1, H, W)."""
    image_embeds: Tensor | None = None
    """(B, N, D): CLIP image embeddings for the ``add_k_proj`` branch (Wan2.1-I2V), else None."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"image condition mode must be one of {MODES}, got {self.mode!r}")

    @staticmethod
    def cat(parts: Sequence[ImageCondition]) -> ImageCondition:
        """The conditions of several batches, stacked along the batch axis."""
        embeds = [p.image_embeds for p in parts]
        return ImageCondition(
            mode=parts[0].mode,
            latents=torch.cat([p.latents for p in parts]),
            image_embeds=None if embeds[0] is None else torch.cat(embeds),
        )

    def to(self, device: torch.device | str) -> ImageCondition:
        embeds = None if self.image_embeds is None else self.image_embeds.to(device)
        return ImageCondition(self.mode, self.latents.to(device), embeds)

    def _mask(self, x: Tensor) -> Tensor:
        """The pipeline's ``first_frame_mask``: (1, 1, F, H, W) ones, zeros on latent frame 0."""
        mask = torch.ones(1, 1, *x.shape[2:], dtype=torch.float32, device=x.device)
        mask[:, :, 0] = 0
        return mask

    def model_input(self, x: Tensor) -> Tensor:
        """The transformer's ``hidden_states`` (fp32) for latents ``x`` (B, C, F, H, W)."""
        if self.mode == "concat":
            return torch.cat([x.float(), self.latents.to(x.device)], dim=1)
        mask = self._mask(x)
        return (1 - mask) * self.latents.to(x.device) + mask * x.float()

    def timestep(self, t: Tensor, x: Tensor, patch_size: Sequence[int], batch: int) -> Tensor:
        """The model's timestep for ``batch`` rows at the 0-dim fp32 ``t``: (batch,), or per token
        (batch, S) with 0 on the first frame's tokens (``first_frame``)."""
        if self.mode == "concat":
            return t.expand(batch)
        _, ph, pw = patch_size
        # (F, H/ph, W/pw) -> (S,): the pipeline's first_frame_mask[0][0][:, ::2, ::2] * t
        per_token = (self._mask(x)[0][0][:, ::ph, ::pw] * t).flatten()
        return per_token.unsqueeze(0).expand(batch, -1)

    def clean(self, x: Tensor) -> Tensor:
        """``x`` with the condition's frame put back (``first_frame``), as the pipeline's output."""
        return x if self.mode == "concat" else self.model_input(x)

    def generated(self, x: Tensor) -> Tensor:
        """The part of latents (B, C, F, H, W) that is sampled and trained on."""
        return x if self.mode == "concat" else x[:, :, 1:]

    def full(self, generated: Tensor) -> Tensor:
        """Latents from their generated part (the inverse of ``generated``)."""
        if self.mode == "concat":
            return generated
        return torch.cat([self.latents.to(generated.device, torch.float32), generated], dim=2)


def generated(condition: ImageCondition | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor's generated part (all of it without a condition)."""
    return tensors if condition is None else tuple(condition.generated(t) for t in tensors)


def conditions_of(
    model, images: Sequence, *, num_frames: int, height: int, width: int, device, cache: dict | None = None
) -> ImageCondition:
    """The condition of image files ``images`` (one row each), each distinct file encoded once
    (kept in ``cache``, keyed by path, when given: a rollout encodes a group's image once)."""
    from miles.data.prompts import load_image

    cache = {} if cache is None else cache
    for path in dict.fromkeys(images):
        if path not in cache:
            size = dict(num_frames=num_frames, height=height, width=width, device=device)
            cache[path] = model.encode_images([load_image(path)], **size)
    return ImageCondition.cat([cache[p] for p in images])
