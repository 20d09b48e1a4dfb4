"""Configuration: nested dataclasses, a YAML recipe, command-line overrides.

    torchrun ... train_grpo.py --config configs/tiny_cpu.yaml --train.learning-rate 3e-5

The recipe file is loaded strictly (an unknown key, a wrong type, or a string where a number
belongs is an error that names the key), then tyro applies the command-line flags on top.
Every field's docstring is its ``--help`` text. The parallel flags keep the seed's names
(``--sequence-parallel-size``, ``--ulysses-degree``, ``--fsdp-attention-backend``,
``--deterministic-mode``) without a section prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
import yaml

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
    log_video_every: int = 0
    """Log sample videos (with prompts and rewards) every N rollouts; 0 turns it off."""
    progress: bool = True
    """Show progress bars on rank 0 when its stderr is a terminal (never in a log file)."""
    collective_timeout_s: float = 600.0
    """A collective that does not complete in this many seconds ends the job (a dead rank)."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """Local diffusers Wan folder (Wan2.1 T2V, Wan2.2 TI2V-5B or A14B). None: the embedded tiny
    model, built on demand under ``tiny_model_dir``."""
    tiny_variant: Literal["two_expert", "single_expert", "i2v", "i2v_two_expert", "ti2v"] = "two_expert"
    """Which embedded tiny model to use when ``path`` is None (``i2v``, ``i2v_two_expert``, ``ti2v``:
    the image-to-video layouts of Wan2.1-I2V, Wan2.2-I2V-A14B and TI2V-5B)."""
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
    the ring kernel when ring > 1. None: cudnn on CUDA where available, else the native default."""
    deterministic_mode: Annotated[bool, _NO_PREFIX] = False
    """torch.use_deterministic_algorithms(True) (and Inductor's deterministic mode for compiled
    blocks): double runs give bitwise identical results."""
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
    """Flow-matching timestep shift (Wan: 3.0 at 480p, 5.0 at 720p)."""
    guidance_scale: float = 4.0
    """CFG scale of the (high-noise) expert; <= 1 turns CFG off."""
    guidance_scale_2: float | None = None
    """CFG scale of the low-noise expert (two-expert models); None: same as guidance_scale."""
    noise_level: float = 0.7
    """SDE noise level a: sigma_t = a * sqrt(sigma / (1 - sigma)) (``sde``), or
    sigma_t = sigma_next * sin(a * pi / 2) with a in (0, 1] (``cps``)."""
    sde_type: Literal["sde", "cps"] = "sde"
    """The stochastic step: ``sde`` (Flow-GRPO's SDE) or ``cps`` (coefficients-preserving sampling,
    arXiv 2509.05952: re-noises the predicted clean sample at exactly the path's noise level; its
    log-prob is flow_grpo's unnormalised one)."""
    timestep_fraction: float = 0.6
    """Fraction of denoising steps that use the SDE (and are trained on) when no window is set."""
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
    tis_cap: float = 2.0
    """With a rollout policy that differs from the trained one (``precision: fp8``): the truncated
    importance weight min(exp(logp_bf16 - logp_rollout), tis_cap) multiplying each sample-step's
    policy loss, whose ratio then uses the bf16 log-probs as old ones. 0: no correction (the old
    log-probs are the rollout's; the drift is still logged). Else >= 1."""


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
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
    pickscore_path: str | None = None
    """Local folder of a PickScore CLIP model (yuvalkirstain/PickScore_v1)."""
    pickscore_processor_path: str | None = None
    """Local folder of its processor (laion/CLIP-ViT-H-14-laion2B-s32B-b79K); None: pickscore_path."""
    num_frames: int = 4
    """Frames sampled uniformly from each video for frame-level rewards."""
    clipscore_path: str | None = None
    """``clipscore``: local folder of a transformers CLIP model + processor (openai/clip-vit-base-patch32)."""
    hps_path: str | None = None
    """``hpsv2``: HPS_v2.1_compressed.pt (xswu/HPSv2), or a folder holding it (an OpenCLIP checkpoint)."""
    hps_processor_path: str | None = None
    """``hpsv2``: local folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its config.json and processor)."""
    aesthetic_clip_path: str | None = None
    """``aesthetic``: local folder of openai/clip-vit-large-patch14 (model + processor)."""
    videoalign_path: str | None = None
    """``videoalign``: local save_pretrained folder of a Qwen2-VL reward model with ``rm_head`` (KwaiVGI/VideoReward)."""
    videoalign_dimension: Literal["overall", "vq", "mq", "ta"] = "overall"
    """``videoalign``: what it returns: standardised visual quality, motion quality, text alignment, or their sum."""
    videoalign_num_frames: int = 8
    """``videoalign``: frames per video fed to Qwen2-VL, sampled uniformly (paired by its temporal patch of 2)."""
    videoalign_max_pixels: int = 448 * 448
    """``videoalign``: frames are resized to a multiple of 28 within this many pixels (smart_resize)."""
    aesthetic_head_path: str | None = None
    """``aesthetic``: sac+logos+ava1-l14-linearMSE.pth (camenduru/improved-aesthetic-predictor), or its folder."""
    remote_url: str | None = None
    """``remote``: base URL of a reward server (start it first: ``python -m miles.rewards.serve``)."""
    remote_rewards: dict[str, float] | None = None
    """``remote``: reward name -> weight the server computes; None: every reward it hosts, weight 1."""
    remote_timeout_s: float = 300.0
    """``remote``: seconds to wait for the answer to one request (the server scores its whole batch)."""
    remote_retries: int = 3
    """``remote``: retries of a request after a connection error, timeout or HTTP 429/5xx."""
    remote_backoff_s: float = 0.5
    """``remote``: wait before the first retry, doubled for each further one."""
    remote_batch_size: int | None = None
    """``remote``: videos per request; None: each scoring call in one request."""
    remote_num_frames: int | None = None
    """``remote``: send only this many frames per video, sampled uniformly (match the server's
    --num-frames to keep frame-sampling rewards exact); None: every frame."""
    vlm_url: str | None = None
    """``vlm_judge``: OpenAI-compatible server (vLLM, SGLang): POST {url}/v1/chat/completions."""
    vlm_model: str | None = None
    """``vlm_judge``: the served model name; None: the only model the server lists."""
    vlm_api_key: str | None = None
    """``vlm_judge``: bearer token; None: $MILES_VLM_API_KEY or $OPENAI_API_KEY (prefer these: the
    config is saved in the run directory)."""
    vlm_question: str | None = None
    """``vlm_judge``: question after the frames, with {prompt} (and {lo}, {hi}, {num_frames});
    None: miles.rewards.vlm_judge.DEFAULT_QUESTION, which asks for a final 'Score: N'."""
    vlm_num_frames: int = 4
    """``vlm_judge``: frames per video sent to the judge, sampled uniformly."""
    vlm_score_range: list[float] = dataclasses.field(default_factory=lambda: [1.0, 5.0])
    """``vlm_judge``: [lo, hi] of the judge's scale; a score s maps to (s - lo) / (hi - lo)."""
    vlm_unparsable: Literal["error", "min"] = "error"
    """``vlm_judge``: an answer without a score in range raises (error) or scores 0 (min); both count it."""
    vlm_timeout_s: float = 120.0
    """``vlm_judge``: seconds to wait for one answer."""
    vlm_retries: int = 3
    """``vlm_judge``: retries of a request after a connection error, timeout or HTTP 429/5xx."""
    vlm_backoff_s: float = 1.0
    """``vlm_judge``: wait before the first retry, doubled for each further one."""
    vlm_concurrency: int = 8
    """``vlm_judge``: requests in flight at once (one video each; the server batches them)."""
    vlm_max_tokens: int = 512
    """``vlm_judge``: the answer's token limit (room for a short reason before the score)."""


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    name: Literal["flow_grpo", "grpo_guard", "diffusion_nft"] = "flow_grpo"
    """The RL algorithm (``miles.algorithms``): what the rollout records and the loss.
    ``flow_grpo``: SDE rollouts with per-step log-probs and the clipped-ratio loss (section ``grpo``).
    ``grpo_guard``: Flow-GRPO with GRPO-Guard's normalised ratio and 1/|dt| step weights (``grpo``;
    needs rollout.sde_type sde). ``diffusion_nft``: ODE rollouts of an old policy and the
    forward-process loss on their clean samples, CFG-free (section ``nft``; advantages from ``grpo``)."""


@dataclasses.dataclass(kw_only=True)
class GRPOConfig:
    clip_range: float = 1e-4
    """PPO ratio clip epsilon (Flow-GRPO uses 1e-4: per-step log-probs are averaged over many dims)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]."""
    global_std: bool = False
    """Normalise advantages by the std over all samples instead of per group."""
    kl_beta: float = 0.0
    """β, the weight of the KL penalty to the reference (initial) policy: loss = policy loss +
    β·KL, KL the exact KL between the current and the reference policy's Gaussian SDE steps,
    mean((μ − μ_ref)²) / (2σ_t²|dt|) per latent element, averaged over the trained steps. flow_grpo's
    SD3 script divides by 2σ_t² (no |dt|): its β is this β / |dt|. 0 turns it off."""
    step_loss_weight: Literal["none", "sigma_over_sqrt_dt"] = "none"
    """Per-SDE-step weight of the policy loss: ``none`` (every step alike, the paper's and flow_grpo's
    SD3 script), or ``sigma_over_sqrt_dt``: sigma_t / sqrt(|dt|) as flow_grpo's Wan script weights it.
    ``grpo_guard`` weights by 1/|dt| itself (leave this ``none``)."""
    train_cfg: bool = True
    """Recompute the log-probs with the rollout's CFG (true), or from the conditional branch alone
    (false: no-CFG training, flow_grpo's ``train.cfg``; roll out with guidance_scale 1 to stay on-policy)."""
    negate_advantages: bool = False
    """Negative control for learning benchmarks: train on the negated advantages (a run that must
    not improve its reward)."""


@dataclasses.dataclass(kw_only=True)
class NFTConfig:
    beta: float = 1.0
    """DiffusionNFT's beta: the implicit policies are v+ = beta*v + (1-beta)*v_old and
    v- = (1+beta)*v_old - beta*v (the reference uses 1.0, and 0.1 for OCR)."""
    timestep_fraction: float = 0.99
    """Train on floor(fraction * rollout.num_steps) of the rollout's noise levels per micro-batch,
    drawn without replacement (the reference: 0.99, i.e. 9 of 10)."""
    old_decay_rate: float = 0.001
    """Old-policy soft update: decay = min(rate * (step - flat), max) after each rollout, 0 before
    ``old_decay_flat`` steps (the reference's decay_type 1: 0.001, 0.5, 0; type 2: 0.0075, 0.999, 75)."""
    old_decay_max: float = 0.5
    """Old-policy soft update: the largest decay (``old_decay_rate``'s cap)."""
    old_decay_flat: int = 0
    """Old-policy soft update: steps before the decay starts (until then the decay is 0: the old
    policy is set to the trained one after each rollout)."""
    kl_beta: float = 0.0
    """β, the weight of the penalty β·mean((v − v_ref)²) on the velocity's distance to the reference
    (initial) policy's; 0 turns it off (the DiffusionNFT reference uses 1e-4 with LoRA)."""


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    prompt_file: str | None = None
    """Held-out prompts (``.txt`` or ``.jsonl``), sampled deterministically and scored by every
    configured reward at the start, every ``every`` rollouts and at the end. None: no evaluation."""
    every: int = 0
    """Evaluate every N rollouts (and at the start and the end); 0: only at the start and the end."""
    num_seeds: int = 2
    """Samples per prompt, with fixed seeds 0..num_seeds-1."""
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
    """AdamW learning rate."""
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
    """Keep the last K checkpoints."""
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
    weight_digest: bool = False
    """Print a sha256 of the full weights after every checkpoint save and load (checks that a resume
    across topologies restores the same bits; gathers every parameter, so off by default)."""


@dataclasses.dataclass(kw_only=True)
class Config:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    nft: NFTConfig = dataclasses.field(default_factory=NFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        validate(self)


class ConfigError(ValueError):
    """A recipe file or flag that cannot be used, with the key it concerns."""


def validate(cfg: Config) -> None:
    """Checks that do not need the world size or the model (those run at startup)."""
    checks = [
        (cfg.data.group_size >= 2, "data.group_size must be >= 2 (GRPO normalises within a group)"),
        (cfg.data.prompts_per_rank >= 1, "data.prompts_per_rank must be >= 1"),
        (cfg.rollout.num_steps >= 2, "rollout.num_steps must be >= 2"),
        ((cfg.rollout.num_frames - 1) % 4 == 0, "rollout.num_frames must be 4k+1 (1, 5, 9, ... 81)"),
        (
            cfg.rollout.height % 16 == 0 and cfg.rollout.width % 16 == 0,
            "rollout.height/width must be multiples of 16",
        ),
        (0.0 < cfg.rollout.timestep_fraction <= 1.0, "rollout.timestep_fraction must be in (0, 1]"),
        (cfg.rollout.noise_level >= 0.0, "rollout.noise_level must be >= 0"),
        (
            cfg.rollout.sde_type != "cps" or cfg.rollout.noise_level <= 1.0,
            "rollout.noise_level must be in (0, 1] with rollout.sde_type cps (sigma_t = sigma_next * sin(a*pi/2))",
        ),
        (len(cfg.rollout.sde_window_range) == 2, "rollout.sde_window_range must be [lo, hi]"),
        (
            cfg.rollout.tis_cap == 0 or cfg.rollout.tis_cap >= 1,
            "rollout.tis_cap must be >= 1 (the truncation cap of the importance weight; 2 is usual) or 0 (no correction)",
        ),
        (
            cfg.rollout.precision == "bf16" or cfg.algorithm.name != "grpo_guard",
            "rollout.precision fp8 corrects Flow-GRPO's plain ratio; GRPO-Guard's normalised ratio would need "
            "the bf16 policy's old means: use algorithm.name flow_grpo or rollout.precision bf16",
        ),
        (cfg.train.num_rollouts >= 1, "train.num_rollouts must be >= 1"),
        (cfg.eval.every >= 0, "eval.every must be >= 0 (0: only at the start and the end)"),
        (cfg.eval.num_seeds >= 1, "eval.num_seeds must be >= 1"),
        (cfg.eval.num_steps is None or cfg.eval.num_steps >= 1, "eval.num_steps must be >= 1"),
        (cfg.train.steps_per_rollout >= 1, "train.steps_per_rollout must be >= 1"),
        (cfg.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
        (0.0 <= cfg.train.ema_decay < 1.0, "train.ema_decay must be in [0, 1) (0 turns the EMA off)"),
        (
            not (cfg.train.overwrite and cfg.train.resume),
            "--train.overwrite deletes the previous run: it needs --train.no-resume",
        ),
        (len(cfg.train.adam_betas) == 2, "train.adam_betas must have two values"),
        (cfg.model.lora_rank >= 0, "model.lora_rank must be >= 0"),
        (cfg.grpo.clip_range > 0, "grpo.clip_range must be > 0 (Flow-GRPO uses 1e-4)"),
        (cfg.grpo.kl_beta >= 0, "grpo.kl_beta must be >= 0 (0 turns the KL term off)"),
        (cfg.grpo.adv_clip_max > 0, "grpo.adv_clip_max must be > 0"),
        (cfg.train.learning_rate >= 0, "train.learning_rate must be >= 0 (AdamW's step size)"),
        (cfg.train.max_grad_norm > 0, "train.max_grad_norm must be > 0"),
        (cfg.nft.beta > 0, "nft.beta must be > 0 (the reference uses 1.0)"),
        (0.0 < cfg.nft.timestep_fraction <= 1.0, "nft.timestep_fraction must be in (0, 1]"),
        (cfg.nft.old_decay_rate >= 0, "nft.old_decay_rate must be >= 0"),
        (0.0 <= cfg.nft.old_decay_max < 1.0, "nft.old_decay_max must be in [0, 1)"),
        (cfg.nft.old_decay_flat >= 0, "nft.old_decay_flat must be >= 0"),
        (cfg.nft.kl_beta >= 0, "nft.kl_beta must be >= 0 (0 turns the KL term off)"),
        (
            cfg.algorithm.name != "grpo_guard" or cfg.rollout.sde_type == "sde",
            "algorithm.name grpo_guard normalises the ratio of Flow-GRPO's SDE: set rollout.sde_type sde",
        ),
        (
            cfg.algorithm.name != "grpo_guard" or cfg.grpo.step_loss_weight == "none",
            "algorithm.name grpo_guard weights every SDE step by 1/|dt| itself: set grpo.step_loss_weight none",
        ),
        (cfg.parallel.sequence_parallel_size >= 1, "--sequence-parallel-size must be >= 1"),
        (cfg.parallel.ulysses_degree >= 0, "--ulysses-degree must be >= 0 (0 picks it automatically)"),
        (cfg.parallel.replicate_size >= 1, "--parallel.replicate-size must be >= 1 (1: plain FSDP, no HSDP)"),
        (bool(cfg.reward.weights), "reward.weights must name at least one reward"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    samples = cfg.data.prompts_per_rank * cfg.data.group_size
    per_step = samples // cfg.train.steps_per_rollout
    if samples % cfg.train.steps_per_rollout or per_step % cfg.train.micro_batch_size:
        raise ConfigError(
            f"data.prompts_per_rank * data.group_size = {samples} samples per rank must split into "
            f"train.steps_per_rollout = {cfg.train.steps_per_rollout} optimizer steps of whole "
            f"micro-batches of train.micro_batch_size = {cfg.train.micro_batch_size}"
        )
    for name, weight in cfg.reward.weights.items():
        if not math.isfinite(weight):
            raise ConfigError(f"reward.weights.{name} must be a finite number, got {weight}")
    from miles.rewards.shaping import check_gold, check_normalize  # light: torch only

    try:
        check_normalize(cfg.reward.normalize, cfg.reward.weights)
        check_gold(cfg.reward.gold, cfg.reward.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but most likely a mistake (the entry point prints them once)."""
    found = []
    if cfg.train.learning_rate == 0:
        found.append("learning rate 0: the weights will not change (train.learning_rate)")
    if cfg.reward.gold and not cfg.eval.prompt_file:
        found.append(
            "reward.gold is scored in evaluation only, and eval.prompt_file is unset: it is never scored"
        )
    return found


def check_reward_names(cfg: Config) -> None:
    """Every name in ``reward.weights`` is a registered reward (imports the reward registry)."""
    from miles.rewards import registered_rewards

    known = registered_rewards()
    for name in cfg.reward.weights:
        if name not in known:
            raise ConfigError(
                f"reward.weights names an unknown reward {name!r}; registered rewards: {known} "
                "(set one with --reward.weights.NAME WEIGHT)"
            )
    for name in cfg.reward.gold:
        if name not in known:
            raise ConfigError(f"reward.gold names an unknown reward {name!r}; registered rewards: {known}")


# ---------------------------------------------------------------------------------------------
# Strict YAML loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` where lossless (int -> float), else raise naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return _check_value(key, value, args[0])
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return {
            _check_value(key, k, args[0]): _check_value(f"{key}.{k}", v, args[1]) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                hint = " (YAML reads a number like 3e-5 as a string: write 3.0e-5)"
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}{hint}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {_type_name(tp)} at {key}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}'; valid keys here: {sorted(fields)}")
        kwargs[name] = _check_value(key, value, hints[name])
    if cls is Config:
        # Section defaults are filled in first so that validation sees the whole config.
        return cls(**{n: kwargs.get(n, fields[n].default_factory()) for n in fields})
    return cls(**kwargs)


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """``FILE:LINE:COLUMN: not valid YAML (what the parser says)``, 1-based as editors count."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = "; ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p) or str(e)
    return f"{where}: not valid YAML ({what})"


def load_config_file(path: str | Path) -> Config:
    """Load a YAML recipe strictly into a :class:`Config`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte offset {e.start}); save the recipe as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return _build(Config, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


_LAUNCHER_HELP = """miles: GRPO fine-tuning of Wan video transformers with sequence parallelism.

Launcher options (read before the configuration options below):
  --config FILE    YAML recipe; the flags below override its values
  --dry-run        check every input the run would refuse and print its plan (mesh, SP plan,
                   memory per rank), then exit: no GPU, no weights, no torch.distributed
  --world-size N   with --dry-run: the world size to plan for (a real run takes it from torchrun)
"""

_REWARD_WEIGHT_FLAG = "--reward.weights."


def _pop_reward_weights(args: list[str]) -> tuple[list[str], dict[str, float]]:
    """Take every ``--reward.weights.NAME W`` (or ``...NAME=W``) out of ``args``.

    tyro turns ``reward.weights`` into one flag per key of the recipe's mapping, so it cannot add
    a reward; these flags are therefore applied to the recipe before tyro parses the rest.
    """
    rest, weights = [], {}
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith(_REWARD_WEIGHT_FLAG):
            rest.append(arg)
            continue
        flag, has_value, value = arg.partition("=")
        if not has_value:
            if i == len(args):
                raise ConfigError(f"{flag} needs a weight, e.g. {flag} 1.0")
            value, i = args[i], i + 1
        name = flag.removeprefix(_REWARD_WEIGHT_FLAG).replace("-", "_")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ConfigError(f"{flag}: expected a number, got {value!r}") from None
    return rest, weights


def _cli_registry(reward_names: list[str]) -> tyro.constructors.ConstructorRegistry:
    """tyro rules: the ``reward.weights`` help lists the registered rewards (a docstring cannot)."""
    # tyro's own rule for dataclasses; a private module, but tyro is pinned (pyproject.toml).
    from tyro.constructors._struct_spec_dataclass import dataclass_rule

    registry = tyro.constructors.ConstructorRegistry()

    @registry.struct_rule
    def reward_weights_help(info: tyro.constructors.StructTypeInfo) -> Any:
        if info.type is not RewardConfig:
            return None
        spec = dataclass_rule(info)
        fields = []
        for field in spec.fields:
            if field.name == "weights":
                doc = field.helptext() if callable(field.helptext) else field.helptext
                extra = (
                    f"Registered rewards: {', '.join(reward_names)}. Set or add one with "
                    "--reward.weights.NAME WEIGHT (a weight of 0 scores and logs a reward without training on it)."
                )
                field = dataclasses.replace(field, helptext=f"{doc or ''} {extra}".strip())
            fields.append(field)
        return dataclasses.replace(spec, fields=tuple(fields))

    return registry


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """``--config FILE`` plus tyro overrides; returns the config and the launcher-level options."""
    from miles.rewards import registered_rewards

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--dry-run", action="store_true")
    pre.add_argument("--world-size", type=int, default=None)
    opts, rest = pre.parse_known_args(argv)
    default = load_config_file(opts.config) if opts.config else Config()
    rest, weights = _pop_reward_weights(rest)
    if weights:
        reward = dataclasses.replace(default.reward, weights={**default.reward.weights, **weights})
        default = dataclasses.replace(default, reward=reward)
    registry = _cli_registry(registered_rewards())
    try:
        cfg = tyro.cli(Config, default=default, args=rest, description=_LAUNCHER_HELP, registry=registry)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_reward_names(cfg)
    return cfg, opts
