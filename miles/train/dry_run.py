"""Dry run: the plan of a run — mesh, groups, SP plan, sequence, per-rank memory — without running it.

    python train_grpo.py --config configs/tiny_cpu.yaml --dry-run --world-size 8 --sequence-parallel-size 4

Single process, no GPU, no ``torch.distributed``, no weights: it reads the configs of the
model folder (``model_index.json``, ``transformer[_2]/config.json``, ``vae/config.json``,
``text_encoder/config.json``), builds the modules on the ``meta`` device (exact parameter
counts, no memory) and applies the same checks the real run applies at startup: world size
vs ``--sequence-parallel-size`` and ``--ulysses-degree`` vs the heads (``ParallelDims``),
the attention backend vs the ring (``validate_sp_args``), the model's SP plan (from its
diffusers ``_cp_plan``), tokens divisible by sp (``shard_sequence``), the SDE window, and —
when the processes per node are known (``LOCAL_WORLD_SIZE`` / ``NPROC_PER_NODE``) — Ulysses
groups inside a node. It also makes the trainer's input checks: the run directory, the prompt
files (readable, UTF-8, enough prompts for one rollout at this dp size), the reward names,
weights and PickScore folders (without loading them); with the model folder's tokenizer it
counts the prompts longer than ``data.max_sequence_length``. An invalid layout or input raises
:class:`DryRunError` (a ``ConfigError``) with the fix; the entry point prints it and exits 2.

World size: ``--world-size`` > ``$WORLD_SIZE`` > 1.

Memory per rank (GiB; an ESTIMATE, not a measurement). Everything but the training activations
comes from :class:`miles.parallel.memory_budget.ResidentMemory`, the terms the trainer fits its
budget with (its module docstring gives each formula): fp32 master weights (LoRA: the frozen base
in the compute dtype), gradients, AdamW state, EMA, old policy, KL reference — each divided by the
FSDP shard group size S (W, or W / replicate_size under HSDP) — the text encoder (only when not
offloaded), the VAE, the stored rollout buffers, FSDP's gathered blocks in flight, ONE expert
gathered during the rollout, the rollout's no-grad working set and the VAE decode workspace.
With ``activation_checkpointing: budget``, ``model.activation_memory_budget_gib`` is the per-rank
total: activations get what ``activation_budget`` leaves after those terms and a 5% allocator
slack, and a budget the rollout alone cannot meet is refused as the trainer would.

Training activations, L·B·T·a(mode), where a is the bytes one block keeps per token for backward
(b = bytes of ``model.dtype``, D = hidden size, F = FFN size, L = layers, T = tokens per sp rank,
B = the micro batch ``train.micro_batch_size`` x 2 with CFG — cond and uncond run as one batch):

  none       a = (52 + 9·b)·D + 2·F·b; compiled blocks (``model.compile``): a = 18·b·D + 2·F·b
             (measured on an H200 at the 1.3B and 5B shapes: 36.2·D + 4·F bytes a token in bf16,
             eager 54·D + 4·F); eager blocks keep 32·D more with per-token timesteps (Wan2.2 TI2V
             ``expand_timesteps``: the fp32 shift/scale/gate products of the bf16 (B, S, 6, D)
             modulation input are per token); compiled blocks recompute them from that input,
             which the model holds once for all blocks (saved-tensor accounting of a whole model)
  selective  a = (9.3·D + F)·b     (+ one block's "none" while it recomputes)
  full       a = D·b               (the block input; + one block's "none")
  budget     per block, from those, as ``plan_modes`` would pick them

The coefficients were measured once on a Wan block (diffusers 0.42, sp = 1) by summing the
storages autograd saves (saved_tensors_hooks) and, for selective, the outputs of the ops
``miles.parallel.checkpointing.SAVE_OPS`` keeps: at 1.3B shapes a bf16 block keeps 70·D + 4·F
bytes a token (the norms, modulation and RoPE make ~13 fp32 temporaries of width D), an fp32 block
87·D + 8·F. Ulysses/ring add a few D·b more per token; the calibration on CUDA that ``budget``
runs (``measure_block_memory``) is the measurement to trust.

train peak = weights + optimizer + EMA + old policy + reference + text encoder + VAE + buffers +
gradients + in flight + activations; rollout peak = the same persistent terms + max(one gathered
expert + rollout working set, VAE decode). Not counted: reward models, attention kernel
workspaces and communication buffers — what the 5% slack is for.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from miles.config import Config, ConfigError, check_reward_names, config_warnings
from miles.data.prompts import (
    TINY_PROMPTS,
    GroupSampler,
    check_prompt_images,
    load_prompts,
)
from miles.models.wan import (
    DTYPES,
    WanModel,
    check_wan_folder,
    read_json,
    read_model_index,
    resolve_model_path,
)
from miles.parallel.compile import resolve_compile
from miles.parallel.memory_budget import (
    ALLOCATOR_SLACK,
    MemoryBudgetError,
    ModelSizes,
    ResidentMemory,
    activation_budget,
    count_sde_steps,
    rollout_shape,
    vae_fields,
)
from miles.parallel.memory_budget import cfg_factor as guidance_factor
from miles.parallel.topology import ParallelDims, valid_ulysses_degrees
from miles.parallel.topology_checks import check_ulysses_within_node, local_world_size_from_env
from miles.train.fingerprint import model_fingerprint
from miles.train.input_checks import collect_errors, join_errors
from miles.train.prompt_checks import truncation_warnings
from miles.train.resume import resume_checkpoint
from miles.train.run_dir import check_run_dir

__all__ = ["DryRunError", "dry_run", "format_report"]

GIB = 2**30
_SHOW_GROUPS = 4  # groups printed per kind before "... (N groups)"
_SHOW_RANKS = 8  # ranks printed per group before eliding


class DryRunError(ConfigError):
    """The run as configured would be refused at startup; the message names the fix."""


# ---------------------------------------------------------------------------------------------
# Reading the model folder (configs only)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _diffusers_class(index: dict, component: str, default: str) -> type:
    import diffusers

    entry = index.get(component) or [None, None]
    name = entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[1] else default
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise DryRunError(f"model_index.json names {component} class {name!r}, which diffusers does not have")
    return cls


def _meta_from_config(cls: type, folder: Path) -> nn.Module:
    """``cls`` built from ``folder/config.json`` on the meta device: exact shapes, no memory."""
    try:
        read_json(folder / "config.json")  # a broken file is named, as the real run names it
    except ValueError as e:
        raise DryRunError(str(e)) from None
    config = cls.load_config(folder)
    with torch.device("meta"):
        return cls.from_config(config)


def _meta_text_encoder(index: dict, folder: Path) -> nn.Module | None:
    entry = index.get("text_encoder") or [None, None]
    if not (folder / "config.json").is_file() or not isinstance(entry, list) or entry[0] != "transformers":
        return None
    import transformers

    cls = getattr(transformers, entry[1], None)
    if cls is None:
        return None
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return cls(config)


def _load_meta_model(cfg: Config) -> tuple[WanModel, dict, list[str]]:
    """A :class:`WanModel` whose transformers and VAE live on the meta device, plus extras and warnings."""
    path = resolve_model_path(cfg.model)
    try:
        index = read_model_index(path)
    except ValueError as e:
        raise DryRunError(str(e)) from None
    warnings = []
    try:
        check_wan_folder(path)
    except ValueError as e:  # the dry run needs only configs; the real run needs every component
        warnings.append(f"the real run will refuse this folder: {e}")
    from miles.models.i2v import check_i2v_run, condition_mode

    try:
        mode = condition_mode(path, index, cfg.model.task)
        check_i2v_run(path, index, mode, cfg.data.max_sequence_length)
    except ValueError as e:
        raise DryRunError(str(e)) from None
    experts = []
    for sub in ("transformer", "transformer_2"):
        folder = path / sub
        if sub == "transformer_2" and not (index.get(sub) or [None])[0]:
            continue
        if not (folder / "config.json").is_file():
            raise DryRunError(
                f"model.path {path} lacks {sub}/config.json (the dry run reads the transformer config)"
            )
        experts.append(_meta_from_config(_diffusers_class(index, sub, "WanTransformer3DModel"), folder))
    if not (path / "vae" / "config.json").is_file():
        raise DryRunError(
            f"model.path {path} lacks vae/config.json (its scale factors give the latent shape)"
        )
    vae = _meta_from_config(_diffusers_class(index, "vae", "AutoencoderKLWan"), path / "vae")
    try:
        text_encoder = _meta_text_encoder(index, path / "text_encoder")
    except Exception as e:  # optional: only its parameter count is reported
        warnings.append(f"text encoder config unreadable ({e}); not counted")
        text_encoder = None
    model = WanModel(
        path=path,
        transformers=experts,
        boundary_ratio=index.get("boundary_ratio") if len(experts) == 2 else None,
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        pipeline=SimpleNamespace(vae=vae, text_encoder=text_encoder),
        condition_mode=mode,
    )
    return model, index, warnings


# ---------------------------------------------------------------------------------------------
# The inputs the trainer refuses before it loads weights


def _check_rewards(cfg: Config) -> None:
    """What building the rewards refuses, without constructing one (PickScore would load CLIP-H)."""
    check_reward_names(cfg)
    for name, weight in cfg.reward.weights.items():
        if not math.isfinite(weight):
            raise DryRunError(f"reward.weights.{name} must be a finite number, got {weight}")
    from miles.rewards.from_config import check_reward_config

    check_reward_config(cfg.reward)  # shaping options and every reward's local weights, loading nothing


def _check_image_rewards(cfg: Config, image_to_video: bool) -> None:
    """The trainer's refusal of a reward that scores against the given first frame (``needs_images``)
    in a text-to-video run."""
    import miles.rewards  # noqa: F401 (registers the built-in rewards)
    from miles.rewards.registry import _REGISTRY

    needs = [n for n in cfg.reward.weights if getattr(_REGISTRY.get(n), "needs_images", False)]
    if needs and not image_to_video:
        raise ValueError(
            f"reward.weights {sorted(cfg.reward.weights)}: a reward scores against each sample's given "
            "first frame, but the model is text-to-video; use an image-to-video model (model.task i2v)"
        )


def _check_inputs(
    cfg: Config, dp: int, model_path: Path, image_to_video: bool = False
) -> tuple[str, list[str]]:
    """The trainer's checks of run directory, prompt files and rewards; (a summary line, warnings).

    Also counts the prompts the text encoder will truncate, when the model folder has its tokenizer
    (a folder without one is already reported as one the real run refuses).
    """
    prompt_file = cfg.data.prompt_file or TINY_PROMPTS
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    prompts, held_out = [], []
    errors = collect_errors(  # every one, not the first: one dry run lists all that is missing
        lambda: check_run_dir(run_dir, cfg.train.resume, cfg.train.overwrite),
        lambda: cfg.train.resume and resume_checkpoint(run_dir, cfg),  # whole, saved with this config
        lambda: model_fingerprint(model_path),  # as the real run: every JSON parses, no safetensors cut short
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
        lambda: _check_rewards(cfg),
        lambda: _check_image_rewards(cfg, image_to_video),
    )
    if errors:
        raise DryRunError(join_errors(errors))
    warnings = config_warnings(cfg)
    tokenizer_dir = model_path / "tokenizer"
    if tokenizer_dir.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        warnings += truncation_warnings(cfg, tokenizer, prompts, held_out)  # the real run's warning
    summary = f"{len(prompts)} prompts from {prompt_file}" + (
        f" ({len(held_out)} held out from {cfg.eval.prompt_file})" if held_out else ""
    )
    rewards = ", ".join(f"{name} {weight:g}" for name, weight in cfg.reward.weights.items())
    return f"{summary}; rewards {rewards}; run dir {run_dir}", warnings


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


def _block_bytes_per_token(
    D: int, F: int, b: int, compiled: bool = False, per_token_timesteps: bool = False
) -> dict[str, float]:
    """Bytes one Wan block keeps for backward per token, per checkpointing mode (see the module docstring)."""
    return {
        # compiled: Inductor recomputes the fp32 element-wise outputs instead of saving them, the
        # per-token modulation products (eager: +32·D) among them
        "none": (18 * b * D if compiled else (52 + 9 * b + 32 * per_token_timesteps) * D) + 2 * F * b,
        "selective": (9.3 * D + F) * b,
        "attention": 3 * D * b,  # self/cross attention outputs and the block input
        "full": D * b,
    }


def _activation_bytes(
    cfg: Config,
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
    (:func:`miles.parallel.memory_budget.activation_budget`), as the trainer computes it."""
    mode = cfg.model.activation_checkpointing
    if isinstance(mode, bool):  # older configs: a switch for full checkpointing
        mode = "full" if mode else "none"
    per_block = _block_bytes_per_token(D, F, b, compiled, per_token_timesteps)
    per_block = {k: v * tokens for k, v in per_block.items()}
    if mode == "budget":
        from miles.parallel.checkpointing import plan_modes

        budget = cfg.model.activation_memory_budget_gib
        try:
            modes = plan_modes(L, per_block, activation_budget_bytes)
        except ValueError as e:
            raise DryRunError(f"activation budget (estimated): {e}") from None
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


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


# ---------------------------------------------------------------------------------------------


def dry_run(
    cfg: Config,
    world_size: int | None = None,
    *,
    local_world_size: int | None = None,
    device_type: str = "cuda",
    verbose: bool = True,
) -> dict[str, Any]:
    """Plan the run of ``cfg`` on ``world_size`` ranks and print it; returns the plan as a dict.

    ``world_size``: ``--world-size``, else ``$WORLD_SIZE``, else 1. ``local_world_size``
    (processes per node): else ``$LOCAL_WORLD_SIZE`` / ``$NPROC_PER_NODE``, else unknown.
    ``device_type`` picks the default attention backend and ring kernel (the memory numbers
    are per GPU). Raises :class:`DryRunError` where the real run would refuse to start.
    """
    world_source = "--world-size"
    if world_size is None:
        world_size, world_source = _env_int("WORLD_SIZE"), "$WORLD_SIZE"
        if world_size is None:
            world_size, world_source = 1, "default"
    local_source = "argument"
    if local_world_size is None:
        local_world_size, local_source = local_world_size_from_env(), "environment"

    model, index, warnings = _load_meta_model(cfg)
    first = model.transformers[0]
    tcfg = first.config
    dims, mesh = _mesh_report(cfg, model.num_attention_heads, world_size, world_source, local_world_size)
    inputs, input_warnings = _check_inputs(cfg, dims.dp, model.path, model.condition_mode is not None)
    warnings += input_warnings
    mesh["node_note"] = _node_note(dims, world_size, local_world_size, local_source)
    sp_plan = _sp_plan_report(cfg, dims, model, device_type)
    sequence, shape = _sequence_report(cfg, dims, model, warnings)
    params, sizes = _param_report(cfg, model)
    memory, ac_note = _memory_report(
        cfg, dims, sizes, shape, tcfg.num_layers, device_type, per_token_timesteps=model.expand_timesteps
    )
    report = {
        "world_size": world_size,
        "world_size_source": world_source,
        "local_world_size": local_world_size,
        "model": {
            "path": str(model.path),
            "pipeline": index.get("_class_name"),
            "transformer_class": type(first).__name__,
            "num_experts": len(model.transformers),
            "boundary_ratio": model.boundary_ratio,
            "expand_timesteps": model.expand_timesteps,
            "image_condition": model.condition_mode,
            "num_attention_heads": model.num_attention_heads,
            "attention_head_dim": tcfg.attention_head_dim,
            "hidden_size": sizes.hidden_size,
            "ffn_dim": sizes.ffn_dim,
            "num_layers": tcfg.num_layers,
            "text_dim": tcfg.text_dim,
            "patch_size": list(tcfg.patch_size),
        },
        "mesh": mesh,
        "sp_plan": sp_plan,
        "sequence": sequence,
        "inputs": inputs,
        "activation_checkpointing": ac_note,
        "params": params,
        "memory_gib": memory,
        "warnings": warnings,
    }
    if verbose:
        print(format_report(report), flush=True)
    return report


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
        raise DryRunError(f"invalid parallel layout (world size {world_size}, {world_source}): {e}") from None
    valid_u = valid_ulysses_degrees(dims.sp, heads)
    if p.ulysses_degree == 0:
        ulysses_note = f"auto: the largest of {valid_u} (divisors of sp {dims.sp} that divide {heads} heads)"
    else:
        ulysses_note = f"{dims.ulysses} set by --ulysses-degree"
    try:
        check_ulysses_within_node(dims, local_world_size)
    except ValueError as e:
        raise DryRunError(f"invalid parallel layout: {e}") from None
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
    from miles.train.trainer import default_attention_backend

    p = cfg.parallel
    backend = p.fsdp_attention_backend or default_attention_backend(torch.device(device_type))
    backend_note = "--fsdp-attention-backend" if p.fsdp_attention_backend else f"default on {device_type}"
    try:
        validate_sp_args(dims, backend, model_backend=model)
    except ValueError as e:
        raise DryRunError(f"invalid sequence-parallel setup: {e}") from None
    plan_rows: list[dict] = []
    plan_error = None
    for i, transformer in enumerate(model.transformers):
        try:
            rows = _sp_plan_rows(transformer)
        except (ValueError, TypeError) as e:
            if dims.sp > 1:
                raise DryRunError(f"expert {i} has no usable sequence-parallel plan: {e}") from None
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
        raise DryRunError(f"invalid rollout schedule: {e}") from None
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
            raise DryRunError(
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
) -> tuple[dict[str, float], str]:
    """Memory per rank from the trainer's own terms (``miles/parallel/memory_budget.py``) and the
    activation checkpointing plan, with its note."""
    resident = ResidentMemory.of(cfg, sizes, shape, dims.shard, device_type)
    budget_mode = cfg.model.activation_checkpointing == "budget"
    budget = cfg.model.activation_memory_budget_gib * GIB
    try:
        left = activation_budget(budget, resident) if budget_mode else 0.0
    except MemoryBudgetError as e:
        raise DryRunError(f"memory budget (estimated): {e}") from None
    compiled = resolve_compile(cfg.model.compile, torch.device(device_type))
    activations, ac_note = _activation_bytes(
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
    ac_note += ", compiled" if compiled else ", eager"
    return _memory_table(resident, activations, ALLOCATOR_SLACK * budget if budget_mode else 0.0), ac_note


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
        "buffers": r.buffers,
        "text_encoder": r.text_encoder,
        "vae": r.vae,
        "frozen": r.text_encoder + r.vae,
        "allocator_slack": slack,
        "train_peak": r.train_fixed + activations,
        "rollout_peak": r.rollout_peak,
    }
    return {k: v / GIB for k, v in mem.items()}


# ---------------------------------------------------------------------------------------------
# Printing


def _fmt_group(group: list[int]) -> str:
    if len(group) <= _SHOW_RANKS:
        return "[" + ", ".join(map(str, group)) + "]"
    head = ", ".join(map(str, group[:3]))
    return f"[{head}, ..., {group[-1]}] ({len(group)} ranks)"


def _fmt_groups(groups: list[list[int]]) -> str:
    shown = " ".join(_fmt_group(g) for g in groups[:_SHOW_GROUPS])
    more = f" ... ({len(groups)} groups)" if len(groups) > _SHOW_GROUPS else ""
    return shown + more


def _n(x: int) -> str:
    return f"{x:,}"


def _human(x: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3f} {suffix}"
    return str(x)


def format_report(rep: dict[str, Any]) -> str:
    """The readable form of a :func:`dry_run` report."""
    m, mesh = rep["model"], rep["mesh"]
    experts = f"{m['num_experts']} x {m['transformer_class']}"
    if m["num_experts"] == 2:
        experts += f", boundary_ratio {m['boundary_ratio']}"
    lines = [
        "miles dry run: no GPU, no torch.distributed, no weights loaded",
        f"model     {m['path']} ({m['pipeline']}: {experts})",
        f"          {m['num_attention_heads']} heads x {m['attention_head_dim']} = hidden {m['hidden_size']}, "
        f"{m['num_layers']} layers, ffn {m['ffn_dim']}, text_dim {m['text_dim']}, patch {tuple(m['patch_size'])}"
        + (", per-token timesteps" if m["expand_timesteps"] else "")
        + (f"; image-to-video ({m['image_condition']} image condition)" if m["image_condition"] else ""),
        f"world     {rep['world_size']} ranks ({rep['world_size_source']})",
        f"mesh      dp {mesh['dp']} x sp {mesh['sp']} (ulysses {mesh['ulysses']} x ring {mesh['ring']}); "
        f"ulysses {mesh['ulysses_note']}",
    ]
    for kind in ("dp", "sp", "ulysses", "ring"):
        lines.append(f"  {kind + ' groups':<15} {_fmt_groups(mesh['groups'][kind])}")
    if mesh["replicate"] > 1:
        lines.append(
            f"  {'fsdp (HSDP)':<15} shard groups of {mesh['shard']} ranks {_fmt_groups(mesh['shard_groups'])}, "
            f"replicated {mesh['replicate']} times"
        )
    else:
        lines.append(f"  {'fsdp':<15} all {rep['world_size']} ranks (parameters sharded over dp x sp)")
    lines.append(f"  {'nodes':<15} {mesh['node_note']}")
    lines.append(f"inputs    {rep['inputs']}")
    lines += _plan_lines(rep["sp_plan"])
    lines += _sequence_lines(rep["sequence"], mesh["sp"])
    lines += _param_memory_lines(rep)
    for w in rep["warnings"]:
        lines.append(f"warning   {w}")
    return "\n".join(lines)


def _plan_lines(plan: dict) -> list[str]:
    lines = []
    state = "installed" if plan["enabled"] else "not installed (sp = 1)"
    lines.append(f"sp plan   from {plan['source']}; {state}")
    # In forward order: the root's inputs first, the gather last.
    rows = sorted(plan["boundaries"], key=lambda row: (row["module"] != "", row["kind"] == "gather"))
    for row in rows:
        only = f" (only when {row['expected_dims']}-D: per-token timesteps)" if row["module"] == "" else ""
        lines.append(
            f"  {row['module'] or '(root)':<10} {row['what']:<22} {row['kind']} dim {row['dim']}{only}"
        )
    if plan["error"]:
        lines.append(f"  (no plan: {plan['error']})")
    lines.append(
        "  self-attention: USP (Ulysses all-to-all x ring) via dispatch_attention_fn; cross-attention: stock"
    )
    kernel = "none (ring = 1)"
    if plan["ring_kernel"]:
        kernel = ", ".join(f"{v} on {k}" for k, v in plan["ring_kernel"].items())
    lines.append(
        f"  attention backend {plan['attention_backend'] or 'diffusers default'} "
        f"({plan['attention_backend_note']}); ring kernel {kernel}"
    )

    return lines


def _sequence_lines(seq: dict, sp: int) -> list[str]:
    cfg_note = " x CFG 2" if seq["cfg_factor"] == 2 else ""
    return [
        f"sequence  {seq['num_frames']} frames {seq['height']}x{seq['width']} -> latent "
        f"{tuple(seq['latent_shape'])} -> {_n(seq['tokens_per_sample'])} tokens/sample",
        f"          {_n(seq['tokens_per_sp_rank'])} tokens per sp rank (ceil(S/sp) = "
        f"ceil({_n(seq['tokens_per_sample'])}/{sp})"
        + (
            f"; {seq['pad_tokens']} pad tokens on the last rank(s), excluded from attention"
            if seq["pad_tokens"]
            else ""
        )
        + f"); {_n(seq['tokens_per_rank_in_attention'])} in attention after the all-to-all (S/ring)",
        f"          {seq['text_tokens']} text tokens; {seq['samples_per_rank']} samples per dp rank, micro batch "
        f"{seq['micro_batch']}{cfg_note} per forward; {seq['num_sde_steps']} SDE steps trained",
    ]


def _param_memory_lines(rep: dict) -> list[str]:
    par, mem, mesh = rep["params"], rep["memory_gib"], rep["mesh"]
    per = " + ".join(_n(x) for x in par["per_expert"]) + " = " if len(par["per_expert"]) > 1 else ""
    trainable = "all" if not par["lora_adapters"] else f"LoRA adapters {_n(par['lora_adapters'])}"
    lines = [
        f"params    transformer {per}{_n(par['transformer'])} ({_human(par['transformer'])}; exact, "
        f"meta device); trainable: {trainable} ({_n(par['trainable'])})",
        f"          largest block {_n(par['largest_block'])}, outside blocks {_n(par['outside_blocks'])}; "
        f"frozen: text encoder {_n(par['text_encoder']) if par['text_encoder'] else 'n/a'}, "
        f"VAE {_n(par['vae'])}",
        f"memory    per rank, GiB (an estimate; {par['dtype']} compute; formulas in miles/parallel/memory_budget.py)",
    ]
    labels = [
        ("params", f"weights (fp32 masters; sharded / {mesh['shard']})"),
        ("gathered_in_flight", "gathered blocks in flight"),
        ("grads", "gradients (fp32)"),
        ("optimizer", "AdamW state (fp32)"),
        ("ema", "EMA"),
        ("old_policy", "old policy copy"),
        ("reference", "KL reference copy"),
        ("activations", f"activations (train, {rep['activation_checkpointing']})"),
        ("rollout_unsharded", "rollout: one expert gathered"),
        ("rollout_activations", "activations (rollout)"),
        ("decode", "VAE decode workspace"),
        ("buffers", "rollout buffers"),
        ("text_encoder", "text encoder (resident unless offloaded)"),
        ("vae", "VAE"),
    ]
    for key, label in labels:
        lines.append(f"  {label:<42} {mem[key]:10.3f}")
    lines.append(f"  {'= train peak':<42} {mem['train_peak']:10.3f}")
    lines.append(f"  {'= rollout peak':<42} {mem['rollout_peak']:10.3f}")
    if mem["allocator_slack"]:
        lines.append(f"  {'+ allocator slack (5% of the budget)':<42} {mem['allocator_slack']:10.3f}")
    lines.append("  (not counted: the reward models; the trainer adds their loaded bytes to its plan)")
    return lines
