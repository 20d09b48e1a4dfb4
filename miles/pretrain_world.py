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

The stages take the world's shape and the models' configs from ``PretrainConfig`` (``shape``,
``vae``, ``prior``, ``device``, ``dtype``, ``compile``): ``miles.pretrain_world_81`` is this code at
``SHAPE_81`` with a 16-channel VAE and a 128-wide-head prior on a GPU. Videos are rendered on
demand when the pool would not fit (``VideoPool``); the values are the same either way.

**Resume.** ``--max-minutes M`` (``Budget``): at the budget, or at a SIGTERM, the run saves its
whole state (stage, step, model, optimizer, every random stream) atomically in ``--state-dir``
(default ``.OUT_DIR.resume`` beside OUT_DIR) and exits with status 75 (``PAUSED_EXIT``); the same
command continues it, bitwise on CPU (``miles.pretrain_resume``). Without a budget nothing changes:
the defaults give the committed folder's weights byte for byte.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from miles.pretrain_resume import (
    PAUSED_EXIT,
    Budget,
    Paused,
    Resumable,
    cli_budget,
    rng_state,
    run_paused_or_done,
    set_rng_state,
    timed,
)
from miles.world.pretrain_data import VideoPool as VideoPool
from miles.world.pretrain_data import ball_centres, video_pool
from miles.world.pretrain_data import crop_batch as _crop_batch
from miles.world.pretrain_data import encode_training_set as encode_training_set
from miles.world.pretrain_data import encode_videos as encode_videos
from miles.world.pretrain_data import render_dataset as render_dataset
from miles.world.pretrain_data import set_latent_stats as set_latent_stats
from miles.world.world import HEIGHT, NUM_FRAMES, WIDTH, Shape, train_prompts

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
    shape: tuple[int, int, int] = (NUM_FRAMES, HEIGHT, WIDTH)
    """The world's (frames, height, width): ``miles.world.Shape``."""
    device: str = "cpu"
    dtype: str = "float32"
    """Autocast dtype of the VAE's and the prior's training on CUDA (fp32 master weights); float32:
    no autocast. CPU never autocasts."""
    compile: bool = False
    """``torch.compile`` each transformer block (CUDA only)."""
    vae: dict = field(default_factory=lambda: dict(WORLD_VAE))
    """The ``AutoencoderKLWan`` config."""
    prior: dict | None = None
    """The ``WanTransformer3DModel`` config (None: ``world_transformer_config()``)."""
    vae_path: str | None = None
    """A trained ``AutoencoderKLWan`` folder to reuse instead of training one (its z_dim must be the
    prior's in_channels)."""
    # VAE
    vae_short_steps: int = 1000
    """AdamW steps on short clips (``vae_clip_frames[0]`` frames)."""
    vae_long_steps: int = 300
    """AdamW steps on long clips (``vae_clip_frames[1]``), after the short ones."""
    vae_clip_frames: tuple[int, int] = (5, NUM_FRAMES)
    """Frames of the VAE's short and long training clips (5-frame clips alone leave the third latent
    frame untrained)."""
    vae_foreground_weight: float = 4.0
    """Extra weight of the ball's pixels in the reconstruction loss (see ``vae_loss``)."""
    vae_batch: int = 8
    vae_lr: float = 1e-3
    crop: int = 32
    """Crop side (px), at most the frame's short side."""
    vae_pool_per_prompt: int = 16
    """Videos per training prompt the VAE crops from."""
    # prior
    videos_per_prompt: int = 48
    """Rendered (and encoded) videos per training prompt: the prior's dataset."""
    encode_chunk: int = 32
    """Videos rendered and encoded at a time."""
    dit_steps: int = 3000
    dit_batch: int = 64
    dit_lr: float = 1e-3
    device_noise: bool = False
    """Draw the flow-matching noise on the latents' device from its own generator (a batch of
    81-frame latents is 17M values: seconds a step on a CPU generator); False: from the CPU one."""
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
    eval_reserve_s: float = 120.0
    """With a time budget, the evaluation (which cannot pause midway) starts only with this much left."""

    @property
    def world_shape(self) -> Shape:
        return Shape(*self.shape)


def log(msg: str, start: float) -> None:
    print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)


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


def _autocast(cfg: PretrainConfig, device: torch.device):
    """bf16 (``cfg.dtype``) autocast on CUDA; nothing on CPU or at float32."""
    if torch.device(device).type != "cuda" or cfg.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, cfg.dtype))


def train_vae(
    cfg: PretrainConfig, start: float, device: torch.device | str = "cpu", run: Resumable | None = None
):
    """The ``cfg.vae`` ``AutoencoderKLWan`` trained on crops of training-split videos (latent stats
    unset); ``run``: pause at its budget and continue from its state."""
    from diffusers import AutoencoderKLWan

    prompts, shape = train_prompts(), cfg.world_shape
    pool = video_pool(prompts, cfg.vae_pool_per_prompt, 10_000, shape, device)
    centres = ball_centres(prompts, cfg.vae_pool_per_prompt, 10_000, shape)
    torch.manual_seed(cfg.seed)
    vae = AutoencoderKLWan(**cfg.vae).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    total = cfg.vae_short_steps + cfg.vae_long_steps
    running, first = None, 0
    saved = run.get("vae_train") if run is not None else None
    if saved:
        vae.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        set_rng_state(saved["rng"], {"gen": gen}, rng)
        running, first = saved["running"], saved["step"]
    crop = min(cfg.crop, shape.height, shape.width)
    for step in range(first, total):
        if run is not None and run.due():
            snapshot = dict(step=step, model=vae.state_dict(), opt=opt.state_dict(), running=running)
            run.pause("vae", step, vae_train=dict(snapshot, rng=rng_state({"gen": gen}, rng)))
        frames = min(cfg.vae_clip_frames[0 if step < cfg.vae_short_steps else 1], shape.num_frames)
        x = _crop_batch(pool, centres, cfg.vae_batch, frames, crop, rng).to(device)
        with _autocast(cfg, device):
            loss = vae_loss(vae, x, gen, cfg.vae_foreground_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 50 == 0 or step + 1 == total:
            log(f"vae step {step + 1}/{total} ({frames} frames) loss {running:.4f}", start)
    return vae.eval().requires_grad_(False)


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


def prior_config(cfg: PretrainConfig) -> dict:
    """The prior's ``WanTransformer3DModel`` config: ``cfg.prior``, else ``world_transformer_config()``."""
    return dict(cfg.prior) if cfg.prior is not None else world_transformer_config()


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
    transformer,
    x0: torch.Tensor,
    context: torch.Tensor,
    generator: torch.Generator,
    noise: torch.Generator | None = None,
) -> torch.Tensor:
    """Rectified-flow MSE for clean latents x0 (B, C, F, H, W) under text ``context`` (B, L, D).

    The noise levels are drawn from the CPU ``generator``; the noise too, whatever the device (a
    run's draws do not depend on where it trains), unless ``noise``, a generator on the latents'
    device, is given (81-frame latents: 17M values a batch).
    """
    b = x0.shape[0]
    s = shifted_sigmas(torch.rand(b, generator=generator)).to(x0.device)
    if noise is None:
        eps = torch.randn(x0.shape, generator=generator).to(x0.device)
    else:
        eps = torch.randn(x0.shape, generator=noise, device=x0.device)
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
    run: Resumable | None = None,
):
    """The prior (``prior_config(cfg)``) on normalised latents (N, C, F, H, W) captioned by ``labels`` (N,).

    Trains on the device of ``latents`` (bf16 autocast and compiled blocks on CUDA as ``cfg``
    says); ``callback(step, transformer)``, if given, runs every ``callback_every`` steps (for
    sweeps over the schedule); ``run``: pause at its budget and continue from its state.
    """
    from diffusers import WanTransformer3DModel

    device = latents.device
    torch.manual_seed(cfg.seed + 1)
    transformer = WanTransformer3DModel(**prior_config(cfg)).to(device).train()
    if cfg.compile and device.type == "cuda":
        for block in transformer.blocks:
            block.compile()
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.dit_lr)
    gens = {"gen": torch.Generator().manual_seed(cfg.seed + 2)}
    if cfg.device_noise:
        gens["noise"] = torch.Generator(device=device).manual_seed(cfg.seed + 3)
    table = torch.cat([prompt_embeds, negative_embeds]).to(device)  # row -1 is the negative prompt
    running, first = None, 0
    saved = run.get("prior_train") if run is not None else None
    if saved:
        transformer.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        set_rng_state(saved["rng"], gens)
        running, first = saved["running"], saved["step"]
    for step in range(first, cfg.dit_steps):
        if run is not None and run.due():
            snapshot = dict(step=step, model=transformer.state_dict(), opt=opt.state_dict(), running=running)
            run.pause("prior", step, prior_train=dict(snapshot, rng=rng_state(gens)))
        idx = torch.randint(len(latents), (cfg.dit_batch,), generator=gens["gen"])
        captions = noisy_captions(
            labels[idx], len(prompt_embeds), cfg.caption_noise, cfg.text_dropout, gens["gen"]
        )
        context = table[captions.to(table.device)]
        with _autocast(cfg, device):
            loss = flow_matching_loss(
                transformer, latents[idx.to(device)], context, gens["gen"], gens.get("noise")
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = loss.detach().float()  # the running mean stays on the device: no sync a step
        running = loss if running is None else 0.98 * running + 0.02 * loss
        if (step + 1) % 100 == 0 or step + 1 == cfg.dit_steps:
            log(f"prior step {step + 1}/{cfg.dit_steps} loss {float(running):.4f}", start)
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
def evaluate(model, prompts: list[str], num_seeds: int, cfg, shift=SHIFT, routing=None) -> dict:
    """Mean ``world_adherence`` (and each check's mean) of ODE samples of ``model`` (a ``WanModel``;
    an ``LTXModel`` with its ``shift`` schedule and ``routing``: ``miles.pretrain_world_ltx``).

    Seed j draws the initial noise of every prompt from ``Generator().manual_seed(eval_seed + j)``;
    sampling is the trainer's (``sample_with_logprob``, noise_level 0, the rollout's CFG).
    """
    from miles.rewards.world import world_scores
    from miles.rollout.sampler import sample_with_logprob

    device = torch.device("cpu")
    pos, neg = model.encode_prompts(prompts, NEGATIVE_PROMPT, cfg.max_sequence_length, device)
    shape = model.latent_shape(*cfg.shape)
    per_seed = []
    for j in range(num_seeds):
        rollout = sample_with_logprob(
            model.transformers,
            pos,
            neg,
            shape,
            num_steps=cfg.eval_steps,
            shift=shift,
            guidance_scales=cfg.eval_guidance,
            routing=routing,
            noise_level=0.0,
            generator=torch.Generator().manual_seed(cfg.eval_seed + j),
        )
        per_seed.append(world_scores(model.decode(rollout.final_latents), prompts))
    scores = {k: torch.stack([s[k] for s in per_seed]) for k in per_seed[0]}  # each (seeds, P)
    out = {k: round(float(v.mean()), 4) for k, v in scores.items()}
    out["per_prompt"] = {p: round(float(a), 4) for p, a in zip(prompts, scores["adherence"].mean(dim=0))}
    out["num_samples"] = len(prompts) * num_seeds
    return out


def evaluate_splits(cfg: PretrainConfig, out_dir: Path, device: torch.device) -> dict:
    """The saved folder reloaded through ``load_wan`` (on CPU) and ``evaluate``d on both splits."""
    from miles.config import ModelConfig
    from miles.models.wan import load_wan
    from miles.world.world import heldout_prompts

    model = load_wan(ModelConfig(path=str(out_dir)), torch.device("cpu"))
    return {
        "train": evaluate(model, train_prompts(), cfg.eval_seeds_train, cfg),
        "heldout": evaluate(model, heldout_prompts(), cfg.eval_seeds_heldout, cfg),
    }


def default_state_dir(out_dir: Path) -> Path:
    """Where a paused run keeps its state: ``.NAME.resume`` beside ``out_dir``."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.resume"


def _device(cfg: PretrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device 'cuda' is not available here (this pretraining needs a GPU)")
    return torch.device(cfg.device)


def _trained_vae(cfg: PretrainConfig, run: Resumable, start: float, device: torch.device):
    """``vae_path``'s VAE, the one a paused run finished, or one trained now (then kept in the state)."""
    from diffusers import AutoencoderKLWan

    if cfg.vae_path:
        vae = AutoencoderKLWan.from_pretrained(cfg.vae_path, torch_dtype=torch.float32).to(device)
    elif run.stage in (None, "vae"):
        vae = train_vae(cfg, start, device, run)
        run.save("prior", vae=vae.state_dict(), vae_train=None)
    else:
        vae = AutoencoderKLWan(**cfg.vae)
        vae.load_state_dict(run.get("vae"))
        vae = vae.to(device)
    return vae.eval().requires_grad_(False)


def _train_and_save(cfg: PretrainConfig, run: Resumable, out_dir: Path, device, start: float, times: dict):
    """The VAE, the latents and their statistics, the text, the prior, the atomic save."""
    with timed(times, "vae_s"):
        vae = _trained_vae(cfg, run, start, device)
    if vae.config.z_dim != prior_config(cfg)["in_channels"]:
        raise SystemExit(
            f"the VAE has {vae.config.z_dim} latent channels, the prior reads {prior_config(cfg)['in_channels']}"
        )
    with timed(times, "encode_s"):
        raw, labels = encode_training_set(cfg, vae, device)
        mean, std = set_latent_stats(vae, raw)
        latents = (raw - mean.to(device).view(1, -1, 1, 1, 1)) / std.to(device).view(1, -1, 1, 1, 1)
        del raw
        log(f"encoded {len(latents)} training videos to latents {tuple(latents.shape[1:])}", start)
        text_pipe = base_pipeline()
        prompt_embeds, negative_embeds = encode_text(text_pipe, train_prompts(), cfg.max_sequence_length)
    with timed(times, "prior_s"):
        transformer = train_transformer(cfg, latents, labels, prompt_embeds, negative_embeds, start, run=run)
    latent_shape = list(latents.shape[1:])
    del latents
    transformer = getattr(transformer, "_orig_mod", transformer).float().cpu()
    save_pipeline_atomically(assemble_pipeline(text_pipe, vae.float().cpu(), transformer), out_dir)
    log(f"saved {out_dir}", start)
    run.save("eval", vae=None, prior_train=None, latent_shape=latent_shape)


def pretrain(
    out_dir: Path,
    cfg: PretrainConfig = PretrainConfig(),
    budget: Budget | None = None,
    evaluate_fn: Callable[[PretrainConfig, Path, torch.device], dict] | None = None,
    state_dir: Path | None = None,
) -> dict:
    """Train, save to ``out_dir`` atomically, reload and evaluate (``evaluate_fn``, default
    ``evaluate_splits``); returns the report. With a ``budget`` the run may raise ``Paused`` with
    its state in ``state_dir`` (default ``default_state_dir(out_dir)``); called again with the same
    ``cfg`` it continues from there."""
    out_dir = Path(out_dir)
    device = _device(cfg)
    torch.set_num_threads(cfg.num_threads)
    fingerprint = {"class": type(cfg).__name__, **dataclasses.asdict(cfg)}
    run = Resumable(state_dir or default_state_dir(out_dir), fingerprint, budget)
    start, cpu_start = time.perf_counter(), time.process_time()
    times = dict(run.get("times") or {})
    times["launches"] = times.get("launches", 0) + 1
    try:
        with timed(times, "total_s"):
            if run.stage != "eval":
                _train_and_save(cfg, run, out_dir, device, start, times)
            if run.due(reserve_s=cfg.eval_reserve_s):
                run.pause("eval", 0)
            with timed(times, "eval_s"):
                report = (evaluate_fn or evaluate_splits)(cfg, out_dir, device)
    except Paused:
        # CPU seconds of this process: on a busy machine, cpu_s / num_threads is the unshared wall time
        times["cpu_s"] = times.get("cpu_s", 0.0) + time.process_time() - cpu_start
        run.save(run.stage, times=times)
        raise
    times["cpu_s"] = times.get("cpu_s", 0.0) + time.process_time() - cpu_start
    report.update(
        times={k: round(v, 1) for k, v in times.items()},
        config=dataclasses.asdict(cfg),
        latent_shape=run.get("latent_shape"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )
    run.finish()
    return report


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m miles.pretrain_world", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="the pipeline folder to write (e.g. miles/world/pipeline)")
    p.add_argument(
        "--max-minutes", type=float, default=None, help="pause (exit 75) after this long; rerun to continue"
    )
    p.add_argument(
        "--state-dir", type=Path, default=None, help="a paused run's state (default: .OUT_DIR.resume)"
    )
    args = p.parse_args(argv)
    out_dir = args.out_dir
    budget = cli_budget(args.max_minutes)
    report = run_paused_or_done(lambda: pretrain(out_dir, PretrainConfig(), budget, state_dir=args.state_dir))
    if report is None:
        raise SystemExit(PAUSED_EXIT)
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
