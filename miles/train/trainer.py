"""The GRPO trainer: rollout → reward → advantage → clipped-ratio update, on a dp x sp mesh.

One rollout batch per iteration: every dp rank samples ``prompts_per_rank`` prompt groups
of ``group_size`` samples (its sp peers sample the very same ones, with the same noise),
decodes and scores them (the sp peers split that work by micro-batch), normalises rewards
within each prompt group, then takes
``steps_per_rollout`` optimizer steps over the batch. Each optimizer step recomputes the
log-probability of every stored SDE step with the current policy and accumulates the
gradient of the clipped-ratio loss over those steps (Flow-GRPO).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import shlex
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from miles.algorithms import Policy, build_algorithm
from miles.config import Config
from miles.data.prompts import TINY_PROMPTS, GroupSampler, check_prompt_images, load_prompts
from miles.eval import evaluate, summarize, write_eval
from miles.eval.evaluate import eval_settings, grid_caption
from miles.grpo.advantages import group_advantages
from miles.models.i2v import run_condition_mode
from miles.models.sharded_load import (
    RandomInit,
    WeightFiles,
    add_lora,
    build_skeleton,
    cast_frozen,
    copy_local_shards,
    materialize,
)
from miles.models.wan import (
    DTYPES,
    WanModel,
    calibrate_block_memory,
    check_wan_folder,
    load_wan,
    resolve_model_path,
    transformer_config,
)
from miles.parallel.checkpointing import checkpoint_modes
from miles.parallel.compile import resolve_compile
from miles.parallel.fsdp import apply_fsdp, unsharded_for_rollout
from miles.parallel.memory_budget import (
    ALLOCATOR_SLACK,
    ResidentMemory,
    activation_budget,
    count_sde_steps,
    model_sizes,
    rollout_shape,
)
from miles.parallel.topology import ParallelDims, build_parallel_mesh, resolve_ulysses_degree
from miles.parallel.topology_checks import check_ulysses_within_node, local_world_size_from_env
from miles.rewards.base import resident_bytes
from miles.rewards.from_config import build_configured_rewards
from miles.rewards.shaping import EvalRewards, shaped_reward
from miles.rollout.condition import conditions_of
from miles.rollout.prompt_cache import PromptCache
from miles.rollout.sampler import begin_sampling, expert_phases
from miles.sequence_parallel import apply_sequence_parallel, validate_sp_args
from miles.train.checkpoint import (
    checkpoint_error_reason,
    has_ema,
    has_state,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    weights_digest,
)
from miles.train.ema import EMA
from miles.train.export import export_pipeline
from miles.train.fingerprint import model_fingerprint
from miles.train.logging import MetricsLogger, configure_library_progress, print0, show_progress
from miles.train.old_policy import OldPolicy
from miles.train.overlap import decode_and_score
from miles.train.prompt_checks import warn_truncated_prompts
from miles.train.resume import resume_checkpoint
from miles.train.reward_failure import GuardedRewards, reward_failed
from miles.train.run_dir import check_run_dir, clear_run_dir, lock_run_dir
from miles.train.stop import GracefulStop, StopRequested, maybe_inject_signal
from miles.train.videos import to_uint8


def _maybe_inject_fault(rank: int, step: int) -> None:
    """Testing hook: ``MILES_FAULT_KILL=RANK:STEP`` SIGKILLs that rank in the middle of that
    optimizer step (after its backward, before the update), as a dying machine would."""
    spec = os.environ.get("MILES_FAULT_KILL")
    if spec and spec == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# Flags of a fresh start, dropped from the resume command printed after a stop.
_FRESH_START_FLAGS = ("--train.no-resume", "--train.overwrite")


class NonFiniteError(RuntimeError):
    """A reward, loss or gradient norm that is NaN or inf: the run stops, keeping the last good checkpoint."""


def init_distributed(timeout_s: float) -> torch.device:
    """Initialise torch.distributed from torchrun's environment (a single process works too)."""
    # Before CUDA starts: the rollout's gathered expert and training's activations take turns with
    # the memory, and fixed-size segments fragmented it (A14B rehearsal: 60.5 GiB allocated, 83.6
    # reserved). A user's own PYTORCH_CUDA_ALLOC_CONF wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_attention_backend(device: torch.device) -> str | None:
    """cudnn SDPA on CUDA (1.8x faster than flash for Wan shapes on H100/H200), else diffusers' default."""
    if device.type == "cuda":
        return "_native_cudnn"
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def _deterministic_kernels() -> None:
    """``parallel.deterministic_mode``: deterministic cuBLAS and torch kernels, and compiled blocks
    without kernel choice by on-device timing (which can differ run to run)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = init_distributed(cfg.run.collective_timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if cfg.parallel.deterministic_mode:
            _deterministic_kernels()
        torch.manual_seed(cfg.run.seed)
        self.progress = show_progress(cfg.run.progress)  # rank 0, on a terminal
        configure_library_progress(self.progress)

        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        check_run_dir(self.run_dir, cfg.train.resume, cfg.train.overwrite)
        # The checkpoint to resume: whole, and saved with this model, adapters, prompts, seed, algorithm.
        self.resume_from = resume_checkpoint(self.run_dir, cfg) if cfg.train.resume else None
        # Everything that can be refused is checked before the model is moved or a rollout runs;
        # the layout first, from the model folder's config JSON, identically on every rank.
        self._check_layout()
        self._load_inputs()
        # Saved with every lean checkpoint (a resume re-reads the frozen weights from this folder); reads
        # every JSON and safetensors header, naming a broken or truncated file before any weights load.
        self.model_fingerprint = model_fingerprint(resolve_model_path(cfg.model))
        # The transformers come as meta skeletons: _parallelize shards them, then loads each rank's shards.
        self.model: WanModel = load_wan(cfg.model, self.device, experts="skeleton", seed=cfg.run.seed)
        self.prompt_cache = PromptCache(
            self.model.pipeline,
            negative_prompt=cfg.data.negative_prompt,
            max_sequence_length=cfg.data.max_sequence_length,
            device=self.device,
            offload=cfg.model.text_encoder_offload,
            batch_size=cfg.train.micro_batch_size,
        )
        tokenizer = getattr(self.model.pipeline, "tokenizer", None)
        warn_truncated_prompts(cfg, tokenizer, self.prompts, self.eval_prompts, self.rank)  # as the dry run
        self.mesh = build_parallel_mesh(self.dims, self.device.type)
        self.sampler = GroupSampler(
            num_prompts=len(self.prompts),
            prompts_per_dp_rank=cfg.data.prompts_per_rank,
            group_size=cfg.data.group_size,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp_size,
            seed=cfg.run.seed,
        )
        # fp32 master weights; FSDP2 casts to the compute dtype (None: compute in fp32).
        self.compute_dtype = None if cfg.model.dtype == "float32" else DTYPES[cfg.model.dtype]
        self.compile_blocks = resolve_compile(cfg.model.compile, self.device)
        # torch >= 2.12 warns on every rank that the transformer's output is a view (an in-place
        # op on it would skip FSDP2's pre-backward hook). The trainer never modifies it in place.
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(FSDPWanTransformer3DModel\) returned a view"
        )
        self.num_tokens = self.model.num_tokens(cfg.rollout.num_frames, cfg.rollout.height, cfg.rollout.width)
        self.algorithm = build_algorithm(cfg)
        self._parallelize()
        self.policy = Policy(
            transformers=self.model.transformers,
            guidance_scales=self._guidance_scales(),
            boundary_ratio=self.model.boundary_ratio,
            expand_timesteps=self.model.expand_timesteps,
            reference=self._reference_experts if self.algorithm.uses_reference else None,
            generator=self._generator,
            old=self.old_policy,
        )
        if self.compile_blocks:
            print0("[miles] torch.compile per block: the first rollout and train step include compile time")
        self._training_state()
        self.stop = GracefulStop(self.device)  # SIGINT/SIGTERM: save at the next safe point, then exit
        self.run_lock = lock_run_dir(self.run_dir)  # one launch per run directory, before any write
        self._open_run_dir()
        if self.resume_from is not None:
            self._resume(self.resume_from)
        else:
            self.logger.truncate_after(0)  # rows of a run that saved no checkpoint are redone
        print0(
            f"[miles] world {self.world_size} = dp {self.dims.dp} x sp {self.dims.sp} "
            f"(ulysses {self.dims.ulysses} x ring {self.dims.ring}); model {self.model.path} "
            f"({len(self.model.transformers)} expert(s), {self.model.num_attention_heads} heads); "
            f"{self.num_tokens} tokens/sample ({-(-self.num_tokens // self.dims.sp)} per sp rank); "
            f"attention backend {self.attention_backend or 'default'}; run dir {self.run_dir}"
        )

    # ------------------------------------------------------------------------------------------
    # setup

    def _training_state(self) -> None:
        """AdamW over the trainable parameters, the counters and the EMA."""
        cfg = self.cfg.train
        params = [p for t in self.model.transformers for p in t.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.learning_rate,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self._saved_step = -1
        self._eval_step = -1
        self.step = 0  # optimizer steps taken
        self.rollout_index = 0  # rollout batches completed
        self.experts = nn.ModuleList(self.model.transformers)  # one module for checkpoints
        trainable = [(n, p) for n, p in self.experts.named_parameters() if p.requires_grad]
        self.ema = EMA(trainable, cfg.ema_decay) if cfg.ema_decay > 0 else None

    def _open_run_dir(self) -> None:
        """Every check has passed: only now is a previous run deleted (``--train.overwrite``); the
        metrics logger opens and rank 0 writes ``config.yaml``."""
        cfg = self.cfg
        if cfg.train.overwrite:
            if self.rank == 0 and (removed := clear_run_dir(self.run_dir)):
                print0(
                    f"[miles] --train.overwrite: deleted the previous run's {', '.join(removed)} in {self.run_dir}"
                )
            dist.barrier()
        self.logger = MetricsLogger(
            self.run_dir,
            dataclasses.asdict(cfg),
            mode=os.environ.get("WANDB_MODE", cfg.run.wandb_mode)
            if cfg.run.wandb_mode != "disabled"
            else "disabled",
            project=cfg.run.wandb_project,
            name=cfg.run.name,
            enabled=self.rank == 0,
        )
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(
                yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
            )

    def _load_inputs(self) -> None:
        """The prompts (training and held-out, and their images for image-to-video) and the rewards:
        refused here when malformed."""
        cfg = self.cfg
        self.prompts = load_prompts(cfg.data.prompt_file or TINY_PROMPTS)
        held_out = load_prompts(cfg.eval.prompt_file) if cfg.eval.prompt_file else []
        self.eval_prompts = [p.text for p in held_out]
        # Image-to-video: every prompt's image is opened now, before any weights load.
        image_to_video = run_condition_mode(cfg.model, cfg.data.max_sequence_length) is not None
        check_prompt_images(self.prompts, cfg.data.prompt_file or TINY_PROMPTS, image_to_video)
        check_prompt_images(held_out, cfg.eval.prompt_file, image_to_video)
        self.eval_images = [p.image for p in held_out] if image_to_video else None
        held_out = (
            f", {len(self.eval_prompts)} held-out from {cfg.eval.prompt_file}" if self.eval_prompts else ""
        )
        print0(
            f"[miles] loaded {len(self.prompts)} prompts from {cfg.data.prompt_file or 'the built-in list'}"
            + held_out
        )
        self.rewards, self.gold_rewards = build_configured_rewards(cfg.reward, self.device)
        self.rewards = GuardedRewards(self.rewards)  # a server down after retries: save and stop
        if self.rewards.needs_images and not image_to_video:
            raise ValueError(
                f"reward.weights {sorted(cfg.reward.weights)}: a reward scores against each sample's given "
                "first frame, but the model is text-to-video; use an image-to-video model (model.task i2v)"
            )

    def _score_inputs(self, batch: dict, sl: slice) -> tuple:
        """What the rewards score a micro-batch's videos against: its prompts, and for
        image-to-video its given first frames (rewards may check consistency with them)."""
        if self.model.condition_mode is None:
            return (batch["prompts"][sl],)
        return (batch["prompts"][sl], batch["images"][sl])

    def _check_layout(self) -> None:
        """dp x sp, Ulysses x ring, the attention backend: from the config and the model folder's
        ``transformer/config.json``, before any weights load (every rank raises the same error)."""
        path = resolve_model_path(self.cfg.model)
        check_wan_folder(path)
        heads = int(transformer_config(path)["num_attention_heads"])
        self.dims = self._parallel_dims(heads)
        check_ulysses_within_node(self.dims, local_world_size_from_env())
        self.attention_backend = self.cfg.parallel.fsdp_attention_backend or default_attention_backend(
            self.device
        )
        validate_sp_args(self.dims, self.attention_backend, model_backend=WanModel)

    def _parallel_dims(self, num_attention_heads: int) -> ParallelDims:
        p = self.cfg.parallel
        if self.world_size % p.sequence_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by --sequence-parallel-size "
                f"{p.sequence_parallel_size}; launch a multiple of it (torchrun --nproc-per-node)"
            )
        ulysses = resolve_ulysses_degree(p.sequence_parallel_size, p.ulysses_degree, num_attention_heads)
        return ParallelDims(
            world_size=self.world_size,
            sequence_parallel_size=p.sequence_parallel_size,
            ulysses_degree=ulysses,
            replicate_size=p.replicate_size,
        )

    def _checkpoint_modes(self, transformer: nn.Module) -> list[str]:
        """Per-block activation checkpointing; ``budget`` calibrates one block on CUDA and fits the
        activations into what the per-rank total budget leaves after everything resident
        (:mod:`miles.parallel.memory_budget`), so that the peak stays within the budget."""
        cfg = self.cfg.model
        n = len(transformer.blocks)
        if cfg.activation_checkpointing != "budget":
            return checkpoint_modes(cfg.activation_checkpointing, n)
        budget = cfg.activation_memory_budget_gib * 2**30
        left = activation_budget(budget, self.resident)  # refuses a rollout that cannot fit
        if self.device.type != "cuda":
            return checkpoint_modes("selective", n)
        # The calibration's random inputs must not move the RNG the LoRA adapters are drawn from.
        with torch.random.fork_rng(devices=[self.device]):
            block_bytes = calibrate_block_memory(
                transformer,
                -(-self.num_tokens // self.dims.sp),
                self.device,
                batch=2 * self.cfg.train.micro_batch_size,  # CFG doubles the batch
                dtype=self.compute_dtype or torch.float32,
                compiled=self.compile_blocks,
                per_token_timesteps=self.model.expand_timesteps,
            )
        modes = checkpoint_modes("budget", n, left, block_bytes)
        print0(
            f"[miles] activation checkpointing for a {cfg.activation_memory_budget_gib} GiB budget "
            f"({self.resident.train_fixed / 2**30:.1f} GiB resident in training, "
            f"{self.resident.rollout_peak / 2**30:.1f} GiB rollout peak, {ALLOCATOR_SLACK:.0%} slack): "
            + ", ".join(f"{m} x{modes.count(m)}" for m in dict.fromkeys(modes))
            + " (one block keeps "
            + ", ".join(f"{m} {b / 2**30:.2f}" for m, b in block_bytes.items())
            + " GiB)"
        )
        return modes

    def _resident_memory(self) -> ResidentMemory:
        """The per-rank resident terms (weights, optimizer, rollout, decode...) of this run, from the
        loaded modules' parameter counts (LoRA adapters installed, nothing sharded yet)."""
        pipe = self.model.pipeline
        sizes = model_sizes(self.model.transformers, pipe.text_encoder, pipe.vae)
        shape = rollout_shape(self.cfg, self.model, self.dims.sp, count_sde_steps(self.cfg))
        mixes = [self.rewards] + ([self.gold_rewards] if self.gold_rewards is not None else [])
        rewards = resident_bytes([r for mix in mixes for r in mix.rewards.values()], self.device)
        return ResidentMemory.of(self.cfg, sizes, shape, self.dims.shard, self.device.type, rewards)

    def _install_sp(self, transformer: nn.Module) -> None:
        plan = self.model.sequence_parallel_plan(transformer) if self.dims.sp > 1 else None
        apply_sequence_parallel(transformer, self.mesh, plan=plan)

    def _parallelize(self) -> None:
        """LoRA, then attention backend → SP install → FSDP2 (per block, then root), per expert, on
        meta skeletons; then each rank loads only its own shards (:mod:`miles.models.sharded_load`).
        The old policy's and the reference's copies are skeletons sharded alike, filled from the
        policy's local shards: no rank ever holds a whole expert."""
        cfg = self.cfg
        trained = dict(reduce_dtype=torch.float32, reshard_after_forward=cfg.parallel.reshard_after_forward)
        adapters = []
        for transformer in self.model.transformers:
            adapters.append(self._make_trainable(transformer))
        self.resident = self._resident_memory()
        for transformer in self.model.transformers:
            transformer.train()
            self._shard(transformer, checkpointing=True, **trained)
        for i, (transformer, sub) in enumerate(zip(self.model.transformers, self._expert_folders())):
            if cfg.model.init == "random":
                source = RandomInit(seed=cfg.run.seed, salt=sub)
            else:
                source = WeightFiles(self.model.path / sub)
            materialize(transformer, self.device, source, adapters[i])
        old = []  # the old policy's experts (DiffusionNFT), with their adapters
        if self.algorithm.uses_old_policy:
            old = [self._sharded_copy(i, lora=True, **trained) for i in range(len(self.model.transformers))]
        self.old_policy = OldPolicy(old, self.model.transformers) if old else None
        # A full fine-tune with a KL term keeps a frozen copy of the initial weights, sharded alike,
        # stored in the compute dtype (the dtype FSDP2 computes it in anyway).
        self.reference = None
        if self.algorithm.uses_reference and cfg.model.lora_rank == 0:
            self.reference = [
                self._sharded_copy(i, lora=False, dtype=self.compute_dtype).requires_grad_(False).eval()
                for i in range(len(self.model.transformers))
            ]

    def _expert_folders(self) -> list[str]:
        return ["transformer", "transformer_2"][: len(self.model.transformers)]

    def _sharded_copy(
        self, i: int, lora: bool, dtype: torch.dtype | None = None, **fsdp_options
    ) -> nn.Module:
        """A copy of expert ``i``: a skeleton (with the same adapters when ``lora``), sharded like the
        expert, filled with its local shards (in ``dtype``, default the expert's own dtypes)."""
        copy_ = build_skeleton(self.model.path, self._expert_folders()[i])
        if not lora:
            copy_.requires_grad_(False)
        elif self.cfg.model.lora_rank > 0:
            with torch.random.fork_rng(devices=[]):  # the copy's adapter draw is overwritten anyway
                self._make_trainable(copy_)
        if dtype is not None:
            cast_frozen(copy_, dtype)
        self._shard(copy_, **fsdp_options)
        copy_local_shards(copy_, self.model.transformers[i])
        return copy_

    def _make_trainable(self, transformer: nn.Module) -> dict[str, torch.Tensor]:
        """Full fine-tune: every parameter trains (fp32 masters); LoRA: a frozen base, stored in the
        compute dtype, with trainable fp32 adapters. Returns the adapters' initial values (peft's
        draw, captured on the CPU while ``transformer`` is a meta skeleton)."""
        cfg = self.cfg.model
        if cfg.lora_rank == 0:
            transformer.requires_grad_(True)
            return {}
        from peft import LoraConfig

        transformer.requires_grad_(False)
        adapters = add_lora(
            transformer,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                init_lora_weights="gaussian",
                target_modules=cfg.lora_target_modules,
            ),
        )
        if self.compute_dtype is not None:
            cast_frozen(transformer, self.compute_dtype)
        return adapters

    def _shard(self, transformer: nn.Module, checkpointing: bool = False, **fsdp_options) -> None:
        """Attention backend → SP install → FSDP2 on one expert (``checkpointing``: with the
        configured activation checkpointing, calibrated after SP is installed)."""
        if self.attention_backend is not None:
            transformer.set_attention_backend(self.attention_backend)
        self._install_sp(transformer)
        apply_fsdp(
            transformer,
            self.mesh.fsdp_mesh,
            param_dtype=self.compute_dtype,
            checkpoint_modes=self._checkpoint_modes(transformer) if checkpointing else None,
            compile_blocks=self.compile_blocks,
            **fsdp_options,
        )

    # ------------------------------------------------------------------------------------------
    # one iteration

    def _generator(self, *parts: int) -> torch.Generator:
        """A generator seeded from the run seed and ``parts``: same on every rank given the same parts."""
        g = torch.Generator(device="cpu")
        g.manual_seed(hash((self.cfg.run.seed, *parts)) & 0x7FFF_FFFF_FFFF_FFFF)
        return g

    def rollout(self) -> dict:
        """Sample this rank's prompt groups in fixed micro-batches; the noise of every sample is a
        function of its global index in the rollout batch only."""
        cfg, r = self.cfg, self.cfg.rollout
        groups = next(self.sampler)
        G = cfg.data.group_size
        sample_ids = [g * G + i % G for i, g in enumerate(groups.group_ids)]  # global sample index
        order = self._step_major_order(len(sample_ids))
        prompts = [self.prompts[groups.prompt_indices[i]].text for i in order]
        images = [self.prompts[groups.prompt_indices[i]].image for i in order]
        image_cache: dict = {}  # each group's image is encoded once per rollout
        group_list = [groups.group_ids[i] for i in order]
        sample_ids = [sample_ids[i] for i in order]
        group_ids = torch.as_tensor(group_list)
        # The SDE steps are the same on every rank (so expert routing and FSDP's collectives match).
        sde_steps = self.algorithm.sde_steps(r.num_steps, self._generator(1, self.rollout_index))
        latent_shape = self.model.latent_shape(r.num_frames, r.height, r.width)
        init_noise, sde_gens = self._rollout_noise(group_list, sample_ids, latent_shape)
        dtype = DTYPES[cfg.model.dtype]
        # Each unique prompt is encoded once (CPU rows; the negative once per run), then the
        # micro-batches are sampled in fixed slices, so a sample's numbers do not depend on the
        # layout (or on dp), and training's recompute sees exactly the rollout's batch composition.
        self.prompt_cache.start_rollout(prompts)
        neg = self.prompt_cache.negative().to(dtype)
        runs = []
        for sl in self._micro_slices(len(prompts)):
            condition = None
            if self.model.condition_mode is not None:
                size = dict(num_frames=r.num_frames, height=r.height, width=r.width)
                condition = conditions_of(
                    self.model, images[sl], **size, device=self.device, cache=image_cache
                )
            runs.append(
                begin_sampling(
                    self.prompt_cache.embeds(prompts[sl]).to(dtype),
                    neg,
                    latent_shape,
                    num_steps=r.num_steps,
                    shift=r.shift,
                    guidance_scales=self._guidance_scales(),
                    boundary_ratio=self.model.boundary_ratio,
                    noise_level=r.noise_level,
                    generator=sde_gens[sl],
                    latents=init_noise[sl].to(self.device),
                    sde_steps=sde_steps,
                    expand_timesteps=self.model.expand_timesteps,
                    sde_type=r.sde_type,
                    record_means=self.algorithm.records_means,
                    condition=condition,
                    device=self.device,
                )
            )
        self._sample_expert_at_a_time(runs)
        chunks = [
            {
                "slice": sl,
                "pos": run.prompt_embeds,
                "neg": neg,
                "rollout": run.finish(),
                "condition": run.condition,
            }
            for sl, run in zip(self._micro_slices(len(prompts)), runs)
        ]
        return {
            "prompts": prompts,
            "images": images,  # each sample's first frame (None for text-to-video)
            "group_ids": group_ids,
            "sample_ids": torch.as_tensor(sample_ids),
            "rollout_index": self.rollout_index,
            "chunks": chunks,
            "sde_steps": sde_steps,
        }

    def _rollout_noise(self, group_list: list[int], sample_ids: list[int], latent_shape) -> tuple:
        """Each sample's initial noise and SDE generator, keyed by its global index (its group's with
        ``rollout.same_noise_per_group``), so dp4, dp2 x sp2 and sp4 draw the same videos; sp peers
        share dp_rank and so share samples."""
        init_keys = group_list if self.cfg.rollout.same_noise_per_group else sample_ids
        init_noise = torch.stack(
            [
                torch.randn(latent_shape, generator=self._generator(2, self.rollout_index, k))
                for k in init_keys
            ]
        )
        return init_noise, [self._generator(3, self.rollout_index, k) for k in sample_ids]

    @torch.no_grad()
    def _sample_expert_at_a_time(self, runs: list) -> None:
        """Every micro-batch's steps of the high-noise expert with only that expert gathered
        (``parallel.rollout_unsharded``), then it is resharded and the low-noise expert takes every
        micro-batch's remaining steps: one expert's full weights on the GPU at a time. Bitwise the
        same as sampling each micro-batch start to finish (``SamplingRun``)."""
        cfg, r = self.cfg, self.cfg.rollout
        experts = self.algorithm.rollout_transformers(self.policy)
        phases = expert_phases(r.num_steps, r.shift, self.model.boundary_ratio, len(experts))
        for phase, (e, start, stop) in enumerate(phases):
            with unsharded_for_rollout(
                [experts[e]],
                enabled=cfg.parallel.rollout_unsharded,
                reshard_after_forward=cfg.parallel.reshard_after_forward,
            ):
                desc = f"rollout expert {e + 1}/{len(experts)}"
                for mb, run in enumerate(self._bar(runs, desc)):
                    if phase == 0:
                        maybe_inject_signal(self.rank, self.rollout_index, mb)
                    if self.stop.requested():  # nothing trained yet: abandon the rollout
                        raise StopRequested
                    run.run_steps(experts, start, stop)

    def _step_major_order(self, n: int) -> list[int]:
        """The order of this rank's samples, so that consecutive optimizer steps take the same
        global samples in every dp layout.

        Samples arrive group by group. Each step takes the same slice of every group (sample i of
        a group goes to step i // (G / steps)), which depends on neither dp nor prompts_per_rank.
        If steps_per_rollout does not divide the group size, groups stay whole and consecutive
        ones go to consecutive steps (then the split depends on the dp layout).
        """
        cfg = self.cfg
        steps, G = cfg.train.steps_per_rollout, cfg.data.group_size
        if G % steps:
            return list(range(n))
        per = G // steps
        groups = n // G
        return [j * G + m * per + i for m in range(steps) for j in range(groups) for i in range(per)]

    def _bar(self, items, desc: str):
        """An inner progress bar on rank 0 (cleared when done)."""
        return tqdm(items, desc=desc, leave=False, disable=not self.progress)

    def _micro_slices(self, n: int) -> list[slice]:
        mb = self.cfg.train.micro_batch_size
        return [slice(i, i + mb) for i in range(0, n, mb)]

    def _guidance_scales(self) -> list[float]:
        r = self.cfg.rollout
        g2 = r.guidance_scale if r.guidance_scale_2 is None else r.guidance_scale_2
        return [r.guidance_scale, g2][: len(self.model.transformers)]

    def _logs_videos(self, rollout_index: int) -> bool:
        """Whether this rank logs the videos of that rollout (rank 0, every ``run.log_video_every``)."""
        every = self.cfg.run.log_video_every
        return bool(every) and self.rank == 0 and rollout_index % every == 0

    def score(self, batch: dict) -> dict:
        """Decode and reward this rank's share of the micro-batches, then group-normalise.

        sp peers hold the same samples, so each decodes and scores only every sp-th micro-batch
        (the VAE decode is most of the cost) and a sum over the sp group — every sample has
        exactly one non-zero contributor, so the sum is exact — gives every peer all the rewards.
        Rewards are scored per micro-batch, the same composition in every layout, and gathered
        over dp for the group statistics.
        """
        sp, sp_rank = self.mesh.sp_size, self.mesh.sp_rank
        n = batch["group_ids"].numel()
        local = torch.zeros(1 + len(self.rewards.names), n, device=self.device)
        videos, video_prompts, video_rewards = [], [], []
        # A worker scores micro-batch k while this thread decodes k + 1 (miles.train.overlap).
        mine = [chunk for c, chunk in enumerate(batch["chunks"]) if c % sp == sp_rank]
        # Each video is dropped once scored; rank 0 keeps uint8 CPU copies when this rollout logs videos.
        logged = self._logs_videos(self.rollout_index)
        results = decode_and_score(
            mine,
            lambda chunk: self.model.decode(chunk["rollout"].final_latents),
            lambda video, chunk: self.rewards(video, *self._score_inputs(batch, chunk["slice"])),
            lambda video, chunk: [to_uint8(v) for v in video] if logged else None,
        )
        for chunk, kept, (combined, per_reward) in results:
            sl = chunk["slice"]
            local[:, sl] = torch.stack([combined, *(per_reward[k] for k in self.rewards.names)]).to(
                self.device
            )
            if kept is not None:
                videos += kept
                video_prompts += batch["prompts"][sl]
                video_rewards += combined.tolist()
        if sp > 1:
            dist.all_reduce(local, group=self.mesh.sp_group)
        gathered = [torch.empty_like(local) for _ in range(self.mesh.dp_size)]
        dist.all_gather(gathered, local, group=self.mesh.dp_group)
        everything = torch.cat(gathered, dim=1)
        local_ids = batch["group_ids"].to(self.device)  # NCCL gathers device tensors only
        ids = [torch.empty_like(local_ids) for _ in range(self.mesh.dp_size)]
        dist.all_gather(ids, local_ids, group=self.mesh.dp_group)
        n = batch["group_ids"].numel()
        per_reward_all = {name: everything[1 + i] for i, name in enumerate(self.rewards.names)}
        trained = everything[0]
        if any(mode != "none" for mode in self.cfg.reward.normalize.values()):
            trained = shaped_reward(
                per_reward_all, self.rewards.weights, self.cfg.reward.normalize, torch.cat(ids)
            )
        advantages = group_advantages(
            trained,
            torch.cat(ids),
            global_std=self.cfg.grpo.global_std,
            adv_clip_max=self.cfg.grpo.adv_clip_max,
        )
        if self.cfg.grpo.negate_advantages:  # the negative control: must not learn
            advantages = -advantages
        mine = slice(self.mesh.dp_rank * n, (self.mesh.dp_rank + 1) * n)
        batch.update(
            videos=videos or None,  # (F, H, W, 3) uint8 of the micro-batches this rank decoded, if logged
            video_prompts=video_prompts,
            video_rewards=video_rewards,
            advantages=advantages[mine].to(self.device),
            reward_all=everything[0],
            shaped_all=trained,
            per_reward_all=per_reward_all,
            advantages_all=advantages,
        )
        if not torch.isfinite(everything).all():
            raise NonFiniteError(
                f"a reward is NaN or inf at rollout {self.rollout_index} (step {self.step + 1})"
            )
        return batch

    def train_on(self, batch: dict) -> list[dict]:
        """``steps_per_rollout`` optimizer steps over the rollout batch.

        Each step takes its share of micro-batches; the algorithm backpropagates its loss over
        them (``miles.algorithms``), then the gradients are clipped and the optimizer steps.
        """
        cfg = self.cfg
        chunks = batch["chunks"]
        per_step = len(chunks) // cfg.train.steps_per_rollout
        stats = []
        for m in self._bar(range(cfg.train.steps_per_rollout), "optimizer steps"):
            mine = chunks[m * per_step : (m + 1) * per_step]
            batch["step_in_rollout"] = m
            sums = self.algorithm.accumulate(self.policy, batch, mine)
            canary = sums.pop("log_prob_mean_abs_diff", None)
            if not self._all_finite(sums["loss"]):
                raise NonFiniteError(f"the loss is NaN or inf at step {self.step + 1}")
            _maybe_inject_fault(self.rank, self.step + 1)
            grad_norm = self._clip_grad_norm()
            if not math.isfinite(grad_norm):  # the same on every rank: all stop together
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"the gradient norm is NaN or inf at step {self.step + 1}")
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            row = {**sums, "grad_norm": grad_norm}
            if m == 0 and canary is not None:
                # The first step of a rollout runs with exactly the weights that sampled it.
                row["log_prob_mean_abs_diff"] = canary
            stats.append(self._mean_over_dp(row))
        return stats

    @contextlib.contextmanager
    def _reference_experts(self):
        """The reference (initial) policy's experts: the frozen copy, or the LoRA model with its
        adapters off for the duration of the context."""
        if self.reference is not None:
            yield self.reference
            return
        for t in self.model.transformers:
            t.disable_adapters()
        try:
            yield self.model.transformers
        finally:
            for t in self.model.transformers:
                t.enable_adapters()

    def _all_finite(self, value: float) -> bool:
        """Whether ``value`` is finite on every rank (so that all ranks stop together)."""
        flag = torch.tensor([0.0 if math.isfinite(value) else 1.0], device=self.device)
        dist.all_reduce(flag)
        return flag.item() == 0.0

    def _clip_grad_norm(self) -> float:
        params = [p for t in self.model.transformers for p in t.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _mean_over_dp(self, row: dict) -> dict:
        keys = sorted(row)
        t = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.mesh.dp_group)
        return {k: v / self.mesh.dp_size for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "rollout_index": self.rollout_index,
            "sampler": self.sampler.state_dict(),
            "world_size": self.world_size,
            "dp": self.dims.dp,
            "sp": self.dims.sp,
            "config": dataclasses.asdict(self.cfg),
            "model_fingerprint": self.model_fingerprint,
        }

    def save(self) -> None:
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.experts,
            self.optimizer,
            self._trainer_state(),
            self.cfg.train.keep_checkpoints,
            ema=self.ema,
            old_policy=self.old_policy,
        )
        self._saved_step = self.step
        print0(f"[miles] checkpoint saved: {path}{self._digest_note()}")

    def _digest_note(self) -> str:
        if not self.cfg.train.weight_digest:
            return ""
        return f" (weights sha256 {weights_digest(self.experts)})"

    def _resume(self, path: Path) -> None:
        if self.ema is not None and not has_ema(path):
            print0(f"[miles] {path} holds no EMA: the EMA starts from its weights")
        if self.old_policy is not None and not has_state(path, "old_policy"):
            print0(f"[miles] {path} holds no old policy: it starts from the checkpoint's weights")
        try:
            state = load_checkpoint(
                path, self.experts, self.optimizer, ema=self.ema, old_policy=self.old_policy
            )
        except CheckpointException as e:  # on every rank: DCP gathers the ranks' failures
            raise ValueError(
                f"the checkpoint {path} could not be loaded ({checkpoint_error_reason(e)}): it is damaged. "
                "Move it aside to resume from the previous one"
            ) from None
        if self.old_policy is not None and not has_state(path, "old_policy"):
            self.old_policy.soft_update(0.0)
        self.step, self.rollout_index = state["step"], state["rollout_index"]
        self.sampler.load_state_dict(state["sampler"])
        self.logger.truncate_after(self.step)
        self._saved_step = self.step
        print0(
            f"[miles] resumed from {path} (step {self.step}, rollout {self.rollout_index}; saved at "
            f"dp {state['dp']} x sp {state['sp']}, now dp {self.dims.dp} x sp {self.dims.sp})"
            f"{self._digest_note()}"
        )

    # ------------------------------------------------------------------------------------------

    def train(self) -> None:
        """Every rollout up to ``train.num_rollouts``, then the final evaluation, save and export.
        A SIGINT/SIGTERM stops it at the next safe point with a checkpoint (``self.stop``)."""
        cfg = self.cfg
        bar = tqdm(
            total=cfg.train.num_rollouts,
            initial=self.rollout_index,
            desc="rollouts",
            disable=not self.progress,
        )
        with self.stop:
            if self.rollout_index == 0:
                self.evaluate()  # the baseline
            while self.rollout_index < cfg.train.num_rollouts and not self.stop.requested():
                if not self._iteration():
                    break
                bar.update(1)
                if cfg.eval.every and self.rollout_index % cfg.eval.every == 0:
                    self.evaluate()
                every = cfg.train.checkpoint_every
                if every and self.rollout_index % every == 0 and self.rollout_index < cfg.train.num_rollouts:
                    self.save()
            bar.close()
            if self.stop.agreed:
                self._save_on_stop()
                return
            if self._eval_step != self.step:
                self.evaluate()
            if self._saved_step != self.step:
                self.save()
        if cfg.train.export:
            with self._averaged():
                out = export_pipeline(
                    cfg, self.model.path, list(self.model.transformers), self.run_dir / "export"
                )
            print0(f"[miles] exported the trained model to {out}")

    def _iteration(self) -> bool:
        """One rollout → reward → update → log; False when a stop request abandoned the rollout
        before it trained (the prompt sampler is then put back: the resumed run redoes it)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sampler_state = self.sampler.state_dict()
        t0 = time.perf_counter()
        try:
            batch = self.rollout()
            if self.stop.requested():
                raise StopRequested
        except StopRequested:
            self.sampler.load_state_dict(sampler_state)
            return False
        t1 = time.perf_counter()
        try:
            batch = self.score(batch)
            t2 = time.perf_counter()
            step_stats = self.train_on(batch)
            after = self.algorithm.after_rollout(self.policy, self.step)
        except NonFiniteError as e:
            if (failure := self.rewards.agreed_failure(self.device)) is not None:
                self.sampler.load_state_dict(sampler_state)  # the resumed run redoes this rollout
                if self._saved_step != self.step and self.step > 0:
                    self.save()
                raise reward_failed(failure, self.step, last_good_checkpoint(self.run_dir)) from None
            # Nothing of this rollout is saved: the last complete checkpoint stays the good one.
            last = last_good_checkpoint(self.run_dir)  # verified: a corrupt one is never named good
            raise NonFiniteError(
                f"{e}. Stopped without saving; the last good checkpoint is {last or 'none (none was saved)'}"
            ) from None
        t3 = time.perf_counter()
        self._log(batch, step_stats, after, t1 - t0, t2 - t1, t3 - t2)
        self.rollout_index += 1
        return True

    def _save_on_stop(self) -> None:
        """The stop request's checkpoint (unless this step is saved already, or nothing has trained
        yet) and how to resume."""
        if self._saved_step != self.step and self.step > 0:
            self.save()
        path = latest_checkpoint(self.run_dir)
        again = " ".join(shlex.quote(a) for a in sys.argv[1:] if a not in _FRESH_START_FLAGS)
        print0(
            f"[miles] stopped by {self.stop.name} after step {self.step} ({self.rollout_index} of "
            f"{self.cfg.train.num_rollouts} rollouts done); the checkpoint is {path or 'none (nothing trained yet)'}. To resume, "
            f"relaunch the same command: train_grpo.py {again}"
        )

    def _averaged(self):
        """The EMA weights in place of the trained ones (``train.ema_decay``), else nothing."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def evaluate(self) -> None:
        """Sample the held-out prompts deterministically, score them with every reward, log
        ``eval/<reward>/mean`` (``eval.jsonl``, wandb) and write ``<run>/eval/step_N.{json,mp4}``."""
        cfg = self.cfg
        if not self.eval_prompts:
            return
        t0 = time.perf_counter()
        settings = eval_settings(cfg, self.model)
        self.prompt_cache.prepare(self.eval_prompts)  # one encoder visit for every held-out prompt

        def gather(experts):
            return unsharded_for_rollout(
                experts,
                enabled=cfg.parallel.rollout_unsharded,
                reshard_after_forward=cfg.parallel.reshard_after_forward,
            )

        with self._averaged():
            result = evaluate(
                self.model,
                EvalRewards(self.rewards, self.gold_rewards),
                self.eval_prompts,
                cfg.eval.num_seeds,
                settings,
                negative_prompt=cfg.data.negative_prompt,
                max_sequence_length=cfg.data.max_sequence_length,
                device=self.device,
                dp_rank=self.mesh.dp_rank,
                dp_size=self.mesh.dp_size,
                dp_group=self.mesh.dp_group,
                keep_videos=self.rank == 0 and cfg.eval.log_videos,
                images=self.eval_images,
                encode=lambda texts: (self.prompt_cache.embeds(texts), self.prompt_cache.negative()),
                gather=gather,
            )
        metrics = {
            **summarize(result),
            "rollout": self.rollout_index,
            "time/eval_s": time.perf_counter() - t0,
        }
        grid, caption = None, ""
        if self.rank == 0:
            grid = write_eval(result, self.run_dir / "eval", f"step_{self.step:06d}").get("video")
            caption = grid_caption(result, f"held-out, step {self.step}") if grid else ""
        self.logger.log_eval(metrics, step=self.step, grid=grid, caption=caption)
        self._eval_step = self.step
        print0(
            f"[eval] step {self.step}: "
            + " ".join(f"{k[5:-5]}={v:.4f}" for k, v in metrics.items() if k.endswith("/mean"))
            + f" ({len(result['prompts'])} samples, {metrics['time/eval_s']:.1f}s)"
        )

    def _log(
        self,
        batch: dict,
        step_stats: list[dict],
        after: dict,
        t_rollout: float,
        t_reward: float,
        t_train: float,
    ) -> None:
        rewards = batch["reward_all"]
        adv = batch["advantages_all"]
        forwards = self.algorithm.forwards_per_sample(batch)
        samples = rewards.numel()
        metrics = {
            "rollout": self.rollout_index,
            "reward/mean": rewards.mean(),
            "reward/std": rewards.std(),
            "reward/min": rewards.min(),
            "reward/max": rewards.max(),
            "advantage/mean": adv.mean(),
            "advantage/std": adv.std(),
            "advantage/abs_max": adv.abs().max(),
            "time/rollout_s": t_rollout,
            "time/reward_s": t_reward,
            "time/train_s": t_train,
            "time/step_s": t_train / len(step_stats),
            # every training forward (with or without gradient; CFG counts twice), per second
            "perf/train_tokens_per_s": samples * forwards * self.num_tokens / max(t_train, 1e-9),
            "memory/peak_gib": peak_memory_gib(self.device),
            **{f"train/{k}": v for k, v in after.items()},
        }
        if batch["shaped_all"] is not batch["reward_all"]:  # reward.normalize: what advantages see
            metrics["reward/shaped/mean"] = batch["shaped_all"].mean()
            metrics["reward/shaped/std"] = batch["shaped_all"].std()
        for name, values in batch["per_reward_all"].items():
            metrics[f"reward/{name}/mean"] = values.mean()
            metrics[f"reward/{name}/std"] = values.std()
        for i, row in enumerate(step_stats):
            step = self.step - len(step_stats) + i + 1
            row_metrics = {f"train/{k}": v for k, v in row.items()}
            self.logger.log({**metrics, **row_metrics} if i == 0 else row_metrics, step=step)
        first = step_stats[0]
        shown = [k for k in ("clipfrac", "old_deviation", "log_prob_mean_abs_diff") if k in first]
        print0(
            f"[rollout {self.rollout_index}] step {self.step} reward mean={float(rewards.mean()):.4f} "
            f"std={float(rewards.std()):.4f} min={float(rewards.min()):.4f} max={float(rewards.max()):.4f} "
            f"loss={first['loss']:.3e} "
            + "".join(f"{k}={first[k]:.3e} " for k in shown)
            + f"grad_norm={first['grad_norm']:.3e} step_time={t_train / len(step_stats):.2f}s"
        )
        if self._logs_videos(self.rollout_index) and batch["videos"] is not None:
            # rank 0's decoded samples: with sp > 1, every sp-th micro-batch of its dp rank
            self.logger.log_videos(
                batch["videos"], batch["video_prompts"], batch["video_rewards"], step=self.step
            )

    def close(self) -> None:
        self.logger.close()
