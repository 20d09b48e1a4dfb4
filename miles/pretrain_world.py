"""Pretrain the tiny world's Wan pipeline: a tiny VAE, then a tiny Wan prior, from fixed seeds.

    python -m miles.pretrain_world miles/world/pipeline   # ~41 CPU-min: ~20 min on 2 free cores

1. **VAE.** A tiny ``AutoencoderKLWan`` (2.5M parameters) learns to reconstruct the world's
   training videos from random 32x32 crops around the ball: 5-frame clips first, then 9-frame
   clips (5-frame clips alone leave the third latent frame untrained), 1000 + 300 AdamW steps at
   1e-3. Loss ``mse + 0.5 l1 + 1e-4 kl`` (kl: mean per latent element), departing from the
   feasibility spike's recipe in one point: the ball's pixels weigh 5x (``vae_loss``), without
   which the VAE sat for 500-1000 steps on "everything is grey" in a sweep. The encoded
   dataset's per-channel mean/std go into the VAE config (``latents_mean``/``latents_std``),
   which Wan's decode path un-normalises with.
2. **Prior.** A tiny ``WanTransformer3DModel`` (4 blocks, 4 heads x 16) learns rectified flow on
   the normalised latents of the training split only: x_s = (1 - s) x0 + s eps, target
   eps - x0, timestep 1000 s, with s drawn from the sampler's shift-3 density (s = 3u / (1 + 2u),
   u uniform). Text comes from the project's tiny UMT5 (``miles.models.tiny``) at
   ``max_sequence_length`` 64, as the RL recipe encodes it; 10% of captions are swapped for the
   empty negative prompt "" so classifier-free guidance works.
3. **Headroom for RL.** The prior must draw a ball yet follow prompts only partly: it is stopped
   early (``dit_steps``), when colour is mostly right but direction, learned last, is not, and the
   balls are still imperfect (some fade or split). A sweep (GPU, same recipe) measured held-out
   adherence 0.23 at 1000 steps, 0.37 at 2000, 0.54 at 3000, rising; the committed CPU run
   (3000 steps) measured 0.42 held-out, 0.64 train (``pretrain_report.json``).
   ``caption_noise`` (captions swapped for random training prompts) is the other knob, off by
   default: see its docstring.
4. **Save and measure.** The folder is an ordinary single-expert diffusers ``WanPipeline``
   (scheduler ``FlowMatchEulerDiscreteScheduler(shift=3.0)``), written atomically; the VAE is
   stored in fp16 to keep the committed weights small (``load_wan`` loads it as fp32). It is
   then reloaded through ``miles.models.wan.load_wan`` and sampled as the trainer's evaluation
   samples (ODE, 8 steps, guidance 4, fixed seeds): mean ``world_adherence`` on the train and
   held-out prompts goes to ``OUT_DIR/../pretrain_report.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from miles.world.world import (
    NUM_FRAMES,
    parse_prompt,
    render,
    train_prompts,
    trajectory,
)

WORLD_VAE = dict(
    base_dim=16,
    z_dim=8,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
NEGATIVE_PROMPT = ""
SHIFT = 3.0


@dataclass(frozen=True)
class PretrainConfig:
    """Every knob of the pretraining; the defaults made the committed ``miles/world/pipeline``."""

    seed: int = 0
    num_threads: int = 2
    # VAE
    vae_short_steps: int = 1000
    """AdamW steps on 5-frame crops."""
    vae_long_steps: int = 300
    """AdamW steps on 9-frame crops, after the short ones."""
    vae_foreground_weight: float = 4.0
    """Extra weight of the ball's pixels in the reconstruction loss (see ``vae_loss``)."""
    vae_batch: int = 8
    vae_lr: float = 1e-3
    crop: int = 32
    vae_pool_per_prompt: int = 16
    """Videos per training prompt the VAE crops from."""
    # prior
    videos_per_prompt: int = 48
    """Rendered (and encoded) videos per training prompt: the prior's dataset."""
    dit_steps: int = 3000
    dit_batch: int = 64
    dit_lr: float = 1e-3
    caption_noise: float = 0.0
    """Probability that a video's caption is replaced by a uniformly drawn training prompt. Off by
    default: at 0.25-0.8 the ODE sampler blends the attributes a caption stands for into faded or
    split balls (object quality fell from ~0.7 to ~0.5) instead of choosing one of them."""
    text_dropout: float = 0.1
    """Probability that a caption is replaced by the negative prompt's embedding (for CFG)."""
    max_sequence_length: int = 64
    # evaluation
    eval_seeds_heldout: int = 8
    eval_seeds_train: int = 4
    eval_steps: int = 8
    eval_guidance: float = 4.0
    eval_seed: int = 1234


def log(msg: str, start: float) -> None:
    print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)


def render_dataset(
    prompts: list[str], per_prompt: int, seed_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos (N, 3, F, H, W) in [-1, 1] (the VAE's layout) and their prompt index (N,).

    Video k of prompt i uses render seed ``seed_offset + k``: prompt-major, deterministic.
    """
    videos, labels = [], []
    for i, prompt in enumerate(prompts):
        attrs = parse_prompt(prompt)
        for k in range(per_prompt):
            videos.append(render(attrs, seed_offset + k).permute(1, 0, 2, 3) * 2 - 1)
            labels.append(i)
    return torch.stack(videos), torch.tensor(labels)


def _crop_batch(
    pool: torch.Tensor, centres: torch.Tensor, batch: int, frames: int, crop: int, rng: np.random.Generator
) -> torch.Tensor:
    """Random ``crop`` x ``crop`` x ``frames`` clips (batch, 3, frames, crop, crop) around the ball.

    ``centres`` (N, F, 2) are the ball's (x, y) per frame; the crop is centred on the ball at a
    random frame of the clip, jittered by up to a quarter crop, and kept inside the frame.
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
        clips.append(pool[i, :, t0 : t0 + frames, y0 : y0 + crop, x0 : x0 + crop])
    return torch.stack(clips)


def vae_loss(vae, x: torch.Tensor, generator: torch.Generator, foreground_weight: float) -> torch.Tensor:
    """``mse + 0.5 l1 + 1e-4 kl`` of one reconstruction of x (B, 3, F, H, W) in [-1, 1].

    Pixels of the ball (any channel off the grey, which is 0 here) weigh ``1 + foreground_weight``
    in the reconstruction terms, normalised by the mean weight: a crop is mostly background, and
    without it the VAE sits for hundreds of steps on "everything is grey". kl: the mean over
    latent elements. The posterior noise is drawn from the CPU ``generator``.
    """
    posterior = vae.encode(x).latent_dist
    eps = torch.randn(posterior.mean.shape, generator=generator).to(x.device)
    rec = vae.decode(posterior.mean + posterior.std * eps).sample
    weight = 1 + foreground_weight * (x.abs().amax(dim=1, keepdim=True) > 0.02).float()  # (B, 1, F, H, W)
    err = rec - x
    recon = (weight * (err**2 + 0.5 * err.abs())).mean() / weight.mean()
    kl = 0.5 * (posterior.mean**2 + posterior.var - 1.0 - posterior.logvar).mean()
    return recon + 1e-4 * kl


def train_vae(cfg: PretrainConfig, start: float, device: torch.device | str = "cpu"):
    """The tiny ``AutoencoderKLWan`` trained on crops of training-split videos (latent stats unset)."""
    from diffusers import AutoencoderKLWan

    prompts = train_prompts()
    pool, _ = render_dataset(prompts, cfg.vae_pool_per_prompt, seed_offset=10_000)
    centres = torch.stack(
        [
            torch.from_numpy(trajectory(parse_prompt(prompts[i]), 10_000 + k)[0])
            for i in range(len(prompts))
            for k in range(cfg.vae_pool_per_prompt)
        ]
    )
    torch.manual_seed(cfg.seed)
    vae = AutoencoderKLWan(**WORLD_VAE).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    total = cfg.vae_short_steps + cfg.vae_long_steps
    running = None
    for step in range(total):
        frames = 5 if step < cfg.vae_short_steps else NUM_FRAMES
        x = _crop_batch(pool, centres, cfg.vae_batch, frames, cfg.crop, rng).to(device)
        loss = vae_loss(vae, x, gen, cfg.vae_foreground_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 50 == 0 or step + 1 == total:
            log(f"vae step {step + 1}/{total} ({frames} frames) loss {running:.4f}", start)
    return vae.eval().requires_grad_(False)


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


def base_pipeline():
    """The project's tiny single-expert pipeline: its seeded tiny UMT5 and tokenizer are reused as is."""
    from miles.models.tiny import build_pipeline

    return build_pipeline("single_expert")


def world_transformer_config() -> dict:
    """The tiny Wan of ``miles.models.tiny`` at 4 blocks, ffn 256, on the world VAE's 8 channels."""
    from miles.models.tiny import TINY_TEXT_ENCODER, TINY_TRANSFORMER

    z = WORLD_VAE["z_dim"]
    return dict(
        TINY_TRANSFORMER,
        in_channels=z,
        out_channels=z,
        ffn_dim=256,
        num_layers=4,
        text_dim=TINY_TEXT_ENCODER["d_model"],
    )


@torch.no_grad()
def encode_text(pipe, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds (P, L, D), negative_embeds (1, L, D)) through ``WanPipeline.encode_prompt``."""
    pos, neg = pipe.encode_prompt(
        prompt=prompts,
        negative_prompt=[NEGATIVE_PROMPT] * len(prompts),
        do_classifier_free_guidance=True,
        max_sequence_length=max_sequence_length,
        device=torch.device("cpu"),
    )
    return pos, neg[:1]


def shifted_sigmas(u: torch.Tensor, shift: float = SHIFT) -> torch.Tensor:
    """The sampler's time shift of uniform ``u``: shift u / (1 + (shift - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def flow_matching_loss(
    transformer, x0: torch.Tensor, context: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Rectified-flow MSE for clean latents x0 (B, C, F, H, W) under text ``context`` (B, L, D).

    The noise is drawn from the CPU ``generator`` whatever the device, so a run's draws do not
    depend on where it trains.
    """
    b = x0.shape[0]
    s = shifted_sigmas(torch.rand(b, generator=generator)).to(x0.device)
    eps = torch.randn(x0.shape, generator=generator).to(x0.device)
    sv = s.view(b, 1, 1, 1, 1)
    xt = (1 - sv) * x0 + sv * eps
    out = transformer(hidden_states=xt, timestep=1000 * s, encoder_hidden_states=context, return_dict=False)
    return F.mse_loss(out[0].float(), eps - x0)


def noisy_captions(
    labels: torch.Tensor,
    num_prompts: int,
    caption_noise: float,
    text_dropout: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Caption index per sample: its own prompt, a random training prompt (``caption_noise``), or
    -1 for the negative prompt (``text_dropout``, applied last)."""
    b = labels.shape[0]
    swap = torch.rand(b, generator=generator) < caption_noise
    random_prompt = torch.randint(num_prompts, (b,), generator=generator)
    captions = torch.where(swap, random_prompt, labels)
    drop = torch.rand(b, generator=generator) < text_dropout
    return torch.where(drop, torch.full_like(captions, -1), captions)


def train_transformer(
    cfg: PretrainConfig,
    latents: torch.Tensor,
    labels: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_embeds: torch.Tensor,
    start: float,
    callback: Callable[[int, torch.nn.Module], None] | None = None,
    callback_every: int = 250,
):
    """The tiny Wan prior on normalised latents (N, C, F, H, W) captioned by ``labels`` (N,).

    Trains on the device of ``latents``; ``callback(step, transformer)``, if given, runs every
    ``callback_every`` steps (for sweeps over the schedule).
    """
    from diffusers import WanTransformer3DModel

    torch.manual_seed(cfg.seed + 1)
    transformer = WanTransformer3DModel(**world_transformer_config()).to(latents.device).train()
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.dit_lr)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    table = torch.cat([prompt_embeds, negative_embeds])  # row -1 is the negative prompt
    running = None
    for step in range(cfg.dit_steps):
        idx = torch.randint(len(latents), (cfg.dit_batch,), generator=gen)
        captions = noisy_captions(labels[idx], len(prompt_embeds), cfg.caption_noise, cfg.text_dropout, gen)
        context = table[captions.to(table.device)]
        loss = flow_matching_loss(transformer, latents[idx.to(latents.device)], context, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % 100 == 0 or step + 1 == cfg.dit_steps:
            log(f"prior step {step + 1}/{cfg.dit_steps} loss {running:.4f}", start)
        if callback is not None and (step + 1) % callback_every == 0:
            callback(step + 1, transformer.eval())
            transformer.train()
    return transformer.eval().requires_grad_(False)


def assemble_pipeline(text_pipe, vae, transformer):
    """A single-expert ``WanPipeline`` like ``build_pipeline("single_expert")``, with the world's parts."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(
        tokenizer=text_pipe.tokenizer,
        text_encoder=text_pipe.text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        transformer=transformer,
    )


def save_pipeline_atomically(pipe, out_dir: Path) -> Path:
    """``save_pretrained`` (safetensors, VAE in fp16) into a temporary folder, then rename it to
    ``out_dir``: a half-written folder never appears there."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is meant to be shared
        pipe.vae.to(torch.float16)
        pipe.save_pretrained(tmp, safe_serialization=True)
        pipe.vae.to(torch.float32)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@torch.no_grad()
def evaluate(model, prompts: list[str], num_seeds: int, cfg: PretrainConfig) -> dict:
    """Mean ``world_adherence`` (and each check's mean) of ODE samples of ``model`` (a ``WanModel``).

    Seed j draws the initial noise of every prompt from ``Generator().manual_seed(eval_seed + j)``;
    sampling is the trainer's (``sample_with_logprob``, noise_level 0, the rollout's CFG).
    """
    from miles.rewards.world import world_scores
    from miles.rollout.sampler import sample_with_logprob
    from miles.world.world import HEIGHT, WIDTH

    device = torch.device("cpu")
    pos, neg = model.encode_prompts(prompts, NEGATIVE_PROMPT, cfg.max_sequence_length, device)
    shape = model.latent_shape(NUM_FRAMES, HEIGHT, WIDTH)
    per_seed = []
    for j in range(num_seeds):
        rollout = sample_with_logprob(
            model.transformers,
            pos,
            neg,
            shape,
            num_steps=cfg.eval_steps,
            shift=SHIFT,
            guidance_scales=cfg.eval_guidance,
            noise_level=0.0,
            generator=torch.Generator().manual_seed(cfg.eval_seed + j),
        )
        per_seed.append(world_scores(model.decode(rollout.final_latents), prompts))
    scores = {k: torch.stack([s[k] for s in per_seed]) for k in per_seed[0]}  # each (seeds, P)
    out = {k: round(float(v.mean()), 4) for k, v in scores.items()}
    out["per_prompt"] = {p: round(float(a), 4) for p, a in zip(prompts, scores["adherence"].mean(dim=0))}
    out["num_samples"] = len(prompts) * num_seeds
    return out


def pretrain(out_dir: Path, cfg: PretrainConfig = PretrainConfig()) -> dict:
    """Train, save to ``out_dir`` atomically, reload through ``load_wan`` and evaluate; returns the report."""
    from miles.config import ModelConfig
    from miles.models.wan import load_wan
    from miles.world.world import heldout_prompts

    torch.set_num_threads(cfg.num_threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    times = {}
    vae = train_vae(cfg, start)
    times["vae_s"] = time.perf_counter() - start

    prompts = train_prompts()
    videos, labels = render_dataset(prompts, cfg.videos_per_prompt, seed_offset=0)
    raw = encode_videos(vae, videos)
    del videos
    mean, std = set_latent_stats(vae, raw)
    latents = (raw - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    log(f"encoded {len(latents)} training videos to latents {tuple(latents.shape[1:])}", start)
    text_pipe = base_pipeline()
    prompt_embeds, negative_embeds = encode_text(text_pipe, prompts, cfg.max_sequence_length)
    t0 = time.perf_counter()
    transformer = train_transformer(cfg, latents, labels, prompt_embeds, negative_embeds, start)
    times["prior_s"] = time.perf_counter() - t0

    save_pipeline_atomically(assemble_pipeline(text_pipe, vae, transformer), out_dir)
    log(f"saved {out_dir}", start)
    t0 = time.perf_counter()
    model = load_wan(ModelConfig(path=str(out_dir)), torch.device("cpu"))
    report = {
        "train": evaluate(model, train_prompts(), cfg.eval_seeds_train, cfg),
        "heldout": evaluate(model, heldout_prompts(), cfg.eval_seeds_heldout, cfg),
    }
    times["eval_s"] = time.perf_counter() - t0
    times["total_s"] = time.perf_counter() - start
    # CPU seconds of this process: on a busy machine, cpu_s / num_threads is the unshared wall time
    times["cpu_s"] = time.process_time() - cpu_start
    report.update(
        times={k: round(v, 1) for k, v in times.items()},
        config=dataclasses.asdict(cfg),
        torch=torch.__version__,
    )
    return report


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit("usage: python -m miles.pretrain_world OUT_DIR   (e.g. miles/world/pipeline)")
    out_dir = Path(argv[0])
    report = pretrain(out_dir)
    path = out_dir.parent / "pretrain_report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for split in ("train", "heldout"):
        r = report[split]
        print(
            f"{split:8s} adherence {r['adherence']:.3f}  (colour {r['colour']:.3f}, "
            f"motion {r['motion']:.3f}, "
            f"size {r['size']:.3f}, quality {r['quality']:.3f}; {r['num_samples']} samples)"
        )
    t = report["times"]
    print(f"wall time {t['total_s'] / 60:.1f} min ({t['cpu_s'] / 60:.1f} CPU-min); report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
