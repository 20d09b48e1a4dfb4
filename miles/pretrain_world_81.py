"""Pretrain the world's prior at Wan2.1's shape: 81 frames at 480 x 832, 32,760 tokens a sample.

    python -m miles.pretrain_world_81 miles/world/pipeline_81            # make world-model-81 (one GPU)
    python -m miles.pretrain_world_81 --estimate                         # the FLOPs, nothing run

The same world as ``miles.pretrain_world`` (prompts, held-out split, renders, ``world_adherence``)
at ``miles.world.SHAPE_81``, through the same functions where they exist (the render, the VAE
loss, the latent statistics, the text encoding, the time shift, the caption dropout, the folder's
assembly and atomic save; the flow-matching loss is the same but draws its noise on the GPU), on a
GPU in bf16 with compiled blocks:

1. **VAE.** The world VAE's architecture (``WORLD_VAE``: 4x temporal / 8x spatial, Wan's
   compression) with Wan's 16 latent channels (the committed 9-frame VAE has 8), trained on random
   crops around the ball (``crop`` px, the ball's size scaled with the frame) of clips rendered on
   the fly; 81 x 480 x 832 encodes to 16 x 21 x 60 x 104, as Wan2.1's VAE does. ``vae_path``
   instead reuses a trained VAE folder (e.g. ``miles/world/pipeline/vae``: 8 channels).
2. **Prior.** A Wan-architecture transformer with Wan's head size (``PRIOR``: one 128-wide head, 2
   blocks, ffn 512, Wan's 256-wide frequency embedding; 2.9 MB of fp32 weights,
   ``prior_megabytes``), on the tiny UMT5's 32-wide text, trained by rectified flow on the
   normalised latents of ``videos_per_prompt`` renders per training prompt
   (``flow_matching_loss``, shift-3 time density, 10% captions dropped for CFG).
3. **Report.** ``OUT_DIR/../pretrain_report_81.json``: held-out and train adherence of the saved
   folder, sampled by the trainer's own evaluation (``miles.eval.evaluate``: ODE, ``eval_steps``,
   ``eval_guidance``, the noise of ``eval.seed`` 0), the times, the config and the FLOPs estimate.

Cost (``estimate``): at 32,760 tokens attention dominates (97% of a forward): 4 L^2 d FLOPs a block
forward (QK^T and PV) against ~2 L (8 d^2 + 2 d ffn) in the linears; a training step is taken as 3
forwards. The defaults (4,000 steps of batch 8) come to 1.1e17 FLOPs: 5.2 min at an assumed 350
TFLOP/s of bf16 attention on one H200, leaving the rest of the 15 min target to the VAE, the
encoding and the evaluation — an estimate (``--estimate`` prints it), not a measurement.
A CPU test runs every stage at a reduced ``Shape`` (``tests/unit/test_world_81.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from miles.pretrain_world import (
    WORLD_VAE,
    assemble_pipeline,
    base_pipeline,
    encode_text,
    log,
    noisy_captions,
    save_pipeline_atomically,
    set_latent_stats,
    vae_loss,
)
from miles.world.world import (
    SHAPE_81,
    Shape,
    heldout_prompts,
    parse_prompt,
    render,
    train_prompts,
    trajectory,
)

PRIOR = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=1,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=32,  # the tiny UMT5's d_model (miles.models.tiny.TINY_TEXT_ENCODER)
    freq_dim=256,
    ffn_dim=512,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
"""The 81-frame prior: Wan2.1's block with Wan's head size, one 128-wide head, 2 blocks (sized by the
GPU budget: ``estimate`` and docs/learning.md, "The 81-frame world")."""
VAE_16 = dict(WORLD_VAE, z_dim=16)
"""The world VAE's architecture with Wan's 16 latent channels."""


@dataclass(frozen=True)
class Pretrain81Config:
    """Every knob of the 81-frame pretraining (defaults: ``make world-model-81`` on one H200)."""

    seed: int = 0
    shape: tuple[int, int, int] = (SHAPE_81.num_frames, SHAPE_81.height, SHAPE_81.width)
    device: str = "cuda"
    dtype: str = "bfloat16"
    """Autocast dtype of the VAE and prior training on CUDA (fp32 master weights); CPU: float32."""
    compile: bool = True
    """``torch.compile`` each transformer block (CUDA only)."""
    prior: dict = field(default_factory=lambda: dict(PRIOR))
    vae_path: str | None = None
    """A trained ``AutoencoderKLWan`` folder to reuse instead of training one (its z_dim must be the
    prior's in_channels)."""
    vae_short_steps: int = 600
    """AdamW steps on 9-frame crops."""
    vae_long_steps: int = 200
    """AdamW steps on 17-frame crops."""
    vae_batch: int = 8
    vae_lr: float = 1e-3
    vae_foreground_weight: float = 4.0
    crop: int = 192
    """Crop side (px): the big ball's diameter at 480 x 832 is ~135 px."""
    videos_per_prompt: int = 16
    """Renders per training prompt encoded for the prior (24 x 16 x 8.4 MB of fp32 latents on the GPU)."""
    dit_steps: int = 4000
    dit_batch: int = 8
    dit_lr: float = 1e-3
    text_dropout: float = 0.1
    max_sequence_length: int = 64
    eval_seeds_heldout: int = 16
    eval_seeds_train: int = 4
    """Seeds per training prompt (0: the held-out prompts only)."""
    eval_steps: int = 10
    eval_guidance: float = 4.0
    eval_micro_batch: int = 8
    tflops_assumed: float = 350.0
    """Sustained bf16 TFLOP/s assumed for the time estimate (not measured)."""

    @property
    def world_shape(self) -> Shape:
        return Shape(*self.shape)


def prior_megabytes(prior: dict = PRIOR) -> float:
    """fp32 weight size (MB, 1e6 bytes) of a ``WanTransformer3DModel`` of ``prior`` (built on meta)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**prior)
    return sum(p.numel() for p in model.parameters()) * 4 / 1e6


def estimate(cfg: Pretrain81Config) -> dict:
    """FLOPs of the prior's pretraining and of one sample's forward at ``cfg.shape`` (module docstring)."""
    f, h, w = cfg.shape
    p = cfg.prior
    tokens = ((f - 1) // 4 + 1) * (h // 16) * (w // 16)  # VAE 4x/8x, then the 1x2x2 patch
    d = p["num_attention_heads"] * p["attention_head_dim"]
    text = cfg.max_sequence_length
    per_block = (
        4 * tokens * tokens * d + 2 * tokens * (8 * d * d + 2 * d * p["ffn_dim"]) + 4 * tokens * text * d
    )
    forward = p["num_layers"] * per_block
    train = 3 * forward * cfg.dit_batch * cfg.dit_steps
    return {
        "tokens_per_sample": tokens,
        "forward_flops_per_sample": forward,
        "attention_share": round(4 * tokens * tokens * d / per_block, 3),
        "prior_train_flops": train,
        "prior_train_minutes_at_assumed_tflops": round(train / (cfg.tflops_assumed * 1e12) / 60, 2),
        "tflops_assumed": cfg.tflops_assumed,
        "prior_weights_mb": round(prior_megabytes(p), 2),
    }


def _autocast(cfg: Pretrain81Config, device: torch.device):
    if device.type != "cuda":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cuda", dtype=getattr(torch, cfg.dtype))


def _crops(cfg: Pretrain81Config, frames: int, rng: np.random.Generator, device) -> torch.Tensor:
    """``vae_batch`` clips (B, 3, frames, crop, crop) in [-1, 1] around the ball: a training prompt, a
    render seed (10,000 + k, as the 9-frame VAE's pool), a start frame, a crop centred on the ball
    at a random frame of the clip with a quarter-crop jitter. Rendered on ``device`` as needed."""
    shape, prompts, crop = cfg.world_shape, train_prompts(), min(cfg.crop, *cfg.shape[1:])
    clips = []
    for _ in range(cfg.vae_batch):
        attrs, seed = parse_prompt(prompts[int(rng.integers(len(prompts)))]), 10_000 + int(rng.integers(16))
        t0 = int(rng.integers(shape.num_frames - frames + 1))
        cx, cy = trajectory(attrs, seed, shape)[0][t0 + int(rng.integers(frames))]
        jx, jy = rng.uniform(-crop / 4, crop / 4, size=2)
        x0 = int(np.clip(round(cx + jx - crop / 2), 0, shape.width - crop))
        y0 = int(np.clip(round(cy + jy - crop / 2), 0, shape.height - crop))
        video = render(attrs, seed, shape, device=device)[t0 : t0 + frames, :, y0 : y0 + crop, x0 : x0 + crop]
        clips.append(video.permute(1, 0, 2, 3) * 2 - 1)
    return torch.stack(clips)


def train_vae(cfg: Pretrain81Config, start: float, device: torch.device):
    """``VAE_16`` trained on crops (9-frame clips, then 17-frame ones) by ``vae_loss``."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(cfg.seed)
    vae = AutoencoderKLWan(**VAE_16).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr)
    rng, gen = np.random.default_rng(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    total = cfg.vae_short_steps + cfg.vae_long_steps
    for step in range(total):
        frames = min(9 if step < cfg.vae_short_steps else 17, cfg.shape[0])
        x = _crops(cfg, frames, rng, device)
        with _autocast(cfg, device):
            loss = vae_loss(vae, x, gen, cfg.vae_foreground_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == total:
            log(f"vae step {step + 1}/{total} ({frames} frames) loss {loss.item():.4f}", start)
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_training_set(cfg: Pretrain81Config, vae, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior means (N, z, F', H', W') of the training renders (seeds 0..videos_per_prompt-1, as the
    9-frame prior's), rendered and encoded one at a time on ``device`` (the videos are never all held),
    and their prompt index (N,)."""
    latents, labels = [], []
    for i, prompt in enumerate(train_prompts()):
        for k in range(cfg.videos_per_prompt):
            video = render(parse_prompt(prompt), k, cfg.world_shape, device=device)
            x = (video.permute(1, 0, 2, 3)[None] * 2 - 1).to(vae.dtype)
            latents.append(vae.encode(x).latent_dist.mode().float())
            labels.append(i)
    return torch.cat(latents), torch.tensor(labels)


def flow_matching_loss(transformer, x0, context, generator: torch.Generator, noise: torch.Generator):
    """``miles.pretrain_world.flow_matching_loss`` with the noise drawn on the latents' device from
    ``noise`` (a batch of 81-frame latents is 17M values: drawn on a CPU, seconds a step); the
    noise levels still come from the CPU ``generator``."""
    from miles.pretrain_world import shifted_sigmas

    b = x0.shape[0]
    s = shifted_sigmas(torch.rand(b, generator=generator)).to(x0.device)
    eps = torch.randn(x0.shape, generator=noise, device=x0.device)
    sv = s.view(b, 1, 1, 1, 1)
    xt = (1 - sv) * x0 + sv * eps
    out = transformer(hidden_states=xt, timestep=1000 * s, encoder_hidden_states=context, return_dict=False)
    return torch.nn.functional.mse_loss(out[0].float(), eps - x0)


def train_prior(cfg: Pretrain81Config, latents, labels, prompt_embeds, negative_embeds, start: float):
    """The prior (``cfg.prior``) by rectified flow on normalised latents on their device (bf16
    autocast and compiled blocks on CUDA)."""
    from diffusers import WanTransformer3DModel

    device = latents.device
    torch.manual_seed(cfg.seed + 1)
    transformer = WanTransformer3DModel(**cfg.prior).to(device).train()
    if cfg.compile and device.type == "cuda":
        for block in transformer.blocks:
            block.compile()
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.dit_lr)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    noise = torch.Generator(device=device).manual_seed(cfg.seed + 3)
    table = torch.cat([prompt_embeds, negative_embeds]).to(device)  # row -1: the negative prompt
    for step in range(cfg.dit_steps):
        idx = torch.randint(len(latents), (cfg.dit_batch,), generator=gen)
        captions = noisy_captions(labels[idx], len(prompt_embeds), 0.0, cfg.text_dropout, gen)
        with _autocast(cfg, device):
            loss = flow_matching_loss(
                transformer, latents[idx.to(device)], table[captions.to(device)], gen, noise
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == cfg.dit_steps:
            log(f"prior step {step + 1}/{cfg.dit_steps} loss {loss.item():.4f}", start)
    return transformer.eval().requires_grad_(False)


@torch.no_grad()
def evaluate_folder(cfg: Pretrain81Config, folder: Path, device: torch.device) -> dict:
    """Held-out and train ``world_adherence`` of the saved folder through ``miles.eval.evaluate``."""
    from miles.config import ModelConfig
    from miles.eval.evaluate import EvalSettings, evaluate
    from miles.models.wan import load_wan
    from miles.rewards import build_rewards

    model = load_wan(ModelConfig(path=str(folder)), device)
    rewards = build_rewards({"world_adherence": 1.0})
    settings = EvalSettings(
        latent_shape=model.latent_shape(*cfg.shape),
        num_steps=cfg.eval_steps,
        shift=3.0,
        guidance_scales=[cfg.eval_guidance],
        routing=model.routing,
        micro_batch_size=cfg.eval_micro_batch,
        seed=0,  # eval.seed's default: the recipe's in-loop evaluation draws this noise
    )
    out = {}
    for split, prompts, seeds in (
        ("heldout", heldout_prompts(), cfg.eval_seeds_heldout),
        ("train", train_prompts(), cfg.eval_seeds_train),
    ):
        if seeds == 0:
            continue
        with _autocast(cfg, device):
            result = evaluate(
                model, rewards, prompts, seeds, settings, negative_prompt="", keep_videos=False,
                max_sequence_length=cfg.max_sequence_length, device=device,
            )  # fmt: skip
        scores = result["scores"][0]
        out[split] = {
            "adherence": round(float(scores.mean()), 4),
            "se": round(float(scores.std() / len(scores) ** 0.5), 4) if len(scores) > 1 else None,
            "num_samples": len(scores),
        }
    return out


def pretrain(out_dir: Path, cfg: Pretrain81Config = Pretrain81Config()) -> dict:
    """VAE (or ``vae_path``), encode, prior, save ``out_dir`` atomically, evaluate; returns the report."""
    from diffusers import AutoencoderKLWan

    device = torch.device(cfg.device if cfg.device != "cuda" or torch.cuda.is_available() else "cpu")
    if device.type != cfg.device:
        raise SystemExit(f"device {cfg.device!r} is not available here (make world-model-81 needs a GPU)")
    start, times = time.perf_counter(), {}
    if cfg.vae_path:
        vae = AutoencoderKLWan.from_pretrained(cfg.vae_path, torch_dtype=torch.float32).to(device).eval()
    else:
        vae = train_vae(cfg, start, device)
    if vae.config.z_dim != cfg.prior["in_channels"]:
        raise SystemExit(
            f"the VAE has {vae.config.z_dim} latent channels, the prior reads {cfg.prior['in_channels']}"
        )
    times["vae_s"] = time.perf_counter() - start
    raw, labels = encode_training_set(cfg, vae, device)
    mean, std = set_latent_stats(vae, raw)
    latents = (raw - mean.to(device).view(1, -1, 1, 1, 1)) / std.to(device).view(1, -1, 1, 1, 1)
    latent_shape = list(latents.shape[1:])  # 16 x 21 x 60 x 104 at SHAPE_81
    log(f"encoded {len(latents)} training videos to latents {tuple(latent_shape)}", start)
    text_pipe = base_pipeline()
    prompt_embeds, negative_embeds = encode_text(text_pipe, train_prompts(), cfg.max_sequence_length)
    t0 = time.perf_counter()
    transformer = train_prior(cfg, latents, labels, prompt_embeds, negative_embeds, start)
    times["prior_s"] = time.perf_counter() - t0
    del latents, raw
    transformer = getattr(transformer, "_orig_mod", transformer).float().cpu()
    save_pipeline_atomically(assemble_pipeline(text_pipe, vae.float().cpu(), transformer), out_dir)
    log(f"saved {out_dir}", start)
    t0 = time.perf_counter()
    report = evaluate_folder(cfg, Path(out_dir), device)
    times["eval_s"] = time.perf_counter() - t0
    times["total_s"] = time.perf_counter() - start
    report.update(
        times={k: round(v, 1) for k, v in times.items()},
        config=dataclasses.asdict(cfg),
        estimate=estimate(cfg),
        latent_shape=latent_shape,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )
    return report


def write_configs(out_dir: Path) -> Path:
    """The folder's configs without weights (what is committed as ``miles/world/pipeline_81`` so
    that the recipe's dry run plans it): the 9-frame folder's index, scheduler, tokenizer and tiny
    UMT5 (weights included, 0.1 MB), and the configs of ``PRIOR`` and ``VAE_16`` (latent statistics
    0 / 1 until ``make world-model-81`` writes the measured ones)."""
    import shutil

    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from miles.world import PIPELINE_DIR

    out_dir = Path(out_dir)
    for sub in ("scheduler", "text_encoder", "tokenizer"):
        shutil.copytree(PIPELINE_DIR / sub, out_dir / sub, dirs_exist_ok=True)
    shutil.copy(PIPELINE_DIR / "model_index.json", out_dir / "model_index.json")
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**PRIOR)
        vae = AutoencoderKLWan(**VAE_16, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    transformer.save_config(out_dir / "transformer")
    vae.save_config(out_dir / "vae")
    return out_dir


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m miles.pretrain_world_81", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "out_dir", nargs="?", type=Path, help="the pipeline folder to write (its report beside it)"
    )
    p.add_argument("--estimate", action="store_true", help="print the FLOPs estimate; nothing runs")
    p.add_argument("--configs", action="store_true", help="write only the configs into OUT_DIR")
    p.add_argument("--dit-steps", type=int, default=None, help="prior steps (default: Pretrain81Config's)")
    p.add_argument("--vae-path", default=None, help="reuse a trained AutoencoderKLWan folder")
    args = p.parse_args(argv)
    overrides = {
        k: v for k, v in (("dit_steps", args.dit_steps), ("vae_path", args.vae_path)) if v is not None
    }
    cfg = dataclasses.replace(Pretrain81Config(), **overrides)
    if args.estimate:
        print(json.dumps(estimate(cfg), indent=1))
        return
    if args.out_dir is None:
        p.error("give OUT_DIR (e.g. miles/world/pipeline_81)")
    if args.configs:
        print(write_configs(args.out_dir))
        return
    report = pretrain(args.out_dir, cfg)
    path = args.out_dir.parent / "pretrain_report_81.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for split in ("train", "heldout"):
        if split in report:
            r = report[split]
            print(f"{split:8s} adherence {r['adherence']:.3f} (SE {r['se']}; {r['num_samples']} samples)")
    print(f"wall time {report['times']['total_s'] / 60:.1f} min; report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
