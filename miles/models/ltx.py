"""The LTX-Video model backend: load a local diffusers ``LTXPipeline`` folder, encode prompts (T5,
with the attention mask), call the transformer on a packed latent, decode videos.

What differs from Wan, and where it lives (the run reaches it only through the model-family seam,
:mod:`miles.models.family`; :class:`LTXModel` is the family's ``FamilyModel``, :class:`LTXRouting`
its ``ExpertRouting``):

- the transformer takes the latent as tokens, (B, F·H·W, C) (``LTXPipeline._pack_latents``, patch
  size 1), the latent's size for its RoPE grid, and the RoPE's interpolation scale
  (VAE temporal ratio / frame rate, spatial ratio, spatial ratio): :meth:`LTXRouting.forward`
  packs the sampler's (B, C, F, H, W) latent, calls the expert as ``LTXPipeline`` does and unpacks;
- the cross-attention takes the text's attention mask (the T5 embeddings of padding tokens are not
  zero, unlike Wan's): the family's text condition is the embeddings with the mask as one more
  channel, (B, L, D + 1), an opaque tensor to the rest of the run that only ``forward`` reads;
- the latent is normalised with the VAE's ``latents_mean``/``latents_std`` buffers and
  ``scaling_factor`` (``LTXPipeline._normalize_latents``), decoded with the VAE's timestep
  conditioning at ``decode_timestep`` 0, the pipeline's default;
- the noise schedule is the folder's scheduler as ``LTXPipeline`` sets it (the shift from the token
  count, ``calculate_shift``, and the ``shift_terminal`` stretch): :func:`ltx_flow_schedule`;
- sequence parallelism: the family plan of :mod:`miles.models.ltx_sp` (the text and its mask stay
  whole on every rank, USP in self-attention only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from miles.models.dtypes import DTYPES, text_encoder_dtype, text_encoder_on
from miles.models.folder import read_json, read_pipeline_index
from miles.rollout.schedule import FlowSchedule

EXPERT_FOLDERS = ("transformer",)
LTX_PIPELINES = frozenset({"LTXPipeline"})
FRAME_RATE = 25  # LTXPipeline's default frame_rate: the RoPE's temporal interpolation scale
# The VAE decoder's peak working set (the memory plan's decode term, ``miles.train.memory_budget``):
# AutoencoderKLLTXVideo decodes the whole clip at once, at 1/32 to 1/4 of the output resolution but
# every frame together: bytes per output pixel of the clip (all frames), per channel of
# ``decoder_block_out_channels[0]``, per dtype byte. Live storages on the CPU at 1/8 and 1/4 of the
# published widths: 0.318 and 0.302 (wider CPU runs add the convolutions' packed weight copies,
# quadratic in the width); tests/unit/test_resident_memory.py measures it again.
VAE_DECODER_BYTES = 0.31


def pack_text(embeds: Tensor, mask: Tensor) -> Tensor:
    """The family's text condition: T5 embeddings (B, L, D) with their attention mask (B, L) as
    channel D (1.0 for a token, 0.0 for padding)."""
    return torch.cat([embeds, mask.to(embeds.dtype)[..., None]], dim=-1)


def unpack_text(text: Tensor) -> tuple[Tensor, Tensor]:
    """(embeds (B, L, D), boolean mask (B, L)) of a text condition of :func:`pack_text`. The embeddings
    are made contiguous, as the pipeline's are: a strided (B, L, D) view takes another matmul path
    (on the CPU, in bf16: other roundings)."""
    return text[..., :-1].contiguous(), text[..., -1] > 0.5


@dataclass(frozen=True)
class LTXRouting:
    """How an LTX folder's one expert is called (the family's ``ExpertRouting``): one timestep per
    sample, t = 1000·σ as ``LTXPipeline`` passes its scheduler's timestep."""

    rope_interpolation_scale: tuple[float, float, float]

    @property
    def boundary_sigma(self) -> None:
        return None

    @property
    def per_token_timesteps(self) -> bool:
        return False

    def expert_index(self, t: float | Tensor, num_experts: int) -> int:
        if num_experts != 1:
            raise ValueError(f"LTX-Video has one expert, got {num_experts}")
        return 0

    def model_timestep(self, t: Tensor, x: Tensor, expert: nn.Module) -> Tensor:
        return t

    def report(self, num_experts: int) -> dict:
        return {"expert_switch": None, "timestep_layout": None}

    def forward(self, expert: nn.Module, x: Tensor, timestep: Tensor, text: Tensor, **extra) -> Tensor:
        """The expert's output (B, C, F, H, W) at latents ``x`` (B, C, F, H, W): the latent packed
        into tokens, the text's mask to the cross-attention, as ``LTXPipeline`` calls it."""
        from diffusers import LTXPipeline

        if extra:
            raise ValueError(f"LTX-Video takes no {sorted(extra)} (no image conditioning)")
        cfg = expert.config
        _, _, f, h, w = x.shape
        pt, p = cfg.patch_size_t, cfg.patch_size
        embeds, mask = unpack_text(text)
        out = expert(
            # contiguous, as the pipeline's latents are after each scheduler step (a strided view
            # takes another matmul path: other bf16 roundings, and sharding would make it contiguous)
            hidden_states=LTXPipeline._pack_latents(x, p, pt).contiguous(),
            encoder_hidden_states=embeds,
            timestep=timestep,
            encoder_attention_mask=mask,
            num_frames=f // pt,
            height=h // p,
            width=w // p,
            rope_interpolation_scale=self.rope_interpolation_scale,
            return_dict=False,
        )[0]
        return LTXPipeline._unpack_latents(out, f // pt, h // p, w // p, p, pt)


@dataclass
class LTXModel:
    """What the trainer needs of a loaded LTX-Video pipeline (the family's ``FamilyModel``)."""

    path: Path
    transformers: list[nn.Module]  # the one expert
    pipeline: object  # the diffusers LTXPipeline (text encoder, tokenizer, VAE, scheduler)
    scheduler_config: dict
    condition_mode: None = None  # text-to-video only
    text_encoder_offload: bool = False

    @property
    def routing(self) -> LTXRouting:
        vae = self.pipeline.vae.config
        t, s = _ratios(vae)
        return LTXRouting((t / FRAME_RATE, s, s))

    @property
    def expert_folders(self) -> tuple[str, ...]:
        return EXPERT_FOLDERS

    @property
    def num_attention_heads(self) -> int:
        return self.transformers[0].config.num_attention_heads

    def vae_decoder_memory(self) -> tuple[int, float, bool]:
        """(d, k, whole clip) of the VAE decoder for the memory plan: ``decoder_block_out_channels[0]``,
        :data:`VAE_DECODER_BYTES` per output pixel of every frame (the decoder holds the whole clip)."""
        vae = getattr(self.pipeline, "vae", None)
        if getattr(vae, "config", None) is None:
            return 0, 0.0, False
        return int(vae.config.decoder_block_out_channels[0]), VAE_DECODER_BYTES, True

    def text_length_warnings(self, max_sequence_length: int) -> list[str]:
        return []  # any length: the cross-attention masks the padding

    @property
    def architecture(self) -> dict:
        c = self.transformers[0].config
        return {
            "num_layers": c.num_layers,
            "ffn_dim": 4 * c.num_attention_heads * c.attention_head_dim,  # diffusers' FeedForward, mult 4
            "text_dim": c.caption_channels + 1,  # the T5 embeddings and the mask channel (pack_text)
            "patch_size": (c.patch_size_t, c.patch_size, c.patch_size),
        }

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        t, s = _ratios(self.pipeline.vae.config)
        return (self.transformers[0].config.out_channels, (num_frames - 1) // t + 1, height // s, width // s)

    def num_tokens(self, num_frames: int, height: int, width: int) -> int:
        _, f, h, w = self.latent_shape(num_frames, height, width)
        cfg = self.transformers[0].config
        return (f // cfg.patch_size_t) * (h // cfg.patch_size) * (w // cfg.patch_size)

    def flow_schedule(self, rollout, num_tokens: int) -> FlowSchedule:
        """``LTXPipeline``'s noise schedule at ``num_tokens`` tokens a sample, from the folder's
        scheduler config (:func:`ltx_flow_schedule`); a ``rollout.shift`` set by hand is refused."""
        return ltx_flow_schedule(self.scheduler_config, num_tokens, rollout)

    def sequence_parallel_plan(self, transformer: nn.Module):
        from miles.models.ltx_sp import ltx_sequence_parallel_plan

        return ltx_sequence_parallel_plan(transformer)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompt: str, max_sequence_length: int, device):
        """(prompt, negative) text conditions, each (B, L, D + 1): ``LTXPipeline.encode_prompt``'s
        embeddings with its attention mask (:func:`pack_text`)."""
        pipe = self.pipeline
        with text_encoder_on(pipe.text_encoder, device, self.text_encoder_offload):
            pos, pos_mask, neg, neg_mask = pipe.encode_prompt(
                prompt=prompts,
                negative_prompt=[negative_prompt] * len(prompts),
                do_classifier_free_guidance=True,
                max_sequence_length=max_sequence_length,
                device=device,
            )
        return pack_text(pos, pos_mask), pack_text(neg, neg_mask)

    @torch.no_grad()
    def encode_texts(self, texts: list[str], max_sequence_length: int, device) -> Tensor:
        """(N, L, D + 1) text conditions of ``texts`` (no CFG): embeddings and mask (:func:`pack_text`)."""
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            prompt=texts,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        return pack_text(embeds, mask)

    def encode_images(self, images: list, num_frames: int, height: int, width: int, device):
        raise ValueError(f"{self.path} is a text-to-video model: it takes no image")

    @torch.no_grad()
    def encode_video(self, clip: Tensor, device) -> Tensor:
        """Frames (F, 3, H, W) in [0, 1] -> normalised latents (C, F', H', W') fp32 on ``device``."""
        vae = self.pipeline.vae
        x = (clip.permute(1, 0, 2, 3)[None] * 2.0 - 1.0).to(device, vae.dtype)
        z = vae.encode(x).latent_dist.mode().float()
        mean, std = _latent_stats(vae, z)
        return ((z - mean) * vae.config.scaling_factor / std)[0]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents (B, C, F, H, W) -> frames (B, F, 3, H', W') in [0, 1], fp32
        (``LTXPipeline``'s denormalisation; decode_timestep 0 for a timestep-conditioned VAE)."""
        vae = self.pipeline.vae
        z = latents.to(vae.dtype)
        mean, std = _latent_stats(vae, z)
        z = z * std / vae.config.scaling_factor + mean
        temb = None
        if vae.config.timestep_conditioning:
            temb = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        video = vae.decode(z, temb, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return ((video.float() / 2 + 0.5).clamp(0, 1)).permute(0, 2, 1, 3, 4).contiguous()

    def calibrate_block_memory(
        self, transformer: nn.Module, tokens: int, device, **options
    ) -> dict[str, float]:
        from miles.models.ltx_sp import calibrate_ltx_block_memory

        return calibrate_ltx_block_memory(transformer, tokens, device, **options)


def _ratios(vae_config) -> tuple[int, int]:
    """(temporal, spatial) compression of an AutoencoderKLLTXVideo config, as the VAE computes them."""
    spatial = vae_config.get("spatial_compression_ratio") if hasattr(vae_config, "get") else None
    temporal = vae_config.get("temporal_compression_ratio") if hasattr(vae_config, "get") else None
    scaling = vae_config.spatio_temporal_scaling
    spatial = spatial or vae_config.patch_size * 2 ** sum(scaling)
    temporal = temporal or vae_config.patch_size_t * 2 ** sum(scaling)
    return temporal, spatial


def _latent_stats(vae, z: Tensor) -> tuple[Tensor, Tensor]:
    view = (1, -1, 1, 1, 1)
    return (
        vae.latents_mean.view(view).to(z.device, z.dtype),
        vae.latents_std.view(view).to(z.device, z.dtype),
    )


# FlowMatchEulerDiscreteScheduler options the sampler's schedule does not implement (their defaults).
_UNSUPPORTED_SCHEDULER = {
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "invert_sigmas": False,
    "time_shift_type": "exponential",
}


def ltx_flow_schedule(config: dict, num_tokens: int, rollout=None) -> FlowSchedule:
    """The schedule ``LTXPipeline`` sets on its scheduler (``retrieve_timesteps(..., sigmas=linspace(1,
    1/T, T), mu=calculate_shift(tokens, ...))``) for the scheduler config ``config``: the dynamic
    shift's μ from the token count (``use_dynamic_shifting``) or the config's static ``shift``, then
    ``shift_terminal``. ``rollout`` (the run's rollout section): its ``shift`` left at the default,
    else a ``ValueError`` (the folder owns the schedule)."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    odd = {k: config[k] for k, default in _UNSUPPORTED_SCHEDULER.items() if config.get(k, default) != default}
    if odd:
        raise ValueError(
            f"the LTX-Video folder's scheduler sets {odd}, which the sampler's schedule does not implement "
            f"(it follows FlowMatchEulerDiscreteScheduler's exponential time shift on LTXPipeline's grid)"
        )
    terminal = config.get("shift_terminal") or None
    if config.get("use_dynamic_shifting", False):
        mu = calculate_shift(
            num_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        source = f"the folder's scheduler (dynamic shift at {num_tokens} tokens)"
        schedule = FlowSchedule(
            shift=math.exp(mu), mu=mu, shift_terminal=terminal, grid="pipeline", source=source
        )
    else:
        shift = float(config.get("shift", 1.0))
        source = "the folder's scheduler (static shift)"
        schedule = FlowSchedule(shift=shift, shift_terminal=terminal, grid="pipeline", source=source)
    defaults = {f.name: f.default for f in fields(rollout)} if is_dataclass(rollout) else {}
    if "shift" in defaults and rollout.shift != defaults["shift"]:
        raise ValueError(
            f"rollout.shift {rollout.shift:g}: an LTX-Video folder sets its own noise schedule ({schedule.source}: "
            f"shift {schedule.shift:.4g}"
            + (f", shift_terminal {terminal:g}" if terminal else "")
            + "); remove rollout.shift from the recipe (the dry run prints the schedule)"
        )
    return schedule


def check_ltx_folder(path: Path) -> dict:
    """``model_index.json`` of a complete diffusers LTXPipeline folder; a clear error otherwise."""
    info = read_pipeline_index(path)
    if info.get("_class_name") not in LTX_PIPELINES:
        raise ValueError(f"model.path {path} holds a {info.get('_class_name')}, not an LTXPipeline")
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        if not (path / sub).is_dir():
            raise ValueError(f"model.path {path} lacks the '{sub}' folder of a diffusers LTXPipeline")
    return info


def scheduler_config(path: Path) -> dict:
    file = path / "scheduler" / "scheduler_config.json"
    return read_json(file) if file.is_file() else {}


def load_ltx(cfg, device: torch.device, experts: str = "load", seed: int = 0) -> LTXModel:
    """Load the LTXPipeline folder of ``cfg`` (the run's ``ModelConfig``) as :func:`miles.models.wan.load_wan`
    loads a Wan folder: ``experts`` ``load`` (whole, fp32, on ``device``) or ``skeleton`` (meta, for
    sharded loading); ``cfg.init == "random"`` builds every component from its config.json."""
    from diffusers import LTXPipeline

    from miles.models.sharded_load import RandomInit, build_skeleton, materialize
    from miles.models.wan import random_components, resolve_model_path

    if experts not in ("load", "skeleton"):
        raise ValueError(f"experts must be 'load' or 'skeleton', got {experts!r}")
    if cfg.task not in ("auto", "t2v"):
        raise ValueError(f"model.task {cfg.task!r}: LTX-Video folders are text-to-video; set model.task auto")
    path = resolve_model_path(cfg)
    info = check_ltx_folder(path)
    dtypes = {
        "transformer": torch.float32,
        "text_encoder": text_encoder_dtype(cfg.text_encoder_dtype, torch.device(device).type),
        "vae": DTYPES[cfg.vae_dtype],
        "default": torch.float32,
    }
    given = {}
    if experts == "skeleton" or cfg.init == "random":
        given = {"transformer": build_skeleton(path, "transformer")}
    if cfg.init == "random":
        given.update(random_components(path, info, dtypes, seed, torch.device(device)))
    pipe = LTXPipeline.from_pretrained(path, local_files_only=True, dtype=dtypes, **given)
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder.requires_grad_(False).eval()
    if not cfg.text_encoder_offload:
        pipe.text_encoder.to(device)
    pipe.vae.to(device).requires_grad_(False).eval()
    if cfg.vae_tiling:
        pipe.vae.enable_tiling()
    if experts == "load" and cfg.init == "random":
        materialize(pipe.transformer, device, RandomInit(seed=seed, salt="transformer"))
    elif experts == "load":
        pipe.transformer.to(device)
    return LTXModel(
        path=path,
        transformers=[pipe.transformer],
        pipeline=pipe,
        scheduler_config=scheduler_config(path),
        text_encoder_offload=cfg.text_encoder_offload,
    )
