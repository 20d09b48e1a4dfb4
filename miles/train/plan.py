"""The run plan: what a run of a config on a world size will be, and every check it must pass
before any weights load. The trainer runs it (:class:`miles.train.trainer.Trainer`), the dry run
prints it (``--dry-run``: :mod:`miles.train.dry_run`), so the two cannot disagree.

:func:`plan_run` reads only the model folder's configs (the modules are built on the ``meta``
device: exact parameter counts, no memory) and checks, in this order: the folder (and its
image-to-video components), the mesh (world size vs ``--sequence-parallel-size``, the Ulysses
degree vs the heads, HSDP replicas, Ulysses groups inside a node), the run directory and the
checkpoint to resume (its files' sha256 included), the model folder's files (every JSON parses, no
safetensors cut short: :mod:`miles.models.fingerprint`), the prompt files (and their images), the
rewards, the rollout precision (``fp8``: CUDA sm >= 89 and torchao) — every one of those inputs
checked, and all refused at once — the attention backend vs
the ring, the model's SP plan, the SDE schedule, the LoRA targets and the per-rank memory budget
(:mod:`miles.train.memory_budget`). A refused setting raises :class:`PlanError` (a ``ConfigError``,
so a ``ValueError``) whose message names the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.config import Config, ConfigError, check_reward_names, config_warnings
from miles.data.prompts import TINY_PROMPTS, GroupSampler, Prompt, check_prompt_images, load_prompts
from miles.models.dtypes import DTYPES
from miles.models.family import FamilyModel, ModelFamily, family_of, model_folder
from miles.models.fingerprint import model_fingerprint
from miles.parallel.compile import resolve_compile
from miles.parallel.topology import ParallelDims, valid_ulysses_degrees
from miles.parallel.topology_checks import check_ulysses_within_node, local_world_size_from_env
from miles.rollout.precision import check_rollout_precision
from miles.train.input_checks import collect_errors, join_errors
from miles.train.memory_budget import (
    ALLOCATOR_SLACK,
    MemoryBudgetError,
    ModelSizes,
    ResidentMemory,
    RolloutShape,
    activation_budget,
    activation_bytes,
    count_sde_steps,
    rollout_shape,
    vae_fields,
)
from miles.train.memory_budget import cfg_factor as guidance_factor
from miles.train.resume import resume_checkpoint
from miles.train.run_dir import check_run_dir
from miles.train.sources import check_batch_source

__all__ = ["PlanError", "PlanMemoryError", "RunPlan", "default_attention_backend", "plan_run"]

GIB = 2**30


class PlanError(ConfigError):
    """The run as configured would be refused at startup; the message names the fix."""


class PlanMemoryError(PlanError, MemoryBudgetError):
    """The per-rank memory budget cannot hold the run (as the plan estimates it)."""


# diffusers attention backends with no fp32 kernel (cudnn SDPA, flash attention, SageAttention)
HALF_ONLY_BACKENDS = frozenset(
    {
        "_native_cudnn",
        "_native_flash",
        "flash",
        "flash_varlen",
        "_flash_3",
        "_flash_varlen_3",
        "sage",
        "sage_varlen",
    }
)


def default_attention_backend(
    device: torch.device, dtype: str = "bfloat16", deterministic: bool = False
) -> str | None:
    """cudnn SDPA on CUDA for bf16/fp16 compute (1.8x faster than flash for Wan shapes on H100/H200);
    with ``deterministic`` (``--deterministic-mode``) flash instead: torch's strict deterministic
    mode excludes cudnn attention (a cudnn-only SDPA call raises), while flash's forward and backward
    are deterministic there. Else (CPU, or ``model.dtype float32``, which neither has a kernel for)
    diffusers' default."""
    if device.type == "cuda" and dtype in ("bfloat16", "float16"):
        return "_native_flash" if deterministic else "_native_cudnn"
    return None


def _check_backend(backend: str | None, cfg: Config, device_type: str) -> None:
    """An explicit ``--fsdp-attention-backend`` this run cannot use on CUDA, refused naming the fix."""
    if device_type != "cuda":
        return
    if cfg.model.dtype == "float32" and backend in HALF_ONLY_BACKENDS:
        raise PlanError(
            f"--fsdp-attention-backend {backend} has no float32 kernel (model.dtype float32): set "
            "model.dtype bfloat16, or leave --fsdp-attention-backend unset (float32: diffusers' native SDPA)"
        )
    if cfg.parallel.deterministic_mode and backend == "_native_cudnn":
        raise PlanError(
            "--fsdp-attention-backend _native_cudnn with --deterministic-mode: torch's deterministic mode "
            "excludes cudnn attention; leave --fsdp-attention-backend unset (deterministic runs then use "
            "_native_flash) or drop --deterministic-mode"
        )


def _check_ring_dtype(cfg: Config, dims: ParallelDims, device_type: str) -> list[str]:
    """Ring attention on CUDA runs flash or cudnn kernels, which have no float32 version. Refused
    where a GPU is visible (the real run, or a dry run on the GPU host); a warning where the plan
    only assumes CUDA (a dry run on a CPU host, where the same recipe runs its CPU ring kernel)."""
    if not (device_type == "cuda" and dims.ring > 1 and cfg.model.dtype == "float32"):
        return []
    message = (
        f"ring attention (ring degree {dims.ring}) on CUDA has bf16/fp16 kernels only (flash, cudnn) and this "
        "run computes in float32: set model.dtype bfloat16, or --ulysses-degree equal to "
        "--sequence-parallel-size (ring 1)"
    )
    if torch.cuda.is_available():
        raise PlanError(message)
    return [f"{message} (this plan assumed CUDA; on CPU the ring runs its float32 kernel)"]


@dataclass(kw_only=True)
class RunPlan:
    """One run of ``cfg`` on ``world_size`` ranks: the layout, the inputs and the memory, checked.

    ``model`` is the meta model (configs only). The report sections (``mesh``, ``sp_plan``,
    ``sequence``, ``params``, ``memory_gib``) are what the dry run prints (:meth:`report`)."""

    cfg: Config
    world_size: int
    world_size_source: str
    local_world_size: int | None
    device_type: str
    family: ModelFamily
    model: FamilyModel
    index: dict
    dims: ParallelDims
    attention_backend: str | None
    run_dir: Path
    resume_from: Path | None
    model_fingerprint: dict  # saved with every checkpoint (miles.models.fingerprint)
    prompts: list[Prompt]
    held_out: list[Prompt]
    image_to_video: bool
    num_sde_steps: int
    shape: RolloutShape
    sizes: ModelSizes
    resident: ResidentMemory  # without the reward models (the trainer adds their loaded bytes)
    warnings: list[str] = field(default_factory=list)
    mesh: dict = field(default_factory=dict)
    sp_plan: dict = field(default_factory=dict)
    sequence: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    memory_gib: dict = field(default_factory=dict)
    activation_checkpointing: str = ""
    inputs: str = ""

    def report(self) -> dict[str, Any]:
        """The plan as the dict :func:`miles.train.dry_run.dry_run` returns."""
        m, tcfg = self.model, self.model.transformers[0].config
        return {
            "world_size": self.world_size,
            "world_size_source": self.world_size_source,
            "local_world_size": self.local_world_size,
            "model": {
                "path": str(m.path),
                "pipeline": self.index.get("_class_name"),
                "transformer_class": type(m.transformers[0]).__name__,
                "num_experts": len(m.transformers),
                **m.routing.report(len(m.transformers)),
                "image_condition": m.condition_mode,
                "num_attention_heads": m.num_attention_heads,
                "attention_head_dim": tcfg.attention_head_dim,
                "hidden_size": self.sizes.hidden_size,
                "ffn_dim": self.sizes.ffn_dim,
                "num_layers": tcfg.num_layers,
                "text_dim": tcfg.text_dim,
                "patch_size": list(tcfg.patch_size),
            },
            "mesh": self.mesh,
            "sp_plan": self.sp_plan,
            "sequence": self.sequence,
            "inputs": self.inputs,
            "activation_checkpointing": self.activation_checkpointing,
            "params": self.params,
            "memory_gib": self.memory_gib,
            "warnings": self.warnings,
        }


def plan_run(
    cfg: Config,
    world_size: int | None = None,
    *,
    local_world_size: int | None = None,
    device_type: str = "cuda",
    strict: bool = False,
) -> RunPlan:
    """Plan and check the run of ``cfg`` on ``world_size`` ranks (else ``$WORLD_SIZE``, else 1).

    ``local_world_size`` (processes per node): else ``$LOCAL_WORLD_SIZE`` / ``$NPROC_PER_NODE``,
    else unknown. ``device_type`` picks the default attention backend, the ring kernel and the
    text encoder's dtype. ``strict`` (the real run): a model folder without the components the
    weights need is refused, not warned about. Raises :class:`PlanError` where the run would refuse.
    """
    world_source = "--world-size"
    if world_size is None:
        world_size, world_source = _env_int("WORLD_SIZE"), "$WORLD_SIZE"
        if world_size is None:
            world_size, world_source = 1, "default"
    local_source = "argument"
    if local_world_size is None:
        local_world_size, local_source = local_world_size_from_env(), "environment"
    try:
        family = family_of(model_folder(cfg.model))
        model, index, warnings = family.load_meta(cfg, strict=strict)
    except ValueError as e:
        raise PlanError(str(e)) from None
    dims, mesh = _mesh_report(cfg, model.num_attention_heads, world_size, world_source, local_world_size)
    image_to_video = model.condition_mode is not None
    inputs = _check_inputs(cfg, dims.dp, model.path, image_to_video, all_ranks=strict)
    warnings += config_warnings(cfg)
    warnings += _check_precision(cfg, device_type)
    warnings += _check_ring_dtype(cfg, dims, device_type)
    mesh["node_note"] = _node_note(dims, world_size, local_world_size, local_source)
    sp_plan = _sp_plan_report(cfg, dims, model, device_type)
    sequence, shape = _sequence_report(cfg, dims, model, warnings)
    params, sizes = _param_report(cfg, model)
    resident, memory, ac_note = _memory_report(
        cfg,
        dims,
        sizes,
        shape,
        model.transformers[0].config.num_layers,
        device_type,
        per_token_timesteps=model.routing.per_token_timesteps,
    )
    return RunPlan(
        cfg=cfg,
        family=family,
        world_size=world_size,
        world_size_source=world_source,
        local_world_size=local_world_size,
        device_type=device_type,
        model=model,
        index=index,
        dims=dims,
        attention_backend=sp_plan["attention_backend"],
        run_dir=inputs["run_dir"],
        resume_from=inputs["resume_from"],
        model_fingerprint=inputs["model_fingerprint"],
        prompts=inputs["prompts"],
        held_out=inputs["held_out"],
        image_to_video=image_to_video,
        num_sde_steps=sequence["num_sde_steps"],
        shape=shape,
        sizes=sizes,
        resident=resident,
        warnings=warnings,
        mesh=mesh,
        sp_plan=sp_plan,
        sequence=sequence,
        params=params,
        memory_gib=memory,
        activation_checkpointing=ac_note,
        inputs=inputs["summary"],
    )


# ---------------------------------------------------------------------------------------------
# The inputs the trainer refuses before it loads weights


def _check_rewards(cfg: Config) -> None:
    """What building the rewards refuses, without constructing one (PickScore would load CLIP-H)."""
    check_reward_names(cfg)
    for name, weight in cfg.reward.weights.items():
        if not math.isfinite(weight):
            raise PlanError(f"reward.weights.{name} must be a finite number, got {weight}")
    from miles.rewards.from_config import check_reward_config

    check_reward_config(cfg.reward)  # shaping options and every reward's local weights, loading nothing


def _check_image_rewards(cfg: Config, image_to_video: bool) -> None:
    """The trainer's refusal of a reward that scores against the given first frame (``needs_images``)
    in a text-to-video run."""
    import miles.rewards  # noqa: F401 (registers the built-in rewards)
    from miles.rewards.registry import needs_images, registered_rewards

    needs = [n for n in cfg.reward.weights if n in registered_rewards() and needs_images(n)]
    if needs and not image_to_video:
        raise ValueError(
            f"reward.weights {sorted(cfg.reward.weights)}: a reward scores against each sample's given "
            "first frame, but the model is text-to-video; use an image-to-video model (model.task i2v)"
        )


def _errors_of_every_rank(errors: list[str]) -> list[str]:
    """Under torch.distributed: the errors of every rank, each once, in rank order, so that all ranks
    refuse together (some checks answer on rank 0 alone: the run directory's lock). The gather is
    also the point no rank passes before every rank has checked (rank 0 takes the lock after it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return errors
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    return list(dict.fromkeys(e for rank_errors in gathered for e in rank_errors or []))


def _check_inputs(
    cfg: Config, dp: int, model_path: Path, image_to_video: bool = False, all_ranks: bool = False
) -> dict:
    """The checks of run directory, checkpoint to resume, model folder files, prompt files and
    rewards, every one run (a refusal lists them all, :func:`~miles.train.input_checks.join_errors`):
    the run directory, the checkpoint (or None), the model folder's fingerprint, the prompts and
    held-out prompts, and a summary line. ``all_ranks`` (the real run, every rank calling): every
    rank raises the errors of all of them."""
    prompt_file = cfg.data.prompt_file or TINY_PROMPTS
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    found: dict[str, Any] = {"resume_from": None, "fingerprint": None}
    prompts: list[Prompt] = []
    held_out: list[Prompt] = []

    def resume() -> None:  # the checkpoint it would resume: whole, its bytes intact, saved with this config
        if cfg.train.resume:
            found["resume_from"] = resume_checkpoint(run_dir, cfg)

    def fingerprint() -> None:  # every JSON parses, no safetensors cut short; saved with each checkpoint
        found["fingerprint"] = model_fingerprint(model_path)

    errors = collect_errors(
        lambda: check_run_dir(run_dir, cfg.train.resume, cfg.train.overwrite, Path(cfg.run.output_dir)),
        resume,
        fingerprint,
        lambda: prompts.extend(load_prompts(prompt_file)),
        lambda: held_out.extend(load_prompts(cfg.eval.prompt_file) if cfg.eval.prompt_file else []),
        lambda: prompts and check_prompt_images(prompts, prompt_file, image_to_video),
        lambda: held_out and check_prompt_images(held_out, cfg.eval.prompt_file, image_to_video),
        lambda: (
            prompts
            and GroupSampler(
                len(prompts), cfg.data.prompts_per_rank, cfg.data.group_size, dp_rank=0, dp_size=dp
            )
        ),
        lambda: check_batch_source(cfg),  # e.g. SFT's video JSONL: every line and video
        lambda: _check_rewards(cfg),
        lambda: _check_image_rewards(cfg, image_to_video),
    )
    errors = _errors_of_every_rank(errors) if all_ranks else errors
    if errors:
        raise PlanError(join_errors(errors))
    summary = f"{len(prompts)} prompts from {prompt_file}" + (
        f" ({len(held_out)} held out from {cfg.eval.prompt_file})" if held_out else ""
    )
    rewards = ", ".join(f"{name} {weight:g}" for name, weight in cfg.reward.weights.items())
    return {
        "run_dir": run_dir,
        "resume_from": found["resume_from"],
        "model_fingerprint": found["fingerprint"],
        "prompts": prompts,
        "held_out": held_out,
        "summary": f"{summary}; rewards {rewards}; run dir {run_dir}",
    }


def _check_precision(cfg: Config, device_type: str) -> list[str]:
    """``rollout.precision``: fp8 needs CUDA sm >= 89, torchao, bf16 weights and a gathered rollout."""
    try:
        return check_rollout_precision(
            cfg.rollout.precision,
            device_type,
            model_dtype=cfg.model.dtype,
            rollout_unsharded=cfg.parallel.rollout_unsharded,
        )
    except ValueError as e:
        raise PlanError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Counting


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _lora_numel(model: nn.Module, rank: int, targets: list[str]) -> int:
    """Adapter parameters peft adds: r·(in + out) per targeted Linear (peft's name-suffix matching)."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (module.in_features + module.out_features)
    return total


def _sp_plan_rows(transformer: nn.Module) -> list[dict]:
    from miles.sequence_parallel import GatherOutput, ShardInput, ShardOutput, sequence_parallel_plan

    plan = sequence_parallel_plan(transformer)
    rows = []
    for module, specs in plan.boundaries.items():
        for spec in specs:
            if isinstance(spec, ShardInput):
                kind, what = "split", f"input {spec.name!r}"
            elif isinstance(spec, ShardOutput):
                kind, what = "split", f"output {spec.index}"
            else:
                assert isinstance(spec, GatherOutput)
                kind, what = "gather", f"output {spec.index}"
            rows.append(
                {
                    "module": module,
                    "what": what,
                    "kind": kind,
                    "dim": spec.dim,
                    "expected_dims": spec.expected_dims,
                }
            )
    return rows


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _mesh_report(
    cfg: Config, heads: int, world_size: int, world_source: str, local_world_size: int | None
) -> tuple[ParallelDims, dict]:
    """The mesh, with the checks ParallelDims and the trainer apply, and its report section (the
    node note is added by the caller, after the input checks)."""
    p = cfg.parallel
    try:
        dims = ParallelDims(
            world_size=world_size,
            sequence_parallel_size=p.sequence_parallel_size,
            ulysses_degree=p.ulysses_degree,
            num_attention_heads=heads,
            replicate_size=p.replicate_size,
        )
    except ValueError as e:
        raise PlanError(f"invalid parallel layout (world size {world_size}, {world_source}): {e}") from None
    valid_u = valid_ulysses_degrees(dims.sp, heads)
    if p.ulysses_degree == 0:
        ulysses_note = f"auto: the largest of {valid_u} (divisors of sp {dims.sp} that divide {heads} heads)"
    else:
        ulysses_note = f"{dims.ulysses} set by --ulysses-degree"
    try:
        check_ulysses_within_node(dims, local_world_size)
    except ValueError as e:
        raise PlanError(f"invalid parallel layout: {e}") from None
    return dims, {
        "dp": dims.dp,
        "sp": dims.sp,
        "ulysses": dims.ulysses,
        "ring": dims.ring,
        "replicate": dims.replicate,
        "shard": dims.shard,
        "ulysses_auto": p.ulysses_degree == 0,
        "ulysses_note": ulysses_note,
        "node_note": None,
        "shard_groups": dims.shard_groups(),
        "groups": {
            "dp": dims.dp_groups(),
            "sp": dims.sp_groups(),
            "ulysses": dims.ulysses_groups(),
            "ring": dims.ring_groups(),
        },
    }


def _node_note(dims: ParallelDims, world_size: int, local_world_size: int | None, local_source: str) -> str:
    if local_world_size is None:
        return (
            "processes per node unknown (set LOCAL_WORLD_SIZE or NPROC_PER_NODE): Ulysses groups stay inside "
            f"a node when the processes per node are a multiple of ulysses {dims.ulysses}"
        )
    num_nodes = math.ceil(world_size / local_world_size)
    ring_crosses = any(len({rank // local_world_size for rank in g}) > 1 for g in dims.ring_groups())
    return (
        f"{local_world_size} processes per node ({local_source}), {num_nodes} node(s): Ulysses groups stay "
        f"inside a node; ring groups {'cross nodes' if ring_crosses else 'stay inside a node'}"
    )


def _sp_plan_report(cfg: Config, dims: ParallelDims, model, device_type: str) -> dict:
    """The SP plan's boundaries, the attention backend and the ring kernel, checked as the trainer
    checks them."""
    from miles.sequence_parallel import validate_sp_args
    from miles.sequence_parallel.ring import select_ring_kernel

    p = cfg.parallel
    backend = p.fsdp_attention_backend or default_attention_backend(
        torch.device(device_type), cfg.model.dtype, p.deterministic_mode
    )
    _check_backend(backend, cfg, device_type)
    backend_note = "--fsdp-attention-backend" if p.fsdp_attention_backend else f"default on {device_type}"
    try:
        validate_sp_args(dims, backend, model_backend=model)
    except ValueError as e:
        raise PlanError(f"invalid sequence-parallel setup: {e}") from None
    plan_rows: list[dict] = []
    plan_error = None
    for i, transformer in enumerate(model.transformers):
        try:
            rows = _sp_plan_rows(transformer)
        except (ValueError, TypeError) as e:
            if dims.sp > 1:
                raise PlanError(f"expert {i} has no usable sequence-parallel plan: {e}") from None
            plan_error, rows = str(e), []
        if i == 0:
            plan_rows = rows
    ring_kernel = None
    if dims.ring > 1:
        ring_kernel = {
            device_type: select_ring_kernel(backend, torch.device(device_type)).name,
            "cpu": select_ring_kernel(backend, torch.device("cpu")).name,
        }
    return {
        "enabled": dims.sp > 1,
        "source": f"{type(model.transformers[0]).__name__}._cp_plan",
        "boundaries": plan_rows,
        "error": plan_error,
        "attention_backend": backend,
        "attention_backend_note": backend_note,
        "ring_kernel": ring_kernel,
    }


def _sequence_report(cfg: Config, dims: ParallelDims, model, warnings: list[str]) -> tuple[dict, Any]:
    """The sequence each rank holds and the rollout's shape (:func:`rollout_shape`)."""
    r = cfg.rollout
    tcfg = model.transformers[0].config
    tokens = model.num_tokens(r.num_frames, r.height, r.width)
    try:
        num_sde_steps = count_sde_steps(cfg)
    except ValueError as e:
        raise PlanError(f"invalid rollout schedule: {e}") from None
    if (tcfg.get("added_kv_proj_dim") or tcfg.get("image_dim")) and cfg.data.max_sequence_length != 512:
        warnings.append(
            f"this is an I2V transformer: Wan splits its context at 512 text tokens, but "
            f"data.max_sequence_length is {cfg.data.max_sequence_length}"
        )
    shape = rollout_shape(cfg, model, dims.sp, num_sde_steps)
    T = shape.tokens_per_rank
    return {
        "num_frames": r.num_frames,
        "height": r.height,
        "width": r.width,
        "latent_shape": list(model.latent_shape(r.num_frames, r.height, r.width)),
        "tokens_per_sample": tokens,
        "tokens_per_sp_rank": T,
        "tokens_per_rank_in_attention": T * dims.ulysses,
        # uneven lengths are padded at the shard boundary: every sp rank holds ceil(S/sp) tokens
        "pad_tokens": -tokens % dims.sp,
        "text_tokens": cfg.data.max_sequence_length,
        "samples_per_rank": cfg.data.prompts_per_rank * cfg.data.group_size,
        "micro_batch": cfg.train.micro_batch_size,  # samples per forward, in rollout and training alike
        "cfg_factor": guidance_factor(cfg, len(model.transformers)),
        "num_sde_steps": num_sde_steps,
        "rollout_precision": r.precision,
        "tis_cap": r.tis_cap,
    }, shape


def _param_report(cfg: Config, model) -> tuple[dict, ModelSizes]:
    """Exact parameter counts from the meta modules, and the sizes the memory terms take."""
    tcfg = model.transformers[0].config
    per_expert = [_numel(t) for t in model.transformers]
    blocks = [max(_numel(b) for b in t.blocks) for t in model.transformers]
    roots = [_numel(t) - sum(_numel(b) for b in t.blocks) for t in model.transformers]
    lora = 0
    if cfg.model.lora_rank > 0:
        lora_per = [
            _lora_numel(t, cfg.model.lora_rank, cfg.model.lora_target_modules) for t in model.transformers
        ]
        if not all(lora_per):
            raise PlanError(
                f"model.lora_target_modules {cfg.model.lora_target_modules} match no Linear layer"
            )
        lora = sum(lora_per)
    total = sum(per_expert) + lora  # adapters are sharded with the rest
    sizes = ModelSizes(
        expert_params=tuple(per_expert),
        lora_params=lora,
        largest_block=max(blocks),
        outside_blocks=max(roots),
        hidden_size=tcfg.num_attention_heads * tcfg.attention_head_dim,
        ffn_dim=tcfg.ffn_dim,
        text_dim=tcfg.text_dim,
        text_encoder_params=_numel(model.pipeline.text_encoder),
        vae_params=_numel(model.pipeline.vae),
        **vae_fields(model.pipeline.vae),
    )
    return {
        "per_expert": per_expert,
        "transformer": sum(per_expert),
        "lora_adapters": lora,
        "trainable": lora if cfg.model.lora_rank > 0 else total,
        "largest_block": max(blocks),
        "outside_blocks": max(roots),
        "text_encoder": sizes.text_encoder_params,
        "vae": sizes.vae_params,
        "dtype": cfg.model.dtype,
    }, sizes


def _memory_report(
    cfg: Config,
    dims: ParallelDims,
    sizes: ModelSizes,
    shape,
    num_layers: int,
    device_type: str,
    per_token_timesteps: bool = False,
) -> tuple[ResidentMemory, dict[str, float], str]:
    """Memory per rank from the trainer's own terms (``miles/train/memory_budget.py``) and the
    activation checkpointing plan, with its note."""
    resident = ResidentMemory.of(cfg, sizes, shape, dims.shard, device_type)
    budget_mode = cfg.model.activation_checkpointing == "budget"
    budget = cfg.model.activation_memory_budget_gib * GIB
    try:
        left = activation_budget(budget, resident) if budget_mode else 0.0
    except MemoryBudgetError as e:
        raise PlanMemoryError(f"memory budget (estimated): {e}") from None
    compiled = resolve_compile(cfg.model.compile, torch.device(device_type))
    try:
        activations, ac_note = activation_bytes(
            cfg,
            L=num_layers,
            tokens=cfg.train.micro_batch_size * shape.cfg_factor * shape.tokens_per_rank,
            D=sizes.hidden_size,
            F=sizes.ffn_dim,
            b=DTYPES[cfg.model.dtype].itemsize,
            compiled=compiled,
            per_token_timesteps=per_token_timesteps,
            activation_budget_bytes=left,
        )
    except MemoryBudgetError as e:
        raise PlanMemoryError(str(e)) from None
    ac_note += ", compiled" if compiled else ", eager"
    slack = ALLOCATOR_SLACK * budget if budget_mode else 0.0
    return resident, _memory_table(resident, activations, slack), ac_note


def _memory_table(resident: ResidentMemory, activations: float, slack: float) -> dict[str, float]:
    """The report's memory rows in GiB: the resident terms, the activations and both phases' peaks
    (allocations; the allocator slack is reported apart: peak + slack <= budget)."""
    r = resident
    mem = {
        "params": r.weights,
        "gathered_in_flight": r.gathered_train,
        "grads": r.grads,
        "optimizer": r.optimizer,
        "ema": r.ema,
        "old_policy": r.old_policy,
        "reference": r.reference,
        "activations": activations,
        "rollout_unsharded": r.gathered_rollout,
        "rollout_activations": r.rollout_workspace,
        "decode": r.decode_workspace,
        "decode_beside_rollout": r.decode_beside_rollout,
        "buffers": r.buffers,
        "text_encoder": r.text_encoder,
        "vae": r.vae,
        "frozen": r.text_encoder + r.vae,
        "allocator_slack": slack,
        "train_peak": r.train_fixed + activations,
        "rollout_peak": r.rollout_peak,
    }
    return {k: v / GIB for k, v in mem.items()}
