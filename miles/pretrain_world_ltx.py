"""Pretrain the tiny world through the LTX-Video family: a tiny LTX VAE, then a tiny LTX prior.

    python -m miles.pretrain_world_ltx miles/world/pipeline_ltx          # VAE + prior + report
    python -m miles.pretrain_world_ltx --vae-check docs/learning/ltx/vae_check.json

The Wan world's recipe (:mod:`miles.pretrain_world`, whose render, dataset, loss and flow-matching
functions this module imports) through LTX-Video's parts:

1. **VAE.** A tiny ``AutoencoderKLLTXVideo`` (4x4 patchify, 128 latent channels, widths
   (16, 32, 64, 64), one layer per block) with ONE of LTX-Video's three spatio-temporal
   downsamplings: 8x spatial, 2x temporal (2.3M parameters), so 9 frames at 64 x 64 are 5 latent
   frames of 8 x 8: 320 tokens (patch size 1). LTX-Video's published 32x / 8x (8 tokens,
   ``LTX_SCALING``, ``--scaling 1110``) and 16x / 4x (48 tokens, ``--scaling 1100``) decoded every
   world video to the same grey frame on the CPU budget tried (docs/learning.md, "The LTX world").
   It trains on whole training-split videos as a plain autoencoder (``autoencoder_loss``: the Wan
   world's weighted reconstruction loss, the ball's pixels weighing 11x, on the posterior mean;
   ``vae_crop_steps`` > 0 starts on crops around the ball). With the Wan world's ``vae_loss``
   (posterior noise, kl 1e-4) three short 32x runs collapsed (the decoder ignored the latent, the
   kl term moved the log-variance at AdamW's pace once the latent carried nothing). The encoded
   dataset's per-channel mean/std go into the VAE's ``latents_mean``/``latents_std`` buffers, which
   ``LTXPipeline`` (and :class:`miles.models.ltx.LTXModel`) un-normalise with.
2. **VAE check** (``--vae-check``): can a compression carry the world? Held-out renders
   through encode (posterior mode) and decode, scored by ``world_adherence`` beside the renders,
   as ``bench/world81_vae_check.py`` did for the Wan world's VAE.
3. **Prior.** A tiny ``LTXVideoTransformer3DModel`` (4 blocks, 4 heads x 16) learns rectified flow
   on the normalised latents of the training split, called as the trainer calls it
   (:class:`miles.models.ltx.LTXRouting`: packed tokens, the text's mask, LTX's RoPE scales), with
   σ drawn from the sampler's shift density at LTX's token-count shift (``miles.models.ltx.ltx_flow_schedule``).
   Text is the tiny T5 of :mod:`miles.models.tiny_ltx` at ``max_sequence_length`` 64; 10% empty
   captions for CFG. Stopped early (``dit_steps``) for RL headroom.
4. **Save and measure.** An ordinary diffusers ``LTXPipeline`` folder (VAE in fp16), reloaded
   through ``miles.models.ltx.load_ltx`` and sampled as the trainer's evaluation (ODE, 8 steps,
   guidance 4, fixed seeds): ``OUT_DIR/../pretrain_report_ltx.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.pretrain_world import (
    NEGATIVE_PROMPT,
    _crop_batch,
    log,
    noisy_captions,
    render_dataset,
    save_pipeline_atomically,
    shifted_sigmas,
)
from miles.world.pretrain_data import ball_centres
from miles.world.world import NUM_FRAMES, Shape, heldout_prompts, parse_prompt, render, train_prompts

WORLD_LTX_VAE = dict(
    latent_channels=128,
    block_out_channels=(16, 32, 64, 64),
    decoder_block_out_channels=(16, 32, 64, 64),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
)
"""LTX-Video's VAE (patch 4, 128 channels) at small widths; the spatio-temporal downsamplings are
``PretrainLTXConfig.vae_scaling``."""

LTX_SCALING = (True, True, True, False)
"""LTX-Video's published compression: spatio-temporal downsampling in three blocks, 32x / 8x."""


@dataclass(frozen=True)
class PretrainLTXConfig:
    """Every knob; the defaults build the committed ``miles/world/pipeline_ltx`` (``make
    world-model-ltx``). Its VAE is 8x / 2x, not LTX-Video's 32x / 8x: at 32x / 8x and at 16x / 4x the
    tiny VAE decoded every world video to grey (the VAE check, docs/learning.md "The LTX world")."""

    seed: int = 0
    num_threads: int = 1
    shape: tuple[int, int, int] = (NUM_FRAMES, 64, 64)
    """(frames, height, width) of the world's videos (``miles.world.Shape``)."""
    # VAE
    vae_scaling: tuple[bool, ...] = (True, False, False, False)
    """The VAE's ``spatio_temporal_scaling`` (and its decoder's): one of LTX-Video's three (8x / 2x:
    9 x 64 x 64 -> 5 x 8 x 8 = 320 tokens); ``LTX_SCALING`` is the published three (32x / 8x)."""
    vae_steps: int = 2300
    vae_crop_steps: int = 0
    """The first steps train on crops of one latent pixel (32 x 32) around the ball (the Wan world's
    ``_crop_batch``); whole frames after."""
    vae_batch: int = 8
    vae_lr: float = 1e-3
    vae_foreground_weight: float = 10.0
    """Extra weight of the ball's pixels (``vae_loss``): whole frames, so the ball is 2-6% of them."""
    vae_pool_per_prompt: int = 16
    vae_time_limit_s: float = 0.0
    """Stop the VAE early after this many seconds (0: never); the report says where it stopped."""
    # prior
    videos_per_prompt: int = 48
    dit_steps: int = 507
    """The committed prior stopped here (a 660 s cap on the 2 shared cores; held-out 0.41 at guidance 4)."""
    dit_batch: int = 64
    dit_lr: float = 1e-3
    dit_time_limit_s: float = 0.0
    """Stop the prior early after this many seconds (0: never); the report says where it stopped."""
    num_layers: int = 4
    text_dropout: float = 0.1
    max_sequence_length: int = 64
    # evaluation
    eval_seeds_heldout: int = 8
    eval_seeds_train: int = 4
    eval_steps: int = 8
    eval_guidance: float = 4.0
    eval_seed: int = 1234


def world_shape(cfg: PretrainLTXConfig) -> Shape:
    return Shape(*cfg.shape)


def render_videos(prompts: list[str], per_prompt: int, seed_offset: int, shape: Shape) -> torch.Tensor:
    """``render_dataset``'s videos (N, 3, F, H, W) in [-1, 1] at ``shape`` (the Wan world's function
    at its own 9 x 64 x 64)."""
    if shape == Shape():
        return render_dataset(prompts, per_prompt, seed_offset)[0]
    return torch.stack(
        [
            render(parse_prompt(p), seed_offset + k, shape).permute(1, 0, 2, 3) * 2 - 1
            for p in prompts
            for k in range(per_prompt)
        ]
    )


def autoencoder_loss(vae, x: torch.Tensor, foreground_weight: float) -> torch.Tensor:
    """``vae_loss``'s weighted ``mse + 0.5 l1`` of the posterior mean's reconstruction, without the
    posterior noise and the kl term: with them the LTX VAE collapsed (see ``PretrainLTXConfig``)."""
    rec = vae.decode(vae.encode(x).latent_dist.mean).sample
    weight = 1 + foreground_weight * (x.abs().amax(dim=1, keepdim=True) > 0.02).float()
    err = rec - x
    return (weight * (err**2 + 0.5 * err.abs())).mean() / weight.mean()


def train_vae(cfg: PretrainLTXConfig, start: float, save_to: Path | None = None) -> tuple[nn.Module, dict]:
    """The tiny ``AutoencoderKLLTXVideo`` on whole training-split videos; (vae, {steps, seconds, loss})."""
    from diffusers import AutoencoderKLLTXVideo

    prompts, shape = train_prompts(), world_shape(cfg)
    pool = render_videos(prompts, cfg.vae_pool_per_prompt, 10_000, shape)
    centres = ball_centres(prompts, cfg.vae_pool_per_prompt, 10_000, shape)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    scaling = dict(spatio_temporal_scaling=cfg.vae_scaling, decoder_spatio_temporal_scaling=cfg.vae_scaling)
    vae = AutoencoderKLLTXVideo(**WORLD_LTX_VAE, **scaling).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, running, step = time.perf_counter(), None, 0
    while step < cfg.vae_steps:
        if cfg.vae_time_limit_s and time.perf_counter() - t0 > cfg.vae_time_limit_s:
            log(f"vae: time limit {cfg.vae_time_limit_s:.0f} s reached at step {step}", start)
            break
        if step < cfg.vae_crop_steps:  # one latent pixel around the ball, as the Wan world's crops
            x = _crop_batch(
                pool, centres, cfg.vae_batch, shape.num_frames, vae.spatial_compression_ratio, rng
            )
        else:
            x = pool[torch.randint(len(pool), (cfg.vae_batch,), generator=gen)]
        loss = autoencoder_loss(vae, x, cfg.vae_foreground_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0:
            log(f"vae step {step}/{cfg.vae_steps} loss {running:.4f}", start)
        if save_to is not None and step % 250 == 0:
            vae.save_pretrained(save_to)
    vae = vae.eval().requires_grad_(False)
    if save_to is not None:
        vae.save_pretrained(save_to)
    return vae, {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "loss": round(running, 5)}


@torch.no_grad()
def reconstruct(vae, videos: torch.Tensor) -> torch.Tensor:
    """Frames (B, F, 3, H, W) in [0, 1] through encode (posterior mode) and decode, one at a time."""
    out = []
    for video in videos:
        z = vae.encode(video.permute(1, 0, 2, 3)[None] * 2 - 1).latent_dist.mode()
        out.append(((vae.decode(z).sample[0].permute(1, 0, 2, 3) + 1) / 2).clamp(0, 1))
    return torch.stack(out)


def vae_check(vae, shape: Shape, num_seeds: int = 4) -> dict:
    """``world_adherence`` of held-out renders (seeds 0..num_seeds-1) and of their reconstructions."""
    from miles.rewards.world import world_scores

    prompts = [p for p in heldout_prompts() for _ in range(num_seeds)]
    seeds = [k for _ in heldout_prompts() for k in range(num_seeds)]
    renders = torch.stack([render(parse_prompt(p), s, shape) for p, s in zip(prompts, seeds)])
    recon = reconstruct(vae, renders)
    z = vae.encode(renders[:1].permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
    out = {"shape": [shape.num_frames, shape.height, shape.width], "latent": list(z.shape[1:])}
    out["tokens"] = int(z.shape[2] * z.shape[3] * z.shape[4])
    for name, videos in (("renders", renders), ("reconstructions", recon)):
        scores = world_scores(videos, prompts)
        out[name] = {k: round(float(v.mean()), 4) for k, v in scores.items()}
    out["mse"] = round(float(((recon - renders) ** 2).mean()), 6)
    out["num_videos"] = len(prompts)
    return out


def set_latent_buffers(vae, latents: torch.Tensor) -> None:
    """Per-channel mean/std of latents (N, C, F, H, W) into the VAE's ``latents_mean``/``latents_std``."""
    with torch.no_grad():
        vae.latents_mean.copy_(latents.mean(dim=(0, 2, 3, 4)))
        vae.latents_std.copy_(latents.std(dim=(0, 2, 3, 4)))


def base_pipeline():
    """The embedded tiny LTXPipeline: its seeded tiny T5, tokenizer and scheduler are reused as is."""
    from miles.models.tiny_ltx import build_ltx_pipeline

    return build_ltx_pipeline()


def transformer_config(vae) -> dict:
    """The tiny LTX of ``miles.models.tiny_ltx`` at ``num_layers`` blocks on the VAE's channels."""
    from miles.models.tiny_ltx import TINY_LTX_TRANSFORMER

    z = vae.config.latent_channels
    return dict(TINY_LTX_TRANSFORMER, in_channels=z, out_channels=z)


@torch.no_grad()
def encode_text(pipe, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt conditions (P, L, D + 1), negative condition (1, L, D + 1)) as ``LTXModel.encode_prompts``
    packs them (T5 embeddings with the attention mask)."""
    from miles.models.ltx import pack_text

    pos, pos_mask, neg, neg_mask = pipe.encode_prompt(
        prompt=prompts,
        negative_prompt=[NEGATIVE_PROMPT] * len(prompts),
        do_classifier_free_guidance=True,
        max_sequence_length=max_sequence_length,
        device=torch.device("cpu"),
    )
    return pack_text(pos, pos_mask), pack_text(neg, neg_mask)[:1]


class RoutedExpert(nn.Module):
    """The LTX transformer behind the Wan-style call ``flow_matching_loss`` makes
    (``hidden_states`` (B, C, F, H, W), ``timestep``, ``encoder_hidden_states``): it goes through
    :class:`miles.models.ltx.LTXRouting`, the trainer's packing of latents, text and mask."""

    def __init__(self, transformer: nn.Module, vae) -> None:
        from miles.models.ltx import FRAME_RATE, LTXRouting

        super().__init__()
        self.transformer = transformer
        s, t = vae.spatial_compression_ratio, vae.temporal_compression_ratio
        self.routing = LTXRouting((t / FRAME_RATE, s, s))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        return (self.routing.forward(self.transformer, hidden_states, timestep, encoder_hidden_states),)


def flow_shift(num_tokens: int) -> float:
    """LTX's token-count shift exp(mu) under the tiny pipeline's scheduler (``ltx_flow_schedule``)."""
    from miles.models.ltx import ltx_flow_schedule
    from miles.models.tiny_ltx import LTX_SCHEDULER

    return ltx_flow_schedule(LTX_SCHEDULER, num_tokens).shift


def flow_loss(expert, x0: torch.Tensor, context: torch.Tensor, shift: float, generator) -> torch.Tensor:
    """``miles.pretrain_world.flow_matching_loss`` with sigma drawn at ``shift`` (LTX's token-count
    shift instead of the Wan world's 3): x_s = (1 - s) x0 + s eps, target eps - x0, t = 1000 s."""
    b = x0.shape[0]
    s = shifted_sigmas(torch.rand(b, generator=generator), shift)
    eps = torch.randn(x0.shape, generator=generator)
    sv = s.view(b, 1, 1, 1, 1)
    out = expert(hidden_states=(1 - sv) * x0 + sv * eps, timestep=1000 * s, encoder_hidden_states=context)
    return F.mse_loss(out[0].float(), eps - x0)


def train_prior(cfg: PretrainLTXConfig, vae, latents, labels, table, start: float) -> tuple[nn.Module, dict]:
    """The tiny LTX prior on normalised latents (N, C, F, H, W) captioned by ``labels`` (N,); ``table``
    holds the prompts' text conditions with the negative one last (row -1). Returns (prior, {steps,
    seconds, loss})."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(cfg.seed + 1)
    transformer = LTXVideoTransformer3DModel(**transformer_config(vae) | {"num_layers": cfg.num_layers})
    expert = RoutedExpert(transformer.train(), vae)
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.dit_lr)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    shift = flow_shift(int(latents[0, 0].numel()))
    running, t0, steps = None, time.perf_counter(), 0
    for step in range(cfg.dit_steps):
        if cfg.dit_time_limit_s and time.perf_counter() - t0 > cfg.dit_time_limit_s:
            log(f"prior: time limit {cfg.dit_time_limit_s:.0f} s reached at step {step}", start)
            break
        idx = torch.randint(len(latents), (cfg.dit_batch,), generator=gen)
        captions = noisy_captions(labels[idx], len(table) - 1, 0.0, cfg.text_dropout, gen)
        loss = flow_loss(expert, latents[idx], table[captions], shift, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        steps = step + 1
        if steps % 100 == 0 or steps == cfg.dit_steps:
            log(f"prior step {steps}/{cfg.dit_steps} loss {running:.4f}", start)
    trained = {"steps": steps, "seconds": round(time.perf_counter() - t0, 1), "loss": round(running, 5)}
    return transformer.eval().requires_grad_(False), trained


def evaluate(model, prompts: list[str], num_seeds: int, cfg: PretrainLTXConfig) -> dict:
    """``miles.pretrain_world.evaluate`` of ``model`` (an ``LTXModel``) with the family's routing and
    its token-count shift (which the report keeps)."""
    from miles import pretrain_world

    schedule = model.flow_schedule(None, model.num_tokens(*cfg.shape))
    out = pretrain_world.evaluate(model, prompts, num_seeds, cfg, shift=schedule, routing=model.routing)
    out["shift"] = round(schedule.shift, 4)
    return out


def pretrain(out_dir: Path, cfg: PretrainLTXConfig, vae_folder: Path | None = None) -> dict:
    """Train (or load the VAE from ``vae_folder``), save ``out_dir`` atomically, reload through
    ``load_ltx`` and evaluate; returns the report."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    from miles.config import ModelConfig
    from miles.models.ltx import load_ltx
    from miles.pretrain_world import encode_videos

    torch.set_num_threads(cfg.num_threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    report: dict = {}
    if vae_folder is None:
        vae, report["vae_training"] = train_vae(cfg, start)
    else:
        vae = AutoencoderKLLTXVideo.from_pretrained(vae_folder, torch_dtype=torch.float32).eval()
        report["vae_from"] = str(vae_folder)
    report["vae_check"] = vae_check(vae, world_shape(cfg))
    log(f"vae check {report['vae_check']['reconstructions']}", start)
    prompts = train_prompts()
    raw = encode_videos(vae, render_videos(prompts, cfg.videos_per_prompt, 0, world_shape(cfg)))
    labels = torch.arange(len(prompts)).repeat_interleave(cfg.videos_per_prompt)
    set_latent_buffers(vae, raw)
    latents = (raw - vae.latents_mean.view(1, -1, 1, 1, 1)) / vae.latents_std.view(1, -1, 1, 1, 1)
    log(f"encoded {len(latents)} training videos to latents {tuple(latents.shape[1:])}", start)
    text_pipe = base_pipeline()
    pos, neg = encode_text(text_pipe, prompts, cfg.max_sequence_length)
    transformer, report["prior_training"] = train_prior(
        cfg, vae, latents, labels, torch.cat([pos, neg]), start
    )
    pipe = LTXPipeline(
        scheduler=text_pipe.scheduler,
        vae=vae,
        text_encoder=text_pipe.text_encoder,
        tokenizer=text_pipe.tokenizer,
        transformer=transformer,
    )
    save_pipeline_atomically(pipe, out_dir)
    log(f"saved {out_dir}", start)
    model = load_ltx(ModelConfig(path=str(out_dir)), torch.device("cpu"))
    report["train"] = evaluate(model, prompts, cfg.eval_seeds_train, cfg)
    report["heldout"] = evaluate(model, heldout_prompts(), cfg.eval_seeds_heldout, cfg)
    report["times"] = {
        "total_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(time.process_time() - cpu_start, 1),
    }
    report.update(config=dataclasses.asdict(cfg), torch=torch.__version__)
    return report


def run_vae_check(
    out: Path, cfg: PretrainLTXConfig, save_vae: Path | None, vae_folder: Path | None = None
) -> dict:
    """Train the VAE at ``cfg.shape`` (within ``cfg.vae_time_limit_s``), or load ``vae_folder``, check
    it, add the result to ``out``."""
    from diffusers import AutoencoderKLLTXVideo

    torch.set_num_threads(cfg.num_threads)
    start = time.perf_counter()
    if vae_folder is None:
        vae, trained = train_vae(cfg, start, save_to=save_vae)
    else:
        vae, trained = AutoencoderKLLTXVideo.from_pretrained(vae_folder).eval(), {"from": str(vae_folder)}
    result = vae_check(vae, world_shape(cfg))
    result.update(
        training=trained,
        vae=WORLD_LTX_VAE
        | {
            "spatio_temporal_scaling": cfg.vae_scaling,
            "parameters": sum(p.numel() for p in vae.parameters()),
        },
        compression=[vae.temporal_compression_ratio, vae.spatial_compression_ratio],
        loss="autoencoder_loss",
        foreground_weight=cfg.vae_foreground_weight,
        crop_steps=cfg.vae_crop_steps,
    )
    key = (result["shape"], result["compression"], result["crop_steps"])
    results = json.loads(out.read_text())["results"] if out.is_file() else []
    results = [r for r in results if (r["shape"], r.get("compression"), r.get("crop_steps")) != key]
    results.append(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    return result


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", type=Path, help="the LTXPipeline folder to write")
    p.add_argument("--vae-check", type=Path, metavar="JSON", help="train a VAE and check it instead")
    p.add_argument("--shape", default="9x64x64", help="FRAMESxHEIGHTxWIDTH")
    p.add_argument("--vae-steps", type=int, default=PretrainLTXConfig.vae_steps)
    p.add_argument(
        "--scaling",
        default="".join("1" if s else "0" for s in PretrainLTXConfig.vae_scaling),
        help="the VAE's spatio-temporal scaling per block, 1/0 (LTX-Video's: 1110)",
    )
    p.add_argument("--crop-steps", type=int, default=PretrainLTXConfig.vae_crop_steps)
    p.add_argument("--fg-weight", type=float, default=PretrainLTXConfig.vae_foreground_weight)
    p.add_argument("--time-limit", type=float, default=0.0, help="VAE wall-time cap in seconds")
    p.add_argument("--save-vae", type=Path, help="(--vae-check) also save the VAE folder here")
    p.add_argument(
        "--vae", type=Path, help="a trained VAE folder to use (check it, or train the prior on it)"
    )
    p.add_argument("--dit-steps", type=int, default=PretrainLTXConfig.dit_steps)
    p.add_argument("--dit-time-limit", type=float, default=0.0, help="prior wall-time cap in seconds")
    p.add_argument("--threads", type=int, default=PretrainLTXConfig.num_threads)
    args = p.parse_args(argv)
    cfg = PretrainLTXConfig(
        shape=tuple(int(v) for v in args.shape.split("x")),
        vae_steps=args.vae_steps,
        vae_time_limit_s=args.time_limit,
        vae_foreground_weight=args.fg_weight,
        vae_crop_steps=args.crop_steps,
        vae_scaling=tuple(c == "1" for c in args.scaling),
        num_threads=args.threads,
    )
    if args.vae_check is not None:
        print(json.dumps(run_vae_check(args.vae_check, cfg, args.save_vae, args.vae), indent=1))
        return
    if args.out_dir is None:
        raise SystemExit("usage: python -m miles.pretrain_world_ltx OUT_DIR  (e.g. miles/world/pipeline_ltx)")
    cfg = dataclasses.replace(cfg, dit_steps=args.dit_steps, dit_time_limit_s=args.dit_time_limit)
    report = pretrain(args.out_dir, cfg, args.vae)
    path = args.out_dir.parent / "pretrain_report_ltx.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for split in ("train", "heldout"):
        r = report[split]
        print(
            f"{split:8s} adherence {r['adherence']:.3f} (colour {r['colour']:.3f}, motion {r['motion']:.3f}, "
            f"size {r['size']:.3f}, quality {r['quality']:.3f}; {r['num_samples']} samples)"
        )
    print(f"report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
