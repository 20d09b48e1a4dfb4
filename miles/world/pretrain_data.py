"""The world's training videos for the pretraining (``miles.pretrain_world``): rendered pools, the
VAE's crops around the ball, the encoded training set and its latent statistics, at any ``Shape``."""

from __future__ import annotations

import numpy as np
import torch

from miles.world.world import SHAPE_9, Shape, parse_prompt, render, train_prompts, trajectory


def render_dataset(
    prompts: list[str], per_prompt: int, seed_offset: int, shape: Shape = SHAPE_9
) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos (N, 3, F, H, W) in [-1, 1] (the VAE's layout) and their prompt index (N,).

    Video k of prompt i uses render seed ``seed_offset + k``: prompt-major, deterministic.
    """
    videos, labels = [], []
    for i, prompt in enumerate(prompts):
        attrs = parse_prompt(prompt)
        for k in range(per_prompt):
            videos.append(render(attrs, seed_offset + k, shape).permute(1, 0, 2, 3) * 2 - 1)
            labels.append(i)
    return torch.stack(videos), torch.tensor(labels)


class VideoPool:
    """``render_dataset``'s videos, rendered on ``device`` when indexed: ``pool[i]`` is video i
    (3, F, H, W) in [-1, 1], the same values ``render_dataset(...)[0][i]`` holds (at 81 x 480 x 832
    a pool of 384 videos would be 150 GB)."""

    def __init__(self, prompts: list[str], per_prompt: int, seed_offset: int, shape: Shape, device):
        self.attrs = [parse_prompt(p) for p in prompts]
        self.per_prompt, self.seed_offset, self.world_shape, self.device = (
            per_prompt,
            seed_offset,
            shape,
            device,
        )
        self.shape = (len(prompts) * per_prompt, 3, shape.num_frames, shape.height, shape.width)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        attrs, seed = self.attrs[i // self.per_prompt], self.seed_offset + i % self.per_prompt
        return render(attrs, seed, self.world_shape, device=self.device).permute(1, 0, 2, 3) * 2 - 1


def video_pool(
    prompts: list[str], per_prompt: int, seed_offset: int, shape: Shape, device, max_bytes: float = 2**30
):
    """The videos as one CPU tensor (``render_dataset``) when they fit in ``max_bytes``, else a
    ``VideoPool`` rendering them on ``device``; both index alike."""
    if len(prompts) * per_prompt * 3 * shape.num_frames * shape.height * shape.width * 4 <= max_bytes:
        return render_dataset(prompts, per_prompt, seed_offset, shape)[0]
    return VideoPool(prompts, per_prompt, seed_offset, shape, device)


def ball_centres(prompts: list[str], per_prompt: int, seed_offset: int, shape: Shape) -> torch.Tensor:
    """The ball's (x, y) per frame (N, F, 2) in the videos of ``render_dataset(prompts, per_prompt,
    seed_offset, shape)``, in its order: what ``crop_batch`` centres its crops on."""
    return torch.stack(
        [
            torch.from_numpy(trajectory(parse_prompt(p), seed_offset + k, shape)[0])
            for p in prompts
            for k in range(per_prompt)
        ]
    )


def crop_batch(
    pool, centres: torch.Tensor, batch: int, frames: int, crop: int, rng: np.random.Generator
) -> torch.Tensor:
    """Random ``crop`` x ``crop`` x ``frames`` clips (batch, 3, frames, crop, crop) around the ball.

    ``pool``: videos (N, 3, F, H, W), a tensor or a ``VideoPool``. ``centres`` (N, F, 2) are the
    ball's (x, y) per frame; the crop is centred on the ball at a random frame of the clip, jittered
    by up to a quarter crop, and kept inside the frame.
    """
    n, _, num_frames, h, w = pool.shape
    clips = []
    for _ in range(batch):
        i = int(rng.integers(n))
        t0 = int(rng.integers(num_frames - frames + 1))
        cx, cy = centres[i, t0 + int(rng.integers(frames))].tolist()
        jx, jy = rng.uniform(-crop / 4, crop / 4, size=2)
        x0 = int(np.clip(round(cx + jx - crop / 2), 0, w - crop))
        y0 = int(np.clip(round(cy + jy - crop / 2), 0, h - crop))
        clips.append(pool[i][:, t0 : t0 + frames, y0 : y0 + crop, x0 : x0 + crop])
    return torch.stack(clips)


@torch.no_grad()
def encode_videos(vae, videos: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """Posterior means (N, z, F', H', W') of videos (N, 3, F, H, W) in [-1, 1], un-normalised, on CPU."""
    device = next(vae.parameters()).device
    return torch.cat(
        [
            vae.encode(videos[i : i + chunk].to(device)).latent_dist.mode().cpu()
            for i in range(0, len(videos), chunk)
        ]
    )


@torch.no_grad()
def encode_training_set(cfg, vae, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior means (N, z, F', H', W') on ``device`` of the prior's training renders (``cfg``: a
    ``PretrainConfig`` (render
    seeds 0..videos_per_prompt-1 of each training prompt, prompt-major), rendered and encoded
    ``encode_chunk`` at a time (81-frame videos are never all held), and their prompt index (N,)."""
    prompts = train_prompts()
    n = len(prompts) * cfg.videos_per_prompt
    pool = VideoPool(prompts, cfg.videos_per_prompt, 0, cfg.world_shape, device)
    chunks = []
    for i0 in range(0, n, cfg.encode_chunk):
        videos = torch.stack([pool[i] for i in range(i0, min(i0 + cfg.encode_chunk, n))])
        chunks.append(encode_videos(vae, videos, chunk=cfg.encode_chunk))
    return torch.cat(chunks).to(device), torch.arange(n) // cfg.videos_per_prompt


def set_latent_stats(vae, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write per-channel mean/std of latents (N, C, ...) into the VAE config; returns (mean, std)."""
    dims = [0] + list(range(2, latents.ndim))
    mean, std = latents.mean(dim=dims), latents.std(dim=dims)
    vae.register_to_config(
        latents_mean=[round(float(v), 6) for v in mean], latents_std=[round(float(v), 6) for v in std]
    )
    mean = torch.tensor(vae.config.latents_mean)
    std = torch.tensor(vae.config.latents_std)
    return mean, std
