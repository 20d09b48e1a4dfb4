"""The run's footprint, computed once by the plan: the model's sizes, the tokens of a sample and of
a rank, the per-rank resident memory (the reward models' estimated bytes included) and the
activations. The trainer, the dry run and the benches read the plan's ``sizes``, ``shape`` and
``resident`` (the trainer swaps the reward models' estimate for their loaded bytes); the
formulas are :mod:`miles.train.memory_budget`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.models.dtypes import DTYPES
from miles.models.family import rollout_schedule
from miles.parallel.compile import resolve_compile
from miles.train.memory_budget import (
    ALLOCATOR_SLACK,
    MemoryBudgetError,
    ModelSizes,
    ResidentMemory,
    RolloutShape,
    activation_budget,
    activation_bytes,
    cfg_factor,
    count_sde_steps,
    lora_numel,
    model_sizes,
    rollout_shape,
)

__all__ = ["memory_report", "param_report", "sequence_report"]

GIB = 2**30


def sequence_report(cfg, facts) -> tuple[dict, RolloutShape, list[str]]:
    """The sequence each rank holds, the rollout's shape (:func:`rollout_shape`) and the family's
    warnings about the text length. ``facts``: ``dims``, ``model``."""
    r, dims, model = cfg.rollout, facts.dims, facts.model
    try:
        num_sde_steps = count_sde_steps(cfg)
        schedule = rollout_schedule(model, r)  # the family's (an LTX folder's own, from its token count)
        sigmas = schedule.sigmas(r.num_steps)
        if cfg.eval.num_steps:
            schedule.sigmas(cfg.eval.num_steps)
    except ValueError as e:
        raise ValueError(f"invalid rollout schedule: {e}") from None
    warnings = list(model.text_length_warnings(cfg.data.max_sequence_length))
    shape = rollout_shape(cfg, model, dims.sp, num_sde_steps)
    tokens, T = shape.tokens_per_sample, shape.tokens_per_rank
    return (
        {
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
            "cfg_factor": cfg_factor(cfg, len(model.transformers)),
            "num_sde_steps": num_sde_steps,
            "schedule": schedule.describe(r.num_steps),
            "sigmas": sigmas.tolist(),
            "rollout_precision": r.precision,
            "rollout_attention_precision": r.attention_precision,
            "tis_cap": r.tis_cap,
        },
        shape,
        warnings,
    )


def param_report(cfg, model) -> tuple[dict, ModelSizes]:
    """Exact parameter counts from the meta modules (:func:`model_sizes`, the LoRA adapters peft will
    add included), and the report's section."""
    m = cfg.model
    if m.lora_rank > 0 and not all(
        lora_numel(t, m.lora_rank, m.lora_target_modules) for t in model.transformers
    ):
        raise ValueError(f"model.lora_target_modules {m.lora_target_modules} match no Linear layer")
    pipe = model.pipeline
    sizes = model_sizes(
        model.transformers,
        pipe.text_encoder,
        pipe.vae,
        m.lora_rank,
        m.lora_target_modules,
        vae_decoder=model.vae_decoder_memory(),  # the family's fact
        architecture=model.architecture,
    )
    per_expert = list(sizes.expert_params)
    return {
        "per_expert": per_expert,
        "transformer": sum(per_expert),
        "lora_adapters": sizes.lora_params,
        "trainable": sizes.lora_params if m.lora_rank > 0 else sum(per_expert) + sizes.lora_params,
        "largest_block": sizes.largest_block,
        "outside_blocks": sizes.outside_blocks,
        "text_encoder": sizes.text_encoder_params,
        "vae": sizes.vae_params,
        "dtype": m.dtype,
    }, sizes


def memory_report(
    cfg, facts, sizes: ModelSizes, shape: RolloutShape, reward_bytes: float = 0.0
) -> tuple[ResidentMemory, dict[str, float], str]:
    """Memory per rank from the trainer's own terms (``miles/train/memory_budget.py``), the reward
    models' ``reward_bytes`` included, and the activation checkpointing plan, with its note.
    ``facts``: ``dims``, ``model``, ``device_type``. Raises :class:`MemoryBudgetError`."""
    device_type, model = facts.device_type, facts.model
    resident = ResidentMemory.of(cfg, sizes, shape, facts.dims.shard, device_type, reward_bytes)
    budget_mode = cfg.model.activation_checkpointing == "budget"
    budget = cfg.model.activation_memory_budget_gib * GIB
    try:
        left = activation_budget(budget, resident) if budget_mode else 0.0
    except MemoryBudgetError as e:
        raise MemoryBudgetError(f"memory budget (estimated): {e}") from None
    compiled = resolve_compile(cfg.model.compile, torch.device(device_type))
    activations, ac_note = activation_bytes(
        cfg,
        L=model.architecture["num_layers"],
        tokens=cfg.train.micro_batch_size * shape.cfg_factor * shape.tokens_per_rank,
        D=sizes.hidden_size,
        F=sizes.ffn_dim,
        b=DTYPES[cfg.model.dtype].itemsize,
        compiled=compiled,
        per_token_timesteps=model.routing.per_token_timesteps,
        activation_budget_bytes=left,
    )
    ac_note += ", compiled" if compiled else ", eager"
    slack = ALLOCATOR_SLACK * budget if budget_mode else 0.0
    return resident, _memory_table(resident, activations, slack), ac_note


def _memory_table(resident: ResidentMemory, activations: float, slack: float) -> dict[str, Any]:
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
        "rewards": r.rewards,
        "frozen": r.text_encoder + r.vae,
        "allocator_slack": slack,
        "train_peak": r.train_fixed + activations,
        "rollout_peak": r.rollout_peak,
    }
    return {k: v / GIB for k, v in mem.items()}
