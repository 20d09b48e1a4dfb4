"""The per-rank memory budget as a promise: what stays resident, and what is left for activations.

``model.activation_memory_budget_gib`` is the per-rank TOTAL: everything the trainer allocates on a
GPU must fit in it, at every phase. :class:`ResidentMemory` accounts for what is not training
activations, term by term (bytes per rank); :func:`activation_budget` gives activation
checkpointing what is left and refuses, before any heavy work, a budget that the rollout alone
cannot meet. The run plan (``miles/train/plan.py``), which the trainer runs and the dry run
prints, builds it with :meth:`ResidentMemory.of`, so the estimate the dry run prints and the plan
the trainer picks agree.

Notation: S = the FSDP shard group size (W, or W / replicate_size under HSDP: replicas each hold a
full set of shards), N = parameters of all experts (base), N_t = trainable parameters (all of N for a
full fine-tune, else the LoRA adapters), c = bytes of ``model.dtype`` (the compute dtype), B = the
micro batch x 2 with CFG, T = tokens per sp rank, D / F = hidden / FFN size.

    weights          4·N/S (fp32 masters); LoRA: c·N/S (frozen base in the compute dtype) + 4·N_t/S
    grads            4·N_t/S                       fp32, sharded like the masters
    optimizer        8·N_t/S                       AdamW exp_avg + exp_avg_sq (fp32)
    ema              4·N_t/S                       ``train.ema_decay`` > 0: fp32 shadow of the shards
    old_policy       = weights                     DiffusionNFT's old policy: a sharded copy
    reference        c·N/S                         full fine-tune with a KL term: a frozen copy stored in the
                                                   compute dtype (LoRA: the adapters switched off)
    text_encoder     its params x its dtype        only when ``model.text_encoder_offload`` is False
    vae              its params x its dtype
    rewards          the reward models' parameters and buffers on the device: the plan estimates them
                     from their weight files (``miles.rewards.base.weight_file_bytes``), the trainer
                     puts in the loaded bytes (``miles.rewards.base.resident_bytes``)
    buffers          2·samples·K·latent·4 + 2·samples·L_text·text_dim·c   (stored SDE latents, prompts)
    gathered_train   (root + 2 blocks)·c           FSDP's current + prefetched unit (whole expert when
                                                   ``reshard_after_forward`` is off)
    gathered_rollout max expert·c                  ONE expert unsharded at a time (rollout_unsharded;
                                                   else as gathered_train); rollout.precision fp8 adds
                                                   its float8 copy, max expert·1 (an upper bound: the
                                                   blocks' Linear weights)
    rollout_workspace B·T·(16·D + 2·F)·c           one block's no-grad working set (rough)
    decode_workspace  m·(2·3·f·h·w·4 + k·d·h'·w'·v)   one micro-batch of m videos decoded: the fp32
                                                   video and its concatenation, plus the decoder's
                                                   working set (its causal caches and last stages:
                                                   k bytes a pixel per decoder channel and d = the
                                                   decoder's base dim, both the model family's
                                                   ``vae_decoder_memory``; VAE dtype v); h'·w' = one 256² tile
                                                   with vae_tiling. Frames leave the GPU as uint8.
    decode_beside    decode_workspace              with ``rollout.overlap_decode`` (a micro-batch is decoded
    _rollout                                       while the next is sampled; its frames then go to
                                                   pinned host memory), else 0
    slack            5 % of the budget             allocator fragmentation, kernel workspaces,
                                                   communication buffers

    persistent    = weights + optimizer + ema + old_policy + reference + text_encoder + vae + rewards
                    + buffers
    train peak    = persistent + grads + gathered_train + activations        (+ slack <= budget)
    rollout peak  = persistent + max(gathered_rollout + rollout_workspace + decode_beside_rollout,
                                     decode_workspace)

Assumptions about the rest of the trainer (issue 16): sharded loading (no unsharded fp32 copy after
startup), the rollout gathers one expert at a time, decoded videos leave the GPU as uint8, and the
text encoder is offloaded to the CPU by default (its visits to the GPU happen while no expert is
gathered). Not counted: the reward models' scoring workspaces (they run while no expert is
gathered and no activation is alive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = [
    "ALLOCATOR_SLACK",
    "MemoryBudgetError",
    "ModelSizes",
    "ResidentMemory",
    "RolloutShape",
    "activation_budget",
    "activation_bytes",
    "block_bytes_per_token",
    "cfg_factor",
    "count_sde_steps",
    "lora_numel",
    "model_sizes",
    "rollout_shape",
]

GIB = 2**30
ALLOCATOR_SLACK = 0.05  # of the budget: fragmentation, kernel workspaces, communication buffers
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # text encoder auto: bf16 on CUDA
_VAE_TILE = 256  # the tile of a tiled decode (diffusers: tile_sample_min_height/width)


class MemoryBudgetError(ValueError):
    """The per-rank memory budget cannot hold the run; the message names the fixes."""


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """Parameter counts and shapes of the model (exact: from the modules, or meta modules)."""

    expert_params: tuple[int, ...]  # base parameters of each expert (no adapters)
    lora_params: int = 0  # adapters over all experts; 0: a full fine-tune
    largest_block: int
    outside_blocks: int  # parameters of the largest expert outside its blocks
    hidden_size: int
    ffn_dim: int
    text_dim: int
    text_encoder_params: int = 0
    vae_params: int = 0
    vae_base_dim: int = 0  # d: the VAE decoder's base width (the family's ``vae_decoder_memory``)
    vae_decoder_bytes: float = 0.0  # k: its peak bytes per output pixel, per channel of d, per dtype byte
    vae_whole_clip: bool = False  # the decoder holds every frame at once (LTX-Video), not one at a time


@dataclass(frozen=True, kw_only=True)
class RolloutShape:
    """One rank's rollout: how many samples, how long, what is stored for training."""

    tokens_per_rank: int  # ceil(S / sp)
    tokens_per_sample: int = 0  # S, the model's tokens of one sample (the family's ``num_tokens``)
    latent_numel: int  # one sample's latent (C·f·h·w)
    num_frames: int
    height: int
    width: int
    samples_per_rank: int
    num_sde_steps: int
    micro_batch: int
    cfg_factor: int  # 2 with classifier-free guidance
    text_tokens: int


@dataclass(frozen=True, kw_only=True)
class ResidentMemory:
    """Bytes per rank of everything but training activations (see the module docstring)."""

    weights: float
    grads: float
    optimizer: float
    ema: float = 0.0
    old_policy: float = 0.0
    reference: float = 0.0
    text_encoder: float = 0.0
    vae: float = 0.0
    rewards: float = 0.0
    buffers: float = 0.0
    gathered_train: float = 0.0
    gathered_rollout: float = 0.0
    rollout_workspace: float = 0.0
    decode_workspace: float = 0.0
    decode_beside_rollout: float = 0.0  # rollout.overlap_decode: a decode workspace during sampling
    encode_visit: float = 0.0  # an offloaded text encoder on the GPU while it encodes (experts sharded)

    @property
    def persistent(self) -> float:
        """Held through every phase."""
        return (
            self.weights
            + self.optimizer
            + self.ema
            + self.old_policy
            + self.reference
            + self.text_encoder
            + self.vae
            + self.rewards
            + self.buffers
        )

    @property
    def train_fixed(self) -> float:
        """The training phase's peak without its activations."""
        return self.persistent + self.grads + self.gathered_train

    @property
    def rollout_peak(self) -> float:
        """The rollout phase's peak (sampling, then decoding with the experts resharded; with
        ``rollout.overlap_decode`` a decode runs beside the sampling)."""
        return self.persistent + max(
            self.gathered_rollout + self.rollout_workspace + self.decode_beside_rollout,
            self.decode_workspace,
            self.encode_visit,
        )

    def as_gib(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GIB for f in fields(self)}

    @classmethod
    def of(
        cls,
        cfg,
        sizes: ModelSizes,
        shape: RolloutShape,
        shard_size: int,
        device_type: str = "cuda",
        reward_bytes: float = 0.0,
    ) -> ResidentMemory:
        """The terms for config ``cfg`` (a ``miles.config.Config``) with parameters sharded over
        ``shard_size`` ranks (``ParallelDims.shard``: world / replicate_size) on ``device_type``
        (which resolves ``model.text_encoder_dtype: auto``); ``reward_bytes``: the loaded reward
        models' bytes on the device."""
        from miles.algorithms import build_algorithm
        from miles.models.dtypes import text_encoder_dtype

        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        m, p = cfg.model, cfg.parallel
        algorithm = build_algorithm(cfg)
        c = _DTYPE_BYTES[m.dtype]
        N, S = sum(sizes.expert_params), shard_size
        lora = m.lora_rank > 0
        trainable = sizes.lora_params if lora else N
        weights = (c * N + 4 * trainable) / S if lora else 4 * N / S
        text_encoder = (
            sizes.text_encoder_params * text_encoder_dtype(m.text_encoder_dtype, device_type).itemsize
        )
        decode = _decode_bytes(
            shape,
            sizes.vae_base_dim,
            sizes.vae_decoder_bytes * (shape.num_frames if sizes.vae_whole_clip else 1),
            _DTYPE_BYTES[m.vae_dtype],
            m.vae_tiling,
        )
        in_flight = (sizes.outside_blocks + 2 * sizes.largest_block) * c
        if not p.reshard_after_forward:
            in_flight = max(sizes.expert_params) * c
        return cls(
            weights=weights,
            grads=4 * trainable / S,
            optimizer=8 * trainable / S,
            ema=4 * trainable / S if cfg.train.ema_decay > 0 else 0.0,
            old_policy=weights if algorithm.uses_old_policy else 0.0,
            reference=c * N / S if algorithm.uses_reference and not lora else 0.0,
            text_encoder=0.0 if m.text_encoder_offload else text_encoder,
            encode_visit=text_encoder if m.text_encoder_offload else 0.0,
            vae=sizes.vae_params * _DTYPE_BYTES[m.vae_dtype],
            rewards=float(reward_bytes),
            buffers=_buffer_bytes(shape, sizes.text_dim, c),
            gathered_train=in_flight,
            gathered_rollout=max(sizes.expert_params) * (c + (cfg.rollout.precision == "fp8"))
            if p.rollout_unsharded
            else in_flight,
            rollout_workspace=shape.micro_batch
            * shape.cfg_factor
            * shape.tokens_per_rank
            * (16 * sizes.hidden_size + 2 * sizes.ffn_dim)
            * c,
            decode_workspace=decode,
            decode_beside_rollout=decode if cfg.rollout.overlap_decode else 0.0,
        )


def _buffer_bytes(shape: RolloutShape, text_dim: int, c: int) -> float:
    """Stored SDE latents (fp32, before and after each trained step) and prompt embeddings (cond and
    uncond, in the compute dtype) of one rank's rollout."""
    latents = 2 * shape.samples_per_rank * shape.num_sde_steps * shape.latent_numel * 4
    return latents + 2 * shape.samples_per_rank * shape.text_tokens * text_dim * c


def _decode_bytes(shape: RolloutShape, base_dim: int, bytes_per_pixel: float, v: int, tiling: bool) -> float:
    """One micro-batch decoded: its fp32 videos (and their concatenation) plus the decoder's working
    set, k·d·h·w·v (the family's ``vae_decoder_memory``: d, k), over one tile with tiling."""
    h, w = shape.height, shape.width
    if tiling:
        h, w = min(h, _VAE_TILE), min(w, _VAE_TILE)
    video = 2 * 3 * shape.num_frames * shape.height * shape.width * 4
    stage = bytes_per_pixel * base_dim * h * w * v
    return shape.micro_batch * (video + stage)


def _largest_terms(resident: ResidentMemory, n: int = 4) -> str:
    terms = sorted(resident.as_gib().items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.1f}" for k, v in terms if v > 0)


def activation_budget(total_bytes: float, resident: ResidentMemory) -> float:
    """Bytes left for training activations so that every phase's peak + the allocator slack stays
    within ``total_bytes`` (the per-rank budget). Raises :class:`MemoryBudgetError` when the
    rollout alone, or the training state alone, does not fit."""
    if not math.isfinite(total_bytes) or total_bytes <= 0:
        raise MemoryBudgetError(f"model.activation_memory_budget_gib must be > 0, got {total_bytes / GIB:g}")
    usable = total_bytes * (1 - ALLOCATOR_SLACK)
    fixes = (
        "raise model.activation_memory_budget_gib (the per-rank total), shard over more ranks (a smaller "
        "parallel.replicate_size, a larger world), train LoRA adapters, lower train.micro_batch_size, "
        "or turn on model.vae_tiling / model.text_encoder_offload"
    )
    if resident.rollout_peak > usable:
        raise MemoryBudgetError(
            f"the rollout alone needs {resident.rollout_peak / GIB:.1f} GiB per rank (largest terms, GiB: "
            f"{_largest_terms(resident)}) but the budget of {total_bytes / GIB:g} GiB leaves "
            f"{usable / GIB:.1f} GiB after the {ALLOCATOR_SLACK:.0%} allocator slack: {fixes}"
        )
    left = usable - resident.train_fixed
    if left <= 0:
        raise MemoryBudgetError(
            f"weights, gradients and optimizer state need {resident.train_fixed / GIB:.1f} GiB per rank "
            f"(largest terms, GiB: {_largest_terms(resident)}), nothing is left for activations within "
            f"{total_bytes / GIB:g} GiB: {fixes}"
        )
    return left


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def lora_numel(model, rank: int, targets: list[str]) -> int:
    """Adapter parameters peft adds: r·(in + out) per targeted Linear (peft's name-suffix matching)."""
    from torch import nn

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (module.in_features + module.out_features)
    return total


def model_sizes(
    transformers,
    text_encoder=None,
    vae=None,
    lora_rank: int = 0,
    lora_targets=(),
    vae_decoder: tuple = (0, 0.0),
    architecture: dict | None = None,
) -> ModelSizes:
    """:class:`ModelSizes` of loaded (or meta) modules, the one count the plan, the trainer, the dry
    run and the benches read. LoRA adapters (``lora_`` parameters) are counted apart from the base;
    with none installed yet and ``lora_rank`` > 0, those peft will add on ``lora_targets`` (so a meta
    model's sizes equal the loaded model's with its adapters). A block's and the root's sizes include
    their adapters: FSDP gathers them together. ``vae_decoder``: the family's ``vae_decoder_memory()``
    (d, k), with a third element True when the decoder holds the whole clip at once (k is then per
    pixel of every frame). ``architecture``: the family's ``architecture`` (ffn and text widths;
    default: a Wan config's). Call it before FSDP shards them (or on DTensors: global counts)."""
    from miles.blocks import transformer_blocks

    installed = any("lora_" in n for t in transformers for n, _ in t.named_parameters())

    def adapters(module) -> int:  # installed, else the ones peft will add
        if installed:
            return sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)
        return lora_numel(module, lora_rank, list(lora_targets)) if lora_rank > 0 else 0

    def total(module) -> int:
        return _numel(module) + (0 if installed else adapters(module))

    base = [total(t) - adapters(t) for t in transformers]
    blocks = [max(total(b) for b in transformer_blocks(t)) for t in transformers]
    outside = [total(t) - sum(total(b) for b in transformer_blocks(t)) for t in transformers]
    tcfg = transformers[0].config
    return ModelSizes(
        expert_params=tuple(base),
        lora_params=sum(adapters(t) for t in transformers),
        largest_block=max(blocks),
        outside_blocks=max(outside),
        hidden_size=tcfg.num_attention_heads * tcfg.attention_head_dim,
        ffn_dim=architecture["ffn_dim"] if architecture else tcfg.ffn_dim,
        text_dim=architecture["text_dim"] if architecture else tcfg.text_dim,
        text_encoder_params=_numel(text_encoder),
        vae_params=_numel(vae),
        vae_base_dim=vae_decoder[0],
        vae_decoder_bytes=vae_decoder[1],
        vae_whole_clip=len(vae_decoder) > 2 and bool(vae_decoder[2]),
    )


def count_sde_steps(cfg) -> int:
    """How many SDE steps of a rollout are stored and trained (the sampler's own count)."""
    import torch

    from miles.rollout.sampler import sde_step_indices

    r = cfg.rollout
    steps = sde_step_indices(
        r.num_steps,
        sde_window_size=r.sde_window_size or None,
        sde_window_start_range=tuple(r.sde_window_range) if r.sde_window_size else None,
        timestep_fraction=r.timestep_fraction,
        generator=torch.Generator().manual_seed(0),
        sde_type=r.sde_type,
    )
    return len(steps)


def cfg_factor(cfg, num_experts: int) -> int:
    """2 when classifier-free guidance runs (cond and uncond as one batch), else 1."""
    from miles.rollout.guidance import uses_cfg

    return 2 if uses_cfg(cfg.rollout, num_experts) else 1


def rollout_shape(cfg, model, sp: int, num_sde_steps: int) -> RolloutShape:
    """One rank's :class:`RolloutShape` for ``model`` (a ``FamilyModel``, loaded or meta) at sp ``sp``."""
    r = cfg.rollout
    tokens = model.num_tokens(r.num_frames, r.height, r.width)
    return RolloutShape(
        tokens_per_rank=-(-tokens // sp),
        tokens_per_sample=tokens,
        latent_numel=math.prod(model.latent_shape(r.num_frames, r.height, r.width)),
        num_frames=r.num_frames,
        height=r.height,
        width=r.width,
        samples_per_rank=cfg.data.prompts_per_rank * cfg.data.group_size,
        num_sde_steps=num_sde_steps,
        micro_batch=cfg.train.micro_batch_size,
        cfg_factor=cfg_factor(cfg, len(model.transformers)),
        text_tokens=cfg.data.max_sequence_length,
    )


def block_bytes_per_token(
    D: int, F: int, b: int, compiled: bool = False, per_token_timesteps: bool = False
) -> dict[str, float]:
    """Bytes one transformer block keeps for backward per token, per checkpointing mode (see the module docstring)."""
    return {
        # compiled: Inductor recomputes the fp32 element-wise outputs instead of saving them, the
        # per-token modulation products (eager: +32·D) among them
        "none": (18 * b * D if compiled else (52 + 9 * b + 32 * per_token_timesteps) * D) + 2 * F * b,
        "selective": (9.3 * D + F) * b,
        "attention": 3 * D * b,  # self/cross attention outputs and the block input
        "full": D * b,
    }


def activation_bytes(
    cfg,
    *,
    L: int,
    tokens: int,
    D: int,
    F: int,
    b: int,
    compiled: bool = False,
    per_token_timesteps: bool = False,
    activation_budget_bytes: float = 0.0,
) -> tuple[float, str]:
    """Training activations of one expert's forward over ``tokens`` (micro batch x CFG x T), and a note.
    ``activation_budget_bytes``: with ``budget``, what the per-rank total leaves for activations
    (:func:`activation_budget`), as the trainer computes it."""
    mode = cfg.model.activation_checkpointing
    if isinstance(mode, bool):  # older configs: a switch for full checkpointing
        mode = "full" if mode else "none"
    per_block = block_bytes_per_token(D, F, b, compiled, per_token_timesteps)
    per_block = {k: v * tokens for k, v in per_block.items()}
    if mode == "budget":
        from miles.parallel.checkpointing import plan_modes

        budget = cfg.model.activation_memory_budget_gib
        try:
            modes = plan_modes(L, per_block, activation_budget_bytes)
        except ValueError as e:
            raise MemoryBudgetError(f"activation budget (estimated): {e}") from None
        counts = {m: modes.count(m) for m in ("none", "selective", "attention", "full") if modes.count(m)}
        note = (
            f"budget {budget:g} GiB total ({activation_budget_bytes / GIB:.1f} for activations) -> "
            + ", ".join(f"{n} {m}" for m, n in counts.items())
        )
    else:
        modes, note = [mode] * L, mode
    total = sum(per_block[m] for m in modes)
    if any(m != "none" for m in modes):
        total += per_block["none"]  # one block's activations while it is recomputed
    return total, note
