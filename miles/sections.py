"""The config's own sections: the run, the model, the layout, the data, the rollout, the reward mix,
evaluation and training (dataclasses only; each field's docstring is its ``--help`` text).

The algorithms' sections (``grpo``, ``nft``, ...) live with each algorithm (``miles.algorithms``),
the rewards' (``reward.NAME``) with each reward (``miles.rewards``); ``miles.config`` assembles
them all into :class:`~miles.config.Config`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import tyro

from miles.config_load import MAX_STEPS

_NO_PREFIX = tyro.conf.arg(prefix_name=False)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    output_dir: str = "runs"
    """Parent folder of run directories; a run writes to ``output_dir/name``."""
    name: str = "tiny"
    """Run name: the run directory and the wandb run name."""
    seed: int = 0
    """Seed for noise, prompt order and initialisation; every rank derives its streams from it."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode. ``offline`` writes under the run directory (``wandb sync`` it later)."""
    wandb_project: str = "miles"
    """wandb project name."""
    tensorboard: bool = False
    """Also log the metrics and evaluation videos to TensorBoard, under the same names as wandb
    (``<run>/tensorboard``; ``tensorboard --logdir <run>/tensorboard``; the ``tensorboard`` extra)."""
    log_video_every: int = 0
    """Log sample videos (with prompts and rewards) every N rollouts; 0 turns it off."""
    progress: bool = True
    """Show progress bars on rank 0 when its stderr is a terminal (never in a log file)."""
    collective_timeout_s: float = 600.0
    """A collective that does not complete in this many seconds ends the job (a dead rank)."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """Local diffusers folder of a model family (Wan2.1 T2V, Wan2.2 TI2V-5B or A14B, ...:
    ``miles.models.families``). None: the embedded tiny model, built on demand under ``tiny_model_dir``."""
    tiny_variant: str = "two_expert"
    """Which embedded tiny model to use when ``path`` is None: one of ``miles.models.tiny.ALL_VARIANTS``,
    checked when the folder is resolved (``i2v``, ``i2v_two_expert``, ``ti2v``: the image-to-video
    layouts of Wan2.1-I2V, Wan2.2-I2V-A14B and TI2V-5B; the other families' tiny models)."""
    task: Literal["auto", "t2v", "i2v"] = "auto"
    """``i2v``: image-to-video, an image per prompt (data.prompt_file JSONL ``image``): Wan2.1-I2V and
    Wan2.2-I2V-A14B folders, or a TI2V-5B folder's image mode. ``auto``: i2v exactly for
    WanImageToVideoPipeline folders."""
    tiny_model_dir: str = ".cache/tiny-wan"
    """Where the embedded tiny models are built (``make tiny-model``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the transformer(s) in rollout and training (bf16 on GPU). A full fine-tune
    keeps fp32 master weights (FSDP2 casts them); with LoRA the frozen base is stored in this dtype
    (and a full fine-tune's KL reference too), the adapters in fp32."""
    text_encoder_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the frozen text encoder. ``auto``: bfloat16 on CUDA (UMT5-XXL: 11.4 GB instead of
    22.7 GB), float32 on CPU (CPU bf16 matmuls are slow, and the tiny models and the tiny world were
    built with fp32 text embeddings: their reference numbers stay bitwise)."""
    vae_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the frozen VAE."""
    activation_checkpointing: Literal["none", "selective", "attention", "full", "budget"] = "none"
    """Per-block activation checkpointing: ``selective`` keeps matmul/attention outputs and recomputes
    element-wise ops (a few % compute); ``attention`` keeps only attention outputs (recomputes the
    linears too); ``full`` recomputes whole blocks (+1 forward); ``budget`` picks per block to fit
    ``activation_memory_budget_gib``."""
    activation_memory_budget_gib: float = 40.0
    """With ``activation_checkpointing: budget``: the per-rank TOTAL GPU memory the run promises to
    stay within, in every phase. Everything resident (weights, gradients, optimizer, EMA, old policy,
    KL reference, text encoder if not offloaded, VAE, the rollout's gathered expert and decode) and a
    5% allocator slack are subtracted (``miles/train/memory_budget.py``); activations get the rest.
    A budget the rollout alone cannot meet is refused at startup."""
    compile: Literal["auto", "on", "off"] = "auto"
    """``torch.compile`` each transformer block (fuses Wan's fp32 norm/modulation/RoPE kernels; the
    first step pays the compile time). ``auto``: on CUDA only."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all parameters of the transformer(s)."""
    lora_alpha: float = 64.0
    """LoRA alpha (scale = alpha / rank)."""
    lora_target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    )
    """Module names LoRA adapts."""
    init: Literal["pretrained", "random"] = "pretrained"
    """``pretrained``: load the folder's weights (each rank reads only its own shards of the
    transformers: docs/scale.md). ``random``: build every component from its config.json with random
    weights and read no weight file: for memory rehearsals and benchmarks on config-only folders
    (the transformers' weights depend only on ``run.seed``, not on the layout)."""
    text_encoder_offload: bool = True
    """Keep the text encoder on the CPU between encodings (it visits the GPU to encode a rollout's
    unique prompts, once per rollout, and the negative prompt, once per run; embeddings are cached
    on the CPU: ``miles.rollout.prompt_cache``). False keeps it resident on the GPU."""
    vae_tiling: bool = False
    """Decode videos tile by tile (diffusers' ``enable_tiling``: 256-px tiles, 192-px stride, blended):
    less decode memory, a little slower, frames close to (not bitwise) the untiled decode."""


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    sequence_parallel_size: Annotated[int, _NO_PREFIX] = 1
    """Ranks that share one sample's token sequence (sp = ulysses x ring). 1 turns SP off."""
    ulysses_degree: Annotated[int, _NO_PREFIX] = 0
    """Ulysses (all-to-all over heads) degree inside sp; ring = sp / ulysses. 0: the largest
    degree that divides both the heads and sp."""
    fsdp_attention_backend: Annotated[str | None, _NO_PREFIX] = None
    """diffusers attention backend (``_native_cudnn``, ``_native_flash``, ``native``...). Also picks
    the ring kernel when ring > 1. None: cudnn on CUDA for bf16 compute (flash with
    ``--deterministic-mode``, which excludes cudnn attention), else the native default (fp32, CPU)."""
    deterministic_mode: Annotated[bool, _NO_PREFIX] = False
    """torch.use_deterministic_algorithms(True) (and Inductor's deterministic mode for compiled
    blocks): double runs give bitwise identical results. On CUDA the default attention backend is then
    flash, not cudnn (torch's deterministic mode excludes cudnn attention)."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after each block's forward (ZeRO-3)."""
    replicate_size: int = 1
    """HSDP: replicate the FSDP shards over this many groups (e.g. one per node) and shard within
    each group of world/replicate_size ranks. 1: plain FSDP over every rank."""
    rollout_unsharded: bool = True
    """Rollout: gather the parameters once per rollout instead of once per block per denoising
    step. Two experts are gathered one at a time (every micro-batch's high-noise steps, then the
    low-noise steps), so sampling holds one expert's full weights per rank (docs/rollout_memory.md)."""


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    prompt_file: str | None = None
    """Prompt file: ``.txt`` (one a line) or ``.jsonl`` (objects with ``prompt``). None: the
    project's small built-in prompt list."""
    prompts_per_rank: int = 2
    """Prompt groups each dp rank samples per rollout."""
    group_size: int = 4
    """Samples per prompt (the GRPO group, G >= 2)."""
    negative_prompt: str = ""
    """Negative prompt for classifier-free guidance."""
    max_sequence_length: int = 512
    """Text tokens fed to the text encoder (Wan uses 512)."""


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    num_frames: int = 5
    """Video frames (4k+1)."""
    height: int = 64
    """Frame height in pixels (a multiple of 16)."""
    width: int = 64
    """Frame width in pixels (a multiple of 16)."""
    num_steps: int = 8
    """Denoising steps per rollout."""
    shift: float = 3.0
    """Flow-matching timestep shift (Wan: 3.0 at 480p, 5.0 at 720p). LTX: leave unset; its folder's
    scheduler sets the schedule (shift from the token count, shift_terminal) and another value is refused."""
    guidance_scale: float = 4.0
    """CFG scale of the (high-noise) expert; <= 1 turns CFG off."""
    guidance_scale_2: float | None = None
    """CFG scale of the low-noise expert (two-expert models); None: same as guidance_scale."""
    noise_level: float = 0.7
    """SDE noise level a: sigma_t = a * sqrt(sigma / (1 - sigma)) (``sde``), or
    sigma_t = sigma_next * sin(a * pi / 2) with a in (0, 1] (``cps``). Ignored by ``flow_grpo_wan``,
    whose noise sigma_t = sigmas[1] * sigma has no level: any a > 0 gives its SDE rollouts, 0 the
    ODE (as for every sde_type)."""
    sde_type: Literal["sde", "cps", "flow_grpo_wan"] = "sde"
    """The stochastic step: ``sde`` (Flow-GRPO's SDE as in the paper and flow_grpo's SD3/FLUX
    scripts, sigma_t = a * sqrt(sigma / (1 - sigma))), ``cps`` (coefficients-preserving sampling,
    arXiv 2509.05952: re-noises the predicted clean sample at exactly the path's noise level; its
    log-prob is flow_grpo's unnormalised one), or ``flow_grpo_wan`` (flow_grpo's Wan step, as its
    scripts/train_wan2_1.py samples and trains it: sigma_t = sigmas[1] * sigma with no noise level,
    every denoising step noisy including the last, floor(timestep_fraction * num_steps) steps
    trained; add grpo.step_loss_weight sigma_over_sqrt_dt for its loss weight)."""
    timestep_fraction: float = 0.6
    """Fraction of denoising steps that use the SDE (and are trained on) when no window is set:
    the first ceil(fraction * num_steps), at most num_steps - 1 (``sde``, ``cps``), or the first
    floor(fraction * num_steps) (``flow_grpo_wan``; its Wan recipe uses 0.99)."""
    sde_window_size: int = 0
    """If > 0, the SDE runs on a window of this many consecutive steps, ODE elsewhere."""
    sde_window_range: list[int] = dataclasses.field(default_factory=lambda: [0, 4])
    """[lo, hi): the window's first step is drawn uniformly from this range each rollout."""
    same_noise_per_group: bool = False
    """Start every sample of a group from the same initial noise."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """The rollout's arithmetic: ``bf16`` samples with the trained weights in the compute dtype;
    ``fp8`` quantizes the gathered expert's block Linear layers to float8 (torchao, dynamic per-row
    activation and weight scales) once per rollout phase, on CUDA sm >= 89 only (``pip install
    -e '.[fp8]'``); training stays bf16 and the loss corrects for the drift (``tis_cap``,
    docs/fp8_rollout.md)."""
    attention_precision: Literal["bf16", "sage_int8"] = "bf16"
    """The rollout's self-attention: ``bf16`` the compute dtype's backend (cudnn SDPA on CUDA);
    ``sage_int8`` SageAttention's INT8 QK^T with fp16 PV (Triton, CUDA sm >= 80, ``pip install -e
    '.[attn-lowp]'``) while the gathered expert samples; cross-attention, training, the KL reference
    and evaluation stay bf16 and the loss corrects for the drift as for ``precision: fp8``
    (``tis_cap``; ring degree 1 only; docs/fp8_rollout.md, "Low-precision attention")."""
    tis_cap: float = 2.0
    """With a rollout policy that differs from the trained one (``precision: fp8``, or an
    ``attention_precision`` other than bf16): the truncated importance weight
    min(exp(logp_bf16 - logp_rollout), tis_cap) multiplying each sample-step's policy loss, whose
    ratio then uses the bf16 log-probs as old ones. 0: no correction (the old log-probs are the
    rollout's; the drift is still logged). Else >= 1."""
    overlap_decode: bool = False
    """Decode each micro-batch's videos as soon as they are sampled, on a worker thread and a side
    CUDA stream, while the transformer samples the next micro-batch; the frames wait in pinned host
    memory until scored. The numbers are bitwise those of decoding after the rollout; the VAE's
    decode workspace then counts beside the rollout's in the memory plan. On CPU each micro-batch
    is decoded right after it is sampled (nothing to overlap). On one H200 at the Wan2.1-1.3B shape it
    hid no time (the transformer keeps the GPU busy: BENCHMARKS.md, run D), hence off by default."""

    @property
    def differs_from_training(self) -> bool:
        """The rollout samples in another arithmetic than training (FP8 Linears or low-precision
        attention): its log-probs are corrected by the truncated importance weights (``tis_cap``)."""
        return self.precision != "bf16" or self.attention_precision != "bf16"


@dataclasses.dataclass(kw_only=True)
class RewardMixConfig:
    """The rewards trained on and how they are mixed; each reward's own options follow in its section."""

    weights: dict[str, float] = dataclasses.field(default_factory=lambda: {"jpeg_incompressibility": 1.0})
    """Reward name -> weight; the combined reward is the weighted sum."""
    normalize: dict[str, Literal["none", "group", "batch"]] = dataclasses.field(default_factory=dict)
    """Per-reward normalisation before weighting (``--reward.normalize NAME MODE [NAME MODE ...]``, all pairs after one flag): ``group`` (r - mean) /
    (std + 1e-4) within each prompt's group, ``batch`` over the whole rollout batch, ``none`` (the
    default for unnamed rewards) raw; the trained reward is sum_i weight_i * norm_i(reward_i).
    ``reward/<name>`` logs stay raw (miles.rewards.shaping)."""
    gold: list[str] = dataclasses.field(default_factory=list)
    """Rewards scored on held-out evaluation only, never trained on (logged as ``eval/<name>/mean``
    beside the trained ones) to watch over-optimisation; built and checked before the first rollout."""
    num_frames: int = 4
    """Frames sampled uniformly from each video by the frame-level rewards (jpeg_*, sharpness,
    pickscore, clipscore, hpsv2, aesthetic); a reward with its own ``num_frames`` option uses that."""


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    prompt_file: str | None = None
    """Held-out prompts (``.txt`` or ``.jsonl``), sampled deterministically and scored by every
    configured reward at the start, every ``every`` rollouts and at the end. None: no evaluation."""
    every: int = 0
    """Evaluate every N rollouts (and at the start and the end); 0: only at the start and the end."""
    num_seeds: int = 2
    """Samples per prompt, with fixed seeds 0..num_seeds-1."""
    seed: int = 0
    """The held-out noise's own seed, independent of ``run.seed``: runs of different run seeds are
    scored on the same noise (paired), as is ``python -m miles.eval``. Change it only to measure
    the evaluation's own spread."""
    sampler: Literal["rollout", "pipeline"] = "rollout"
    """``rollout``: the rollout's grid with ODE steps and its CFG (what training optimises, without
    its noise); ``pipeline``: the model folder's own scheduler, stepped as WanPipeline does (what
    users see at inference)."""
    num_steps: int | None = None
    """Denoising steps; None: rollout.num_steps."""
    log_videos: bool = True
    """Write a video grid of rank 0's evaluation samples (``<run>/eval/step_N.mp4``; GIF without an mp4 encoder) and log it."""


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    num_rollouts: int = 3
    """Rollout batches (each followed by its optimizer steps)."""
    steps_per_rollout: int = 2
    """Optimizer steps per rollout batch; the batch's samples are split evenly over them."""
    micro_batch_size: int = 2
    """Samples per forward pass, in rollout, decoding and training alike (gradients accumulate
    within an optimizer step). The same micro-batches in rollout and training make the
    recomputed log-probs exact; a fixed size makes samples independent of the dp layout."""
    learning_rate: float = 1e-4
    """AdamW learning rate (the peak of the schedule)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: ``constant`` keeps ``learning_rate``; ``cosine`` anneals it to
    ``lr_min_ratio`` x learning_rate at the run's last optimizer step (torch.optim.lr_scheduler;
    formula in miles/train/schedule.py)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up: the k-th step (from 1) uses learning_rate x k / W; 0: none."""
    lr_min_ratio: float = 0.0
    """The cosine schedule's floor, as a fraction of ``learning_rate``."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    adam_betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    checkpoint_every: int = 0
    """Save a checkpoint every N rollouts (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """Keep the last K checkpoints (0 keeps every one)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory, if any. ``--train.no-resume``
    refuses a run directory that holds a previous run (see ``overwrite``)."""
    overwrite: bool = False
    """With ``--train.no-resume``: delete the previous run's checkpoints, metrics, export, samples, eval
    and wandb files in the run directory, then start afresh."""
    export: bool = True
    """At the end, write the trained transformer(s) as a diffusers folder under ``<run>/export``."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the trained weights (e ← decay·e + (1 − decay)·w after
    every optimizer step; sharded like the weights, checkpointed) and evaluate and export it; 0: off."""
    guard: Literal["off", "warn", "stop", "kl"] = "off"
    """The over-optimisation guard (miles/train/guard.py): when, over the last ``guard_window``
    evaluations, the training reward rose while the held-out ``guard_reward`` fell by more than
    ``guard_margin``: ``warn`` says so; ``stop`` also ends the run and names the best held-out
    evaluation's checkpoint; ``kl`` multiplies the KL coefficient by ``guard_kl_factor``."""
    guard_window: int = 2
    """Evaluation intervals the guard compares across."""
    guard_margin: float = 0.01
    """The held-out fall (in the watched reward's units) that counts as over-optimisation."""
    guard_reward: str | None = None
    """The held-out reward the guard watches; None: the first ``reward.gold`` reward, else the trained mix."""
    guard_kl_factor: float = 2.0
    """``guard: kl``: the factor the KL coefficient is multiplied by at each firing."""
    weight_digest: bool = False
    """Print a sha256 of the full weights after every checkpoint save and load (checks that a resume
    across topologies restores the same bits; gathers every parameter, so off by default)."""


# Every numeric field's range: dotted key -> (rule, why). A rule is an interval "[a, b)" / "(a, b]" /
# "[a, b]" / "(a, b)", bounded on both sides: the values a real run can use (a setting of 1e30 ends
# far from its cause: an overflow, a huge allocation, a non-finite loss). Every number must also be
# finite (NaN and inf are refused everywhere). A list's items and a mapping's values each follow their
# field's rule; None (an optional field left unset) is not checked. The algorithms' and the rewards'
# options declare their own (their class's RANGES); ``miles.config.RANGES`` holds them all, and
# tests/unit/test_config_ranges.py fails when a numeric field has no row, or a row lets a huge value
# through, so a new field cannot skip its check.
RANGES: dict[str, tuple[str, str]] = {
    "run.seed": ("[0, 9223372036854775807]", "an int64"),
    "run.log_video_every": (f"[0, {MAX_STEPS}]", "0 turns it off"),
    "run.collective_timeout_s": (
        "(0, 604800]",
        "seconds a collective may take before the job ends (a week at most)",
    ),
    "model.activation_memory_budget_gib": ("(0, 4096]", "GiB of one GPU"),
    "model.lora_rank": ("[0, 4096]", "0: full fine-tune; Wan's widest layer is 5120"),
    "model.lora_alpha": ("(0, 1e4]", "the LoRA scale is alpha / rank"),
    "parallel.sequence_parallel_size": ("[1, 4096]", "1 turns SP off"),
    "parallel.ulysses_degree": ("[0, 4096]", "0 picks it automatically"),
    "parallel.replicate_size": ("[1, 4096]", "1: plain FSDP, no HSDP"),
    "data.prompts_per_rank": ("[1, 4096]", ""),
    "data.group_size": ("[2, 4096]", "GRPO normalises within a group"),
    "data.max_sequence_length": ("[1, 4096]", "text tokens fed to the text encoder; Wan uses 512"),
    "rollout.num_frames": ("[1, 4097]", "4k+1 frames: 1, 5, 9, ... 81"),
    "rollout.height": ("(0, 4096]", "pixels, a multiple of 16"),
    "rollout.width": ("(0, 4096]", "pixels, a multiple of 16"),
    "rollout.num_steps": ("[2, 1000]", "the scheduler has 1000 timesteps"),
    "rollout.shift": ("(0, 100]", "Wan uses 3.0 at 480p, 5.0 at 720p; LTX: unset, the folder's schedule"),
    "rollout.guidance_scale": ("[0, 100]", "<= 1 turns CFG off; Wan uses 5"),
    "rollout.guidance_scale_2": ("[0, 100]", "<= 1 turns CFG off; Wan uses 5"),
    "rollout.noise_level": ("[0, 10]", "Flow-GRPO uses 0.7"),
    "rollout.timestep_fraction": ("(0, 1]", ""),
    "rollout.sde_window_size": ("[0, 1000]", "0: no window"),
    "rollout.sde_window_range": ("[0, 1000]", "[lo, hi) of denoising step indices"),
    "reward.weights": ("[-1000, 1000]", "a weight of the reward mix"),
    "reward.num_frames": ("[1, 4097]", "frames sampled from each video for frame-level rewards"),
    "rollout.tis_cap": ("[0, 1000]", "0: no correction; otherwise >= 1, 2 is usual"),
    "eval.every": (f"[0, {MAX_STEPS}]", "0: only at the start and the end"),
    "eval.num_seeds": ("[1, 1000]", ""),
    "eval.seed": ("[0, 9223372036854775807]", "an int64: the held-out noise's seed, the same for every run"),
    "eval.num_steps": ("[1, 1000]", "the scheduler has 1000 timesteps"),
    "train.num_rollouts": (f"[1, {MAX_STEPS}]", ""),
    "train.steps_per_rollout": ("[1, 4096]", ""),
    "train.micro_batch_size": ("[1, 4096]", ""),
    "train.learning_rate": ("[0, 1]", "AdamW's step size; fine-tunes use 1e-6 to 1e-3"),
    "train.lr_warmup_steps": (f"[0, {MAX_STEPS}]", "0: no warm-up"),
    "train.lr_min_ratio": ("[0, 1]", "the cosine floor as a fraction of train.learning_rate"),
    "train.weight_decay": ("[0, 100]", "AdamW's decoupled weight decay"),
    "train.adam_betas": ("[0, 1)", "AdamW's moment decays"),
    "train.adam_eps": ("(0, 1]", "AdamW uses 1e-8"),
    "train.max_grad_norm": ("(0, 1e6]", ""),
    "train.checkpoint_every": (f"[0, {MAX_STEPS}]", "0: only at the end"),
    "train.keep_checkpoints": ("[0, 1e6]", "the last K complete checkpoints are kept, 0 keeps every one"),
    "train.ema_decay": ("[0, 1)", "0 turns the EMA off"),
    "train.guard_window": ("[1, 1000]", "evaluation intervals"),
    "train.guard_margin": ("[0, 1e6]", "the held-out fall that fires the guard, in the reward's units"),
    "train.guard_kl_factor": ("(1, 1000]", "the KL coefficient's multiplier at each firing"),
}
