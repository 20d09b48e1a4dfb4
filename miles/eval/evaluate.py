"""Held-out evaluation: deterministic samples of a prompt set, scored by every configured reward.

Each (prompt, seed) pair is one sample; its initial noise is a function of ``eval.seed`` (not the
run seed: runs of any ``run.seed`` are scored on the same noise), the prompt's index and the seed
only, and sampling is deterministic (ODE, no SDE noise), so an evaluation is a function of the
weights. The samples are cut into micro-batches of ``micro_batch_size`` in a
fixed order and the micro-batches are dealt to dp ranks round-robin (sp peers take the same ones),
so every layout evaluates the same micro-batches — dp4 and dp2 × sp2 give the same scores.

Two samplers:

- ``rollout``: the rollout's own schedule (``rollout.num_steps``, the family's ``rollout_schedule``: ``rollout.shift`` for Wan)
  with Euler (ODE) steps and the rollout's CFG — what training optimises, without its noise.
- ``pipeline``: the checkpoint's own scheduler, stepped as its diffusers pipeline steps it (real
  Wan folders ship UniPC with a flow shift) — what users see at inference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miles.console import progress_bar
from miles.models.family import rollout_schedule
from miles.rollout.condition import conditions_of
from miles.rollout.guidance import guidance_scales
from miles.rollout.sampler import begin_sampling, expert_phases, predict_velocity, sample_with_logprob
from miles.rollout.schedule import FlowSchedule

_EVAL_STREAM = 4
"""Tag of the evaluation noise stream (the trainer's rollout streams are 1-3)."""


@dataclass(frozen=True)
class EvalSettings:
    """How to sample an evaluation (the rollout's settings, without SDE noise)."""

    latent_shape: tuple[int, int, int, int]
    num_steps: int
    shift: float | FlowSchedule
    """The family's noise schedule (``rollout_schedule``), or a Wan shift."""
    guidance_scales: list[float]
    routing: object  # the model family's ExpertRouting (model.routing)
    micro_batch_size: int
    seed: int
    """``eval.seed``: keys the held-out noise (``eval_noise``), the same for every run seed."""
    sampler: str = "rollout"
    video_size: tuple[int, int, int] | None = None
    """(num_frames, height, width) in pixels: the size image conditions are encoded at (I2V)."""


def eval_settings(cfg, model) -> EvalSettings:
    """The evaluation settings of a run config (``miles.config.Config``) for a loaded model
    (``miles.models.family.FamilyModel``)."""
    r = cfg.rollout
    return EvalSettings(
        latent_shape=model.latent_shape(r.num_frames, r.height, r.width),
        num_steps=cfg.eval.num_steps or r.num_steps,
        shift=rollout_schedule(model, r),
        guidance_scales=guidance_scales(r, len(model.transformers)),
        routing=model.routing,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=cfg.eval.seed,
        sampler=cfg.eval.sampler,
        video_size=(r.num_frames, r.height, r.width),
    )


def eval_noise(shape: Sequence[int], seed: int, prompt_index: int, sample_seed: int) -> torch.Tensor:
    """The fixed fp32 initial noise of one evaluation sample."""
    # Integers only: their hash is the same in every process (a str's is salted per process).
    g = torch.Generator().manual_seed(
        hash((_EVAL_STREAM, seed, prompt_index, sample_seed)) & 0x7FFF_FFFF_FFFF_FFFF
    )
    return torch.randn(tuple(shape), generator=g)


@torch.no_grad()
def sample_with_scheduler(
    transformers: Sequence[nn.Module],
    scheduler,
    pos: torch.Tensor,
    neg: torch.Tensor | None,
    latents: torch.Tensor,
    settings: EvalSettings,
    condition=None,
) -> torch.Tensor:
    """Denoise ``latents`` as the diffusers pipeline does: the scheduler's own timesteps and steps,
    the experts switched by the family's routing, CFG per expert. Returns the clean latents (fp32).

    ``condition`` (``miles.rollout.condition.ImageCondition``): as ``WanImageToVideoPipeline``
    does; a first-frame condition's frame is put back after every step (the pipeline puts it back
    at the end: the same result, as no step mixes positions)."""
    import copy

    scheduler = copy.deepcopy(scheduler)  # its step index and solver history are per call
    scheduler.set_timesteps(settings.num_steps, device=latents.device)
    x = latents.float()
    for t in scheduler.timesteps:
        v = predict_velocity(
            transformers,
            x,
            t.float(),
            pos,
            neg,
            settings.guidance_scales,
            settings.routing,
            condition,
        )
        x = scheduler.step(v, t, x, return_dict=False)[0].float()
        x = x if condition is None else condition.clean(x)
    return x


def _sample(model, pos, neg, latents, settings: EvalSettings, condition=None) -> torch.Tensor:
    if settings.sampler == "pipeline":
        return sample_with_scheduler(
            model.transformers, model.pipeline.scheduler, pos, neg, latents, settings, condition
        )
    return sample_with_logprob(
        model.transformers,
        pos,
        neg,
        settings.latent_shape,
        latents=latents,
        condition=condition,
        **_ode(settings),
    ).final_latents


def _ode(settings: EvalSettings) -> dict:
    """The sampler's arguments for evaluation: the deterministic ODE, no SDE step recorded."""
    return dict(
        num_steps=settings.num_steps,
        shift=settings.shift,
        guidance_scales=settings.guidance_scales,
        routing=settings.routing,
        noise_level=0.0,
        generator=None,
        sde_steps=[],
    )


def evaluate(
    model,
    rewards,
    prompts: Sequence[str],
    num_seeds: int,
    settings: EvalSettings,
    *,
    negative_prompt: str,
    max_sequence_length: int,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    keep_videos: bool = True,
    images: Sequence | None = None,
    encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]] | None = None,
    gather: Callable[[list[nn.Module]], contextlib.AbstractContextManager] | None = None,
    progress: bool = False,
) -> dict:
    """Sample and score ``prompts`` x ``num_seeds`` (collective over the dp group when dp_size > 1).

    Returns ``scores`` (1 + len(rewards.names), N) on every rank — row 0 the weighted combination,
    then each reward — with ``prompts`` and ``seeds`` (N,) in sample order, and ``videos``: the
    decoded (F, 3, H, W) videos of the micro-batches this rank sampled, keyed by sample index.
    ``images``: image-to-video, one image file per prompt (the first frame every seed animates).
    ``encode(texts)``: (prompt, negative) embeddings (default: ``model.encode_prompts``; the trainer
    passes its prompt cache). ``gather(experts)``: a context holding those experts' full weights
    (the trainer's ``unsharded_for_rollout``): the ``rollout`` sampler gathers one expert at a time
    over all of this rank's micro-batches, the ``pipeline`` sampler both at once. ``progress``:
    bars for the sampling and the scoring (:func:`miles.console.show_progress`: rank 0 on a terminal).
    """
    if settings.sampler not in ("rollout", "pipeline"):
        raise ValueError(f"eval.sampler must be rollout or pipeline, got {settings.sampler!r}")
    samples = [(i, s) for i in range(len(prompts)) for s in range(num_seeds)]
    mb = settings.micro_batch_size
    chunks = [list(range(k, min(k + mb, len(samples)))) for k in range(0, len(samples), mb)]
    mine = [idx for c, idx in enumerate(chunks) if c % dp_size == dp_rank]
    if encode is None:

        def encode(texts):
            return model.encode_prompts(texts, negative_prompt, max_sequence_length, device)

    inputs = []
    for idx in mine:
        texts = [prompts[samples[j][0]] for j in idx]
        pos, neg = encode(texts)
        noise = torch.stack([eval_noise(settings.latent_shape, settings.seed, *samples[j]) for j in idx])
        condition = chunk_images = None
        if images is not None:
            frames, height, width = settings.video_size
            size = dict(num_frames=frames, height=height, width=width, device=device)
            chunk_images = [images[samples[j][0]] for j in idx]
            condition = conditions_of(model, chunk_images, **size)
        inputs.append((texts, chunk_images, pos, neg, noise.to(device), condition))
    no_gather = lambda experts: contextlib.nullcontext()  # noqa: E731
    finals = _sample_all(model, inputs, settings, gather or no_gather, progress)
    scores = torch.zeros(1 + len(rewards.names), len(samples), dtype=torch.float64)
    videos: dict[int, torch.Tensor] = {}
    scoring = progress_bar(list(zip(mine, inputs, finals)), "eval: decode and score", progress)
    for idx, (texts, chunk_images, *_), final in scoring:
        video = model.decode(final)
        scored = (video, texts) if chunk_images is None else (video, texts, chunk_images)
        combined, per_reward = rewards(*scored)
        rows = torch.stack([combined, *(per_reward[n] for n in rewards.names)]).double().cpu()
        scores[:, idx] = rows
        if keep_videos:
            videos.update({j: v.cpu() for j, v in zip(idx, video)})
    if dp_size > 1:
        # Each sample was scored by exactly one dp rank (others hold 0): the sum is exact.
        flat = scores.to(device)
        dist.all_reduce(flat, group=dp_group)
        scores = flat.cpu()
    return {
        "scores": scores,
        "names": ["reward", *rewards.names],
        "prompts": [prompts[i] for i, _ in samples],
        "seeds": [s for _, s in samples],
        "videos": videos,
    }


@torch.no_grad()
def _sample_all(
    model, inputs: list[tuple], settings: EvalSettings, gather, progress: bool = False
) -> list[torch.Tensor]:
    """The clean latents of every micro-batch's (…, pos, neg, noise, condition): the ``rollout``
    sampler one expert at a time over all micro-batches (bitwise each sampled alone), the
    ``pipeline`` sampler (per-call scheduler state) micro-batch by micro-batch with both gathered."""
    if settings.sampler == "pipeline":
        with gather(list(model.transformers)):
            bar = progress_bar(inputs, "eval: sample", progress)
            return [_sample(model, pos, neg, noise, settings, cond) for *_, pos, neg, noise, cond in bar]
    runs = [
        begin_sampling(
            pos,
            neg,
            settings.latent_shape,
            latents=noise,
            condition=cond,
            device=noise.device,
            **_ode(settings),
        )
        for *_, pos, neg, noise, cond in inputs
    ]
    experts = model.transformers
    phases = expert_phases(settings.num_steps, settings.shift, settings.routing, len(experts))
    with progress_bar(desc="eval: sample", show=progress, total=len(phases) * len(runs)) as bar:
        for e, start, stop in phases:
            with gather([experts[e]]):
                for run in runs:
                    run.run_steps(experts, start, stop)
                    bar.update()
    return [run.finish().final_latents for run in runs]


def summarize(result: dict) -> dict[str, float]:
    """``eval/<reward>/mean`` and ``/std`` for the combined reward and each reward."""
    out = {}
    for name, row in zip(result["names"], result["scores"]):
        out[f"eval/{name}/mean"] = float(row.mean())
        out[f"eval/{name}/std"] = float(row.std()) if row.numel() > 1 else 0.0
    return out


def write_eval(result: dict, out_dir, tag: str) -> dict:
    """Write ``<out_dir>/<tag>.json`` (every sample's prompt, seed and scores, and the summary) and,
    when videos were kept, ``<tag>.mp4`` (``<tag>.gif`` without an mp4 encoder): a grid of them
    (row-major in sample order) with ``<tag>_grid.json`` naming each cell's prompt, seed and
    scores. Returns the paths (``json``, ``video``)."""
    import json
    from pathlib import Path

    from miles.eval.videos import to_uint8, write_video

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {"prompt": p, "seed": s, **{n: float(result["scores"][k, i]) for k, n in enumerate(result["names"])}}
        for i, (p, s) in enumerate(zip(result["prompts"], result["seeds"]))
    ]
    paths = {"json": out_dir / f"{tag}.json"}
    paths["json"].write_text(json.dumps({"summary": summarize(result), "samples": rows}, indent=1))
    if result["videos"]:
        order = sorted(result["videos"])
        grid = _grid([result["videos"][i] for i in order])
        paths["video"] = write_video(to_uint8(grid), out_dir / tag)
        cells = [{"cell": c, **rows[i]} for c, i in enumerate(order)]
        (out_dir / f"{tag}_grid.json").write_text(json.dumps(cells, indent=1))
    return paths


def grid_caption(result: dict, title: str, max_cells: int = 16) -> str:
    """``title`` and, cell by cell, each grid video's prompt, seed and scores (the wandb caption)."""
    order = sorted(result["videos"])
    lines = [title]
    for c, i in enumerate(order[:max_cells]):
        scores = " ".join(f"{n}={float(result['scores'][k, i]):.3f}" for k, n in enumerate(result["names"]))
        lines.append(f"[{c}] {result['prompts'][i]} (seed {result['seeds'][i]}): {scores}")
    if len(order) > max_cells:
        lines.append(f"... {len(order) - max_cells} more cells in the _grid.json beside the video")
    return "\n".join(lines)


def _grid(videos: list[torch.Tensor], columns: int = 8) -> torch.Tensor:
    """Videos (F, 3, H, W) in [0, 1] tiled into one (F, 3, H', W') video, 2-pixel white gutters."""
    f, _, h, w = videos[0].shape
    cols = min(columns, len(videos))
    rows = -(-len(videos) // cols)
    canvas = torch.ones(f, 3, rows * (h + 2), cols * (w + 2))
    for k, v in enumerate(videos):
        r, c = divmod(k, cols)
        canvas[:, :, r * (h + 2) : r * (h + 2) + h, c * (w + 2) : c * (w + 2) + w] = v
    return canvas
