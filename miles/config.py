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
import contextvars
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
import yaml

from miles.rewards import reward_option_classes  # the rewards register themselves and their options

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
    """Flow-matching timestep shift (Wan: 3.0 at 480p, 5.0 at 720p)."""
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
    tis_cap: float = 2.0
    """With a rollout policy that differs from the trained one (``precision: fp8``): the truncated
    importance weight min(exp(logp_bf16 - logp_rollout), tis_cap) multiplying each sample-step's
    policy loss, whose ratio then uses the bf16 log-probs as old ones. 0: no correction (the old
    log-probs are the rollout's; the drift is still logged). Else >= 1."""
    overlap_decode: bool = False
    """Decode each micro-batch's videos as soon as they are sampled, on a worker thread and a side
    CUDA stream, while the transformer samples the next micro-batch; the frames wait in pinned host
    memory until scored. The numbers are bitwise those of decoding after the rollout; the VAE's
    decode workspace then counts beside the rollout's in the memory plan. On CPU each micro-batch
    is decoded right after it is sampled (nothing to overlap). On one H200 at the Wan2.1-1.3B shape it
    hid no time (the transformer keeps the GPU busy: BENCHMARKS.md, run D), hence off by default."""


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


def _reward_config_class() -> type:
    """``RewardConfig``: the mix (:class:`RewardMixConfig`), then one section per registered reward
    that has options, ``reward.NAME`` (e.g. ``reward.pickscore.model_path``), of the options
    dataclass declared in the reward's own file (``miles.rewards.registry``): a new reward and its
    options never touch this file."""
    sections = reward_option_classes()
    clash = sorted(set(sections) & {f.name for f in dataclasses.fields(RewardMixConfig)})
    assert not clash, f"rewards named like a reward.* field: {clash}"
    fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections.items()]
    cls = dataclasses.make_dataclass("RewardConfig", fields, bases=(RewardMixConfig,), kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = RewardMixConfig.__doc__
    return cls


RewardConfig = _reward_config_class()


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    name: Literal["flow_grpo", "grpo_guard", "diffusion_nft", "awm", "dgpo", "online_dpo", "sft"] = (
        "flow_grpo"
    )
    """The RL algorithm (``miles.algorithms``): what the rollout records and the loss.
    ``flow_grpo``: SDE rollouts with per-step log-probs and the clipped-ratio loss (section ``grpo``).
    ``grpo_guard``: Flow-GRPO with GRPO-Guard's normalised ratio and 1/|dt| step weights (``grpo``;
    needs rollout.sde_type sde). ``diffusion_nft``: ODE rollouts of an old policy and the
    forward-process loss on their clean samples, CFG-free (section ``nft``; advantages from ``grpo``).
    ``awm``: Advantage Weighted Matching — ODE rollouts, the pretraining flow-matching loss on their
    clean samples weighted by the group advantage (section ``awm``). ``dgpo``: Direct Group Preference
    Optimization — ODE rollouts, a group-level preference loss on the flow-matching errors (section
    ``dgpo``). ``online_dpo``: Diffusion-DPO on pairs drawn from each group of ODE rollouts (section
    ``dpo``).
    ``sft``: supervised flow matching on the videos of data.prompt_file, a JSONL of {"video", "prompt"}
    (section ``sft``; no rollouts, no rewards in training)."""


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
    mean((μ − μ_ref)²) / (2σ_t²|dt|) per latent element, averaged over the trained steps (as
    flow_grpo's Wan script computes it). flow_grpo's SD3 script divides by 2σ_t² (no |dt|): its β
    is this β / |dt|. 0 turns it off."""
    step_loss_weight: Literal["none", "sigma_over_sqrt_dt"] = "none"
    """Per-SDE-step weight of the policy loss: ``none`` (every step alike, the paper's and flow_grpo's
    SD3 script), or ``sigma_over_sqrt_dt``: sigma_t / sqrt(|dt|) with sigma_t the chosen SDE's noise
    scale. With rollout.sde_type flow_grpo_wan this is flow_grpo's Wan-script weight exactly; with
    ``sde`` it puts that form on the SD3 noise (no flow_grpo script does). ``grpo_guard`` weights by
    1/|dt| itself (leave this ``none``)."""
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
class AWMConfig:
    num_levels: int = 4
    """Noise levels each sample is trained at per optimizer step, drawn without replacement from the
    first floor(timestep_fraction * rollout.num_steps) levels of the rollout's grid (the reference's
    ``train_timesteps``: 6 of 14)."""
    timestep_fraction: float = 0.9
    """The levels are drawn from the first floor(fraction * rollout.num_steps) of the rollout's noise
    levels (the reference: 0.9)."""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """The matching term's weighting w(σ, e) of the per-sample flow-matching error e: ``uniform`` e,
    ``t`` σ·e, ``t2`` σ²·e, ``huber`` σ·(√e − 1e-5), ``ghuber`` σ·(e^p − ε^p)/p with p = ghuber_power
    (the reference's PickScore recipe)."""
    ghuber_power: float = 0.25
    """p of the ``ghuber`` weighting."""
    advantage_max: float = 1.0
    """The clipped advantage is rescaled to [-advantage_max, advantage_max] (A · advantage_max /
    grpo.adv_clip_max, the reference's ``advantage_max``); 0 keeps it unscaled."""
    kl_beta: float = 1e-4
    """β, the weight of mean((v − v_ref)²) to the reference (initial) policy; 0 turns it off."""
    ema_kl_beta: float = 1.0
    """The weight of mean((v − v_ema)²) to a lagging copy of the weights (the reference's ``ema_beta``);
    0 turns it off and keeps no copy."""
    ema_decay_rate: float = 0.001
    """The lagging copy moves towards the trained weights after each rollout with decay
    min(rate · step, ema_decay_max) (the reference's ``linear`` schedule: 0.001, 0.3)."""
    ema_decay_max: float = 0.3
    """The lagging copy's largest decay."""


@dataclasses.dataclass(kw_only=True)
class DGPOConfig:
    num_levels: int = 4
    """Noise levels trained per optimizer step, the same for every sample (the reference's
    ``num_train_timesteps``)."""
    timestep_fraction: float = 0.7
    """The levels are drawn without replacement from the first floor(fraction * rollout.num_steps) of
    the rollout's noise levels (the reference's ``trunc_steps`` 6 of 10 steps: 0.7)."""
    beta_dpo: float = 100.0
    """β of the group preference: each group's weight is sigmoid(β · Σ_i A_i (e_i − e_ref,i) / n)
    over its n samples in the step (the reference: 10–100; 2000–5000 with ``ema_reference``)."""
    kl_beta: float = 1e-3
    """The weight of mean((v − v_ref)²) to the reference policy (the reference's ``train.beta``); 0:
    off."""
    reference_guidance_scale: float = 1.0
    """CFG scale of the frozen reference's velocity (the reference's ``kl_cfg``). 1: no CFG (the
    "rollout with CFG, train without" mode, rollout.guidance_scale > 1); > 1 (e.g. 4.5) with
    rollout.guidance_scale 1 is the fully CFG-free mode: the trained conditional branch is pulled to
    the reference's guided velocity."""
    clip_range: float = 1e-3
    """PPO-style clip on the matching term: a sample whose ratio exp(e_old − e) leaves [1 − c, 1 + c]
    on its advantage's side is not trained (the reference's ``clip_dsm``); 0 turns the clip off and
    keeps no lagging copy (unless ``ema_reference``)."""
    ema_reference: bool = False
    """The preference compares against the lagging copy instead of the frozen reference (the
    reference's ``use_ema_ref``, TDM-R1)."""
    shared_noise: bool = True
    """All samples of a group are noised with the same forward-process noise at a level."""
    old_decay_rate: float = 0.001
    """The lagging copy moves towards the trained weights after each rollout with decay
    min(rate · step, old_decay_max) (the reference: 0.001, 0.3)."""
    old_decay_max: float = 0.3
    """The lagging copy's largest decay."""


@dataclasses.dataclass(kw_only=True)
class DPOConfig:
    beta: float = 100.0
    """β of Diffusion-DPO: loss −log σ(−β/2 · ((e_w − e_w,ref) − (e_l − e_l,ref))) per pair and level
    (flow_grpo's SD3 recipe: 100)."""
    pairs: Literal["best_worst", "margin"] = "best_worst"
    """Pair selection within each group's samples of an optimizer step: ``best_worst`` (the highest
    against the lowest advantage, flow_grpo's online DPO), or ``margin``: every pair whose rewards
    differ by more than ``reward_margin``."""
    reward_margin: float = 0.0
    """A pair is trained only if its two rewards differ by more than this (both pair modes)."""
    num_levels: int = 4
    """Noise levels trained per optimizer step, the same for every sample; both members of a pair are
    noised with the same noise."""
    timestep_fraction: float = 0.9
    """The levels are drawn without replacement from the first floor(fraction * rollout.num_steps) of
    the rollout's noise levels."""
    ref_update_every: int = 0
    """The reference policy: 0 keeps the initial weights (offline-style DPO); N > 0 sets it to the
    trained weights every N rollouts (flow_grpo's ``ref_update_step``: online DPO)."""


@dataclasses.dataclass(kw_only=True)
class SFTConfig:
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    """How ``algorithm.name sft`` draws each sample's noise level before the shift: ``uniform`` u ~ U(0, 1),
    or ``logit_normal`` u = sigmoid(logit_mean + logit_std * N(0, 1)) (SD3); then sigma = shift*u / (1 + (shift - 1)*u)."""
    shift: float | None = None
    """The time shift applied to u (Wan: 3.0 at 480p, 5.0 at 720p); None: rollout.shift; 1: none."""
    logit_mean: float = 0.0
    """``logit_normal``: the mean of the normal before the sigmoid."""
    logit_std: float = 1.0
    """``logit_normal``: its standard deviation."""
    caption_dropout: float = 0.0
    """Fraction of samples trained on the negative prompt's embedding instead of their caption (keeps
    the unconditional branch that CFG needs; Wan-style fine-tunes use about 0.1)."""
    cache_latents: bool = True
    """Keep each video's VAE latents under ``<run>/sft_latents`` (encoded once; resumes and later epochs
    read them back). False encodes every video each time it is drawn."""


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
    awm: AWMConfig = dataclasses.field(default_factory=AWMConfig)
    dgpo: DGPOConfig = dataclasses.field(default_factory=DGPOConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if not _DEFER_VALIDATION.get():
            validate(self)


# Set while tyro builds a Config from the command line: tyro would print a validation error in its
# own box and exit; parse_args validates afterwards instead, so every refusal reads alike.
_DEFER_VALIDATION: contextvars.ContextVar[bool] = contextvars.ContextVar("defer_validation", default=False)


class ConfigError(ValueError):
    """A recipe file or flag that cannot be used, with the key it concerns."""


# Every numeric field's range: dotted key -> (rule, why). A rule is an interval "[a, b)" / "(a, b]" /
# "[a, b]" / "(a, b)", bounded on both sides: the values a real run can use (a setting of 1e30 ends
# far from its cause: an overflow, a huge allocation, a non-finite loss). Every number must also be
# finite (NaN and inf are refused everywhere). A list's items and a mapping's values each follow their
# field's rule; None (an optional field left unset) is not checked. tests/unit/test_config_ranges.py
# fails when a numeric field has no row, or a row lets a huge value through, so a new field cannot
# skip its check.
MAX_STEPS = "1e7"  # rollouts, optimizer steps, intervals counted in them
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
    "rollout.height": ("(0, 8192]", "pixels, a multiple of 16"),
    "rollout.width": ("(0, 8192]", "pixels, a multiple of 16"),
    "rollout.num_steps": ("[2, 1000]", "the scheduler has 1000 timesteps"),
    "rollout.shift": ("(0, 100]", "Wan uses 3.0 at 480p, 5.0 at 720p"),
    "rollout.guidance_scale": ("[0, 100]", "<= 1 turns CFG off; Wan uses 5"),
    "rollout.guidance_scale_2": ("[0, 100]", "<= 1 turns CFG off; Wan uses 5"),
    "rollout.noise_level": ("[0, 10]", "Flow-GRPO uses 0.7"),
    "rollout.timestep_fraction": ("(0, 1]", ""),
    "rollout.sde_window_size": ("[0, 1000]", "0: no window"),
    "rollout.sde_window_range": ("[0, 1000]", "[lo, hi) of denoising step indices"),
    "reward.weights": ("[-1000, 1000]", "a weight of the reward mix"),
    "reward.num_frames": ("[1, 4097]", "frames sampled from each video for frame-level rewards"),
    "grpo.clip_range": ("(0, 100]", "Flow-GRPO uses 1e-4"),
    "grpo.adv_clip_max": ("(0, 1000]", ""),
    "grpo.kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    "nft.beta": ("(0, 100]", "the reference uses 1.0"),
    "nft.timestep_fraction": ("(0, 1]", ""),
    "nft.old_decay_rate": ("[0, 1]", ""),
    "nft.old_decay_max": ("[0, 1)", ""),
    "nft.old_decay_flat": (f"[0, {MAX_STEPS}]", ""),
    "nft.kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    "rollout.tis_cap": ("[0, 1000]", "0: no correction; otherwise >= 1, 2 is usual"),
    "awm.num_levels": ("[1, 1000]", ""),
    "awm.timestep_fraction": ("(0, 1]", ""),
    "awm.ghuber_power": ("(0, 10]", "the reference uses 0.25"),
    "awm.advantage_max": ("[0, 1000]", "0 keeps the advantage unscaled"),
    "awm.kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    "awm.ema_kl_beta": ("[0, 1e6]", "0 turns the EMA term off"),
    "awm.ema_decay_rate": ("[0, 1]", ""),
    "awm.ema_decay_max": ("[0, 1)", ""),
    "dgpo.num_levels": ("[1, 1000]", ""),
    "dgpo.timestep_fraction": ("(0, 1]", ""),
    "dgpo.beta_dpo": ("(0, 1e6]", "the reference uses 10-100, 2000-5000 with ema_reference"),
    "dgpo.kl_beta": ("[0, 1e6]", "0 turns the KL term off"),
    "dgpo.reference_guidance_scale": ("[1, 100]", "1: the reference without CFG"),
    "dgpo.clip_range": ("[0, 100]", "0 turns the clip off"),
    "dgpo.old_decay_rate": ("[0, 1]", ""),
    "dgpo.old_decay_max": ("[0, 1)", ""),
    "dpo.beta": ("(0, 1e6]", "flow_grpo's SD3 recipe uses 100"),
    "dpo.reward_margin": ("[0, 1e6]", ""),
    "dpo.num_levels": ("[1, 1000]", ""),
    "dpo.timestep_fraction": ("(0, 1]", ""),
    "dpo.ref_update_every": (f"[0, {MAX_STEPS}]", "0 keeps the initial weights as the reference"),
    "sft.shift": ("(0, 100]", "1: no shift; unset: rollout.shift"),
    "sft.logit_mean": ("[-10, 10]", "SD3 uses 0"),
    "sft.logit_std": ("(0, 10]", "SD3 uses 1"),
    "sft.caption_dropout": ("[0, 1)", ""),
    "eval.every": (f"[0, {MAX_STEPS}]", "0: only at the start and the end"),
    "eval.num_seeds": ("[1, 1000]", ""),
    "eval.num_steps": ("[1, 1000]", "the scheduler has 1000 timesteps"),
    "train.num_rollouts": (f"[1, {MAX_STEPS}]", ""),
    "train.steps_per_rollout": ("[1, 4096]", ""),
    "train.micro_batch_size": ("[1, 4096]", ""),
    "train.learning_rate": ("[0, 1]", "AdamW's step size; fine-tunes use 1e-6 to 1e-3"),
    "train.weight_decay": ("[0, 100]", "AdamW's decoupled weight decay"),
    "train.adam_betas": ("[0, 1)", "AdamW's moment decays"),
    "train.adam_eps": ("(0, 1]", "AdamW uses 1e-8"),
    "train.max_grad_norm": ("(0, 1e6]", ""),
    "train.checkpoint_every": (f"[0, {MAX_STEPS}]", "0: only at the end"),
    "train.keep_checkpoints": ("[0, 1e6]", "the last K complete checkpoints are kept, 0 keeps every one"),
    "train.ema_decay": ("[0, 1)", "0 turns the EMA off"),
}
# Each reward's options declare their own ranges (their class's RANGES, keyed by field).
RANGES.update(
    {
        f"reward.{name}.{key}": rule
        for name, options in reward_option_classes().items()
        for key, rule in getattr(options, "RANGES", {}).items()
    }
)


def _interval(rule: str) -> tuple[float, float, bool, bool]:
    """(lo, hi, lo included, hi included) of a RANGES rule "[a, b)" and the like."""
    assert rule[0] in "[(" and rule[-1] in "])", (
        f"a range must be an interval bounded on both sides: {rule!r}"
    )
    lo, hi = (float(x) for x in rule[1:-1].split(","))
    return lo, hi, rule[0] == "[", rule[-1] == "]"


for _rule, _ in RANGES.values():
    _interval(_rule)  # each rule parses at import, not when a value first meets it


def _satisfies(value: float, rule: str) -> bool:
    lo, hi, lo_in, hi_in = _interval(rule)
    above = value >= lo if lo_in else value > lo
    below = value <= hi if hi_in else value < hi
    return above and below


def numeric_fields(node: Any, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, the key as the message names it, value) of every number in the config ``node``:
    fields, list items (``key[i]``) and mapping values (``key.NAME``)."""
    found = []
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += numeric_fields(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            found += [(key, f"{key}[{i}]", v) for i, v in enumerate(value) if _is_number(v)]
        elif isinstance(value, dict):
            found += [(key, f"{key}.{k}", v) for k, v in value.items() if _is_number(v)]
        elif _is_number(value):
            found.append((key, key, value))
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ranges(cfg: Config) -> None:
    """Every number finite and within its field's :data:`RANGES` rule (``ConfigError`` naming it)."""
    for key, name, value in numeric_fields(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        rule, why = RANGES[key]
        if not _satisfies(value, rule):
            raise ConfigError(_range_message(name, value, rule, why))


def _range_message(name: str, value: float, rule: str, why: str) -> str:
    """``KEY must be > 0 (why), got V; its range is (0, 8192]``: the side that failed, then the range."""
    lo, hi, lo_in, hi_in = _interval(rule)
    lo_text, hi_text = (x.strip() for x in rule[1:-1].split(","))
    if value < lo or (value == lo and not lo_in):
        side = f">= {lo_text}" if lo_in else f"> {lo_text}"
    else:
        side = f"<= {hi_text}" if hi_in else f"< {hi_text}"
    return (
        f"{name} must be {side}"
        + (f" ({why})" if why else "")
        + f", got {_shown(value)}; its range is {rule}"
    )


def check_run_name(run: RunConfig) -> None:
    """``run.name`` must keep the run directory inside ``run.output_dir``."""
    parts = Path(run.name).parts
    if not run.name.strip() or Path(run.name).is_absolute() or ".." in parts or "\0" in run.name or not parts:
        raise ConfigError(
            f"run.name {run.name!r} would put the run directory outside run.output_dir {run.output_dir!r} "
            "(or nowhere): use a plain folder name such as my_run (subfolders a/b are fine; no '..', no "
            "absolute path); set the parent folder with --run.output-dir"
        )


def check_reward_signal(reward: RewardConfig) -> None:
    """A reward set whose weights are all 0 trains on a constant reward: no advantage, no gradient."""
    weights = list(reward.weights.values())
    remote = getattr(reward, "remote", None)
    if "remote" in reward.weights and remote is not None and remote.rewards:
        weights = [w * reward.weights["remote"] for w in remote.rewards.values()] + [
            w for n, w in reward.weights.items() if n != "remote"
        ]
    if weights and not any(weights):
        raise ConfigError(
            f"every reward weight is 0 (reward.weights {dict(reward.weights)}): the trained reward would be 0 "
            "for every sample, so no advantage and no gradient. Give the reward to train on a non-zero "
            "weight (--reward.weights.NAME 1.0); a weight of 0 only logs a reward beside a trained one"
        )


def check_reward_options(reward: RewardConfig) -> None:
    """Each reward section's own checks (its options class's ``check()``, if any), every section alike."""
    for name in reward_option_classes():
        check = getattr(getattr(reward, name), "check", None)
        if check is not None:
            try:
                check()
            except ValueError as e:
                raise ConfigError(str(e)) from None


def validate(cfg: Config) -> None:
    """Checks that do not need the world size or the model (those run at startup)."""
    check_ranges(cfg)
    check_run_name(cfg.run)
    checks = [
        ((cfg.rollout.num_frames - 1) % 4 == 0, "rollout.num_frames must be 4k+1 (1, 5, 9, ... 81)"),
        (
            cfg.rollout.height % 16 == 0 and cfg.rollout.width % 16 == 0,
            "rollout.height/width must be multiples of 16",
        ),
        (
            cfg.rollout.noise_level > 0 or cfg.algorithm.name not in ("flow_grpo", "grpo_guard"),
            f"rollout.noise_level must be > 0 with algorithm.name {cfg.algorithm.name} (its SDE steps' "
            f"log-probabilities divide by the noise), got {cfg.rollout.noise_level!r}",
        ),
        (
            cfg.rollout.sde_type != "flow_grpo_wan"
            or cfg.rollout.sde_window_size > 0
            or math.floor(round(cfg.rollout.timestep_fraction * cfg.rollout.num_steps, 9)) >= 1,
            f"rollout.sde_type flow_grpo_wan trains floor(rollout.timestep_fraction * rollout.num_steps) "
            f"= floor({cfg.rollout.timestep_fraction} * {cfg.rollout.num_steps}) = 0 steps: raise "
            f"rollout.timestep_fraction to at least 1 / num_steps (its Wan recipe uses 0.99)",
        ),
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
        (
            not (cfg.train.overwrite and cfg.train.resume),
            "--train.overwrite deletes the previous run: it needs --train.no-resume",
        ),
        (len(cfg.train.adam_betas) == 2, "train.adam_betas must have two values"),
        (
            cfg.train.learning_rate * cfg.train.weight_decay < 1,
            f"train.learning_rate * train.weight_decay = {cfg.train.learning_rate * cfg.train.weight_decay:g}: "
            "AdamW multiplies every weight by 1 - lr * weight_decay each step, so >= 1 zeroes (or flips) "
            "them all; fine-tunes use a weight decay of 0 to 0.1",
        ),
        (
            cfg.algorithm.name != "sft" or (cfg.data.prompt_file or "").endswith(".jsonl"),
            'algorithm.name sft trains on data.prompt_file: set it to a .jsonl of {"video": ..., "prompt": ...}',
        ),
        (
            cfg.algorithm.name != "grpo_guard" or cfg.rollout.sde_type == "sde",
            "algorithm.name grpo_guard normalises the ratio of Flow-GRPO's SDE: set rollout.sde_type sde",
        ),
        (
            cfg.algorithm.name != "grpo_guard" or cfg.grpo.step_loss_weight == "none",
            "algorithm.name grpo_guard weights every SDE step by 1/|dt| itself: set grpo.step_loss_weight none",
        ),
        (bool(cfg.reward.weights), "reward.weights must name at least one reward"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_reward_signal(cfg.reward)
    check_reward_options(cfg.reward)
    samples = cfg.data.prompts_per_rank * cfg.data.group_size
    per_step = samples // cfg.train.steps_per_rollout
    if samples % cfg.train.steps_per_rollout or per_step % cfg.train.micro_batch_size:
        raise ConfigError(
            f"data.prompts_per_rank * data.group_size = {samples} samples per rank must split into "
            f"train.steps_per_rollout = {cfg.train.steps_per_rollout} optimizer steps of whole "
            f"micro-batches of train.micro_batch_size = {cfg.train.micro_batch_size}"
        )
    from miles.rewards.shaping import check_gold, check_normalize  # light: torch only

    try:
        check_normalize(cfg.reward.normalize, cfg.reward.weights)
        check_gold(cfg.reward.gold, cfg.reward.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# The sections only one algorithm reads: their settings change nothing under another algorithm.
ALGORITHM_SECTIONS = {"nft": "diffusion_nft", "awm": "awm", "dgpo": "dgpo", "dpo": "online_dpo", "sft": "sft"}


def _changed(section: Any, names: list[str] | None = None) -> list[str]:
    """The fields of a config section set to other than their default."""
    default = type(section)()
    fields = names or [f.name for f in dataclasses.fields(section)]
    return [n for n in fields if getattr(section, n) != getattr(default, n)]


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but most likely a mistake (the entry point prints them once): an
    update that changes nothing, an option that the chosen setting never reads."""
    found = []
    if cfg.train.learning_rate == 0:
        found.append("learning rate 0: the weights will not change (train.learning_rate)")
    if cfg.reward.gold and not cfg.eval.prompt_file:
        found.append(
            "reward.gold is scored in evaluation only, and eval.prompt_file is unset: it is never scored"
        )
    unused = [
        (f"{section}.{n}", f"algorithm.name is {cfg.algorithm.name}; only {name} reads the {section} section")
        for section, name in ALGORITHM_SECTIONS.items()
        if cfg.algorithm.name != name
        for n in _changed(getattr(cfg, section))
    ]
    if cfg.model.lora_rank == 0:
        why = "model.lora_rank is 0 (a full fine-tune)"
        unused += [(f"model.{n}", why) for n in _changed(cfg.model, ["lora_alpha", "lora_target_modules"])]
    if cfg.rollout.sde_window_size == 0:
        why = "rollout.sde_window_size is 0 (no window)"
        unused += [(f"rollout.{n}", why) for n in _changed(cfg.rollout, ["sde_window_range"])]
    if cfg.rollout.precision == "bf16":
        why = "rollout.precision is bf16 (no drift to correct)"
        unused += [(f"rollout.{n}", why) for n in _changed(cfg.rollout, ["tis_cap"])]
    scored = {*cfg.reward.weights, *cfg.reward.gold}
    for name in reward_option_classes():
        if name not in scored:
            why = f"{name} is in neither reward.weights nor reward.gold"
            unused += [(f"reward.{name}.{n}", why) for n in _changed(getattr(cfg.reward, name))]
    found += [f"{key} is set but never read: {why}" for key, why in unused]
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
            raise ConfigError(f"{key}: {_shown(value)} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {_shown(value)}")
        return [_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {_shown(value)}")
        return {
            _check_value(key, k, args[0]): _check_value(f"{key}.{k}", v, args[1]) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key}: expected a section (mapping), got {type(value).__name__} {_shown(value)}"
            )
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                hint = " (YAML reads a number like 3e-5 as a string: write 3.0e-5)"
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {_shown(value)}{hint}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {_shown(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {_shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {_shown(value)}")
        return value
    raise AssertionError(f"unsupported config type {_type_name(tp)} at {key}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            hint = ""
            if prefix == "reward":  # the flat options before each reward had its section
                hint = " (a reward's options sit in its own section: reward.NAME.OPTION, e.g. reward.pickscore.model_path)"
            raise ConfigError(f"unknown config key '{key}'; valid keys here: {sorted(fields)}{hint}")
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


RECIPE_MAX_BYTES = 1 << 20
"""A recipe is a few KB; a larger file is not one (and a YAML parser's time grows with it)."""
RECIPE_MAX_DEPTH = 16
"""Nesting levels a recipe may use (its deepest field, ``reward.NAME.OPTION[i]``, is 4)."""


def _mark(node_or_event: Any) -> str:
    mark = node_or_event.start_mark
    return f"{mark.name}:{mark.line + 1}:{mark.column + 1}"


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader for what a user can write into a recipe: refuses a key given twice in one
    mapping (PyYAML keeps the last), a key that is not a name (a list, a number), aliases (``*x``:
    a few lines of them expand into billions of values) and nesting deeper than
    :data:`RECIPE_MAX_DEPTH` (PyYAML's composer recurses: Python's stack would end it)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"{_mark(event)}: YAML aliases (*{event.anchor}, of an anchor &{event.anchor}) are not read in a "
                "recipe: write the value out (an alias can expand a few lines into billions of values)"
            )
        self._depth += 1
        try:
            if self._depth > RECIPE_MAX_DEPTH:
                raise ConfigError(
                    f"{_mark(self.peek_event())}: nested more than {RECIPE_MAX_DEPTH} levels deep; a recipe's "
                    "deepest key is reward.NAME.OPTION (see configs/tiny_cpu.yaml)"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        digits = len(node.value.lstrip("+-"))
        if digits > 1000:  # int() refuses 4300 digits with a hint about sys.set_int_max_str_digits
            raise ConfigError(f"{_mark(node)}: an integer of {digits} digits; no setting needs one")
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                kinds = {yaml.SequenceNode: "a list", yaml.MappingNode: "a mapping"}
                shown = kinds.get(type(key_node)) or f"{type(key).__name__} {_shown(key)}"
                raise ConfigError(
                    f"{_mark(key_node)}: a key must be a name, got {shown}; recipe keys are section and field "
                    "names (quote a key YAML reads as something else, e.g. 'on' or '1')"
                )
            if key in seen:
                raise ConfigError(
                    f"{_mark(key_node)}: the key {key!r} is given twice in one "
                    f"section (first on line {seen[key] + 1}); YAML would silently keep the last: keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _RecipeLoader.construct_yaml_int)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a refused value may be enormous)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def _read_recipe(path: Path) -> str:
    """The recipe's text; ``ConfigError`` naming what ``path`` is instead of a readable UTF-8 recipe."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give the path of a YAML recipe inside it")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file: give the path of a YAML recipe")
    try:
        size = path.stat().st_size
        if size > RECIPE_MAX_BYTES:
            raise ConfigError(
                f"config file {path} is {size} bytes; a recipe is a few KB (at most {RECIPE_MAX_BYTES}): "
                "is it the right file?"
            )
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte offset {e.start}); save the recipe as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None


def load_config_file(path: str | Path) -> Config:
    """Load a YAML recipe strictly into a :class:`Config`: no key twice, not empty, no alias, not
    deeper than a recipe's sections, at most :data:`RECIPE_MAX_BYTES`."""
    path = Path(path)
    text = _read_recipe(path)
    try:
        loader = _RecipeLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    except RecursionError:  # the scanner's own recursion, below RECIPE_MAX_DEPTH's reach
        raise ConfigError(f"{path}: nested too deeply to be a recipe") from None
    if not data:
        raise ConfigError(
            f"{path}: the recipe is empty: it would run the built-in tiny defaults. Give its sections "
            "(see configs/tiny_cpu.yaml), or drop --config to run the defaults on purpose"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return _build(Config, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# Fields that hold secrets: written out (config.yaml, checkpoints, wandb) only as whether they were set.
SECRET_FIELDS = ("reward.remote.token",)
REDACTED = "<set; not saved>"


def to_dict(cfg: Config) -> dict:
    """``cfg`` as the run directory, its checkpoints and wandb keep it: secrets redacted
    (``SECRET_FIELDS``; a set one becomes ``REDACTED``, so a resume still sees that it was set)."""
    out = dataclasses.asdict(cfg)
    for path in SECRET_FIELDS:
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None:
            node[leaf] = REDACTED
    return out


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
    token = _DEFER_VALIDATION.set(True)
    try:
        cfg = tyro.cli(Config, default=default, args=rest, description=_LAUNCHER_HELP, registry=registry)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    finally:
        _DEFER_VALIDATION.reset(token)
    validate(cfg)
    check_reward_names(cfg)
    return cfg, opts
