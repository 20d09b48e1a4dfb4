"""The run plan: what a run of a config on a world size will be, and every check it must pass
before any weights load. The trainer runs it (:class:`miles.train.trainer.Trainer`), the dry run
prints it (``--dry-run``: :mod:`miles.train.dry_run`), so the two cannot disagree.

:func:`plan_run` reads only the model folder's configs (the family's meta model: exact parameter
counts, no memory) and gathers the parts' own checks, each beside its part and each given the
config and the plan's facts (:class:`PlanFacts`: the mesh, the meta model, the device type): the
mesh (:func:`miles.parallel.topology_checks.mesh_report`), the run directory and the checkpoint to
resume (its files' sha256 included), the model folder's files (:mod:`miles.models.fingerprint`),
the prompt files and their images, the batch source (:mod:`miles.train.sources`), the rewards
(:mod:`miles.rewards.from_config`), the rollout precision (:mod:`miles.rollout.precision`) and its
attention's (:mod:`miles.rollout.attention`), the attention backend, ring kernel and SP plan
(:mod:`miles.sequence_parallel.checks`), the SDE schedule and the family's text length, the LoRA
targets (:mod:`miles.train.footprint`) — every refusal listed at once, in one format
(:mod:`miles.train.input_checks`) — then the per-rank memory (:mod:`miles.train.footprint`,
:mod:`miles.train.memory_budget`; the reward models' bytes estimated from their weight files). A
refused setting raises :class:`PlanError` (a ``ConfigError``, so a ``ValueError``) whose message
names the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from miles.config import Config, ConfigError, config_warnings
from miles.data.prompts import TINY_PROMPTS, GroupSampler, Prompt, check_prompt_images, load_prompts
from miles.models.family import FamilyModel, ModelFamily, family_of, model_folder, rollout_schedule
from miles.models.fingerprint import model_fingerprint
from miles.parallel.topology import ParallelDims
from miles.parallel.topology_checks import local_world_size_from_env, mesh_report, node_note
from miles.rewards.from_config import check_image_rewards, check_reward_inputs, estimated_reward_bytes
from miles.rollout.attention import check_attention_precision
from miles.rollout.precision import check_rollout_precision
from miles.rollout.schedule import FlowSchedule
from miles.sequence_parallel.checks import check_ring_dtype, sp_plan_report
from miles.train.footprint import memory_report, param_report, sequence_report
from miles.train.input_checks import collect_errors, join_errors
from miles.train.memory_budget import MemoryBudgetError, ModelSizes, ResidentMemory, RolloutShape
from miles.train.resume import resume_checkpoint
from miles.train.run_dir import check_run_dir
from miles.train.sources import check_batch_source

__all__ = ["PlanError", "PlanFacts", "PlanMemoryError", "RunPlan", "plan_run"]


class PlanError(ConfigError):
    """The run as configured would be refused at startup; the message names the fix."""


class PlanMemoryError(PlanError, MemoryBudgetError):
    """The per-rank memory budget cannot hold the run (as the plan estimates it)."""


@dataclass(frozen=True)
class PlanFacts:
    """What the parts' checks are given besides the config: the layout, the meta model, the device."""

    world_size: int
    local_world_size: int | None
    device_type: str
    dims: ParallelDims
    model: FamilyModel

    @property
    def image_to_video(self) -> bool:
        return self.model.condition_mode is not None


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
    schedule: FlowSchedule  # the family's noise schedule (``FamilyModel.flow_schedule``)
    shape: RolloutShape
    sizes: ModelSizes
    resident: ResidentMemory  # rewards: their models' bytes estimated from the weight files (the trainer
    # puts in the loaded bytes)
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
                "num_layers": m.architecture["num_layers"],
                "text_dim": m.architecture["text_dim"],
                "patch_size": list(m.architecture["patch_size"]),
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
        heads = model.num_attention_heads
        dims, mesh = mesh_report(cfg, heads, world_size, world_source, local_world_size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    facts = PlanFacts(world_size, local_world_size, device_type, dims, model)
    parts = _check_parts(cfg, facts, all_ranks=strict)
    inputs, (sequence, shape, text_warnings), (params, sizes) = (
        parts["inputs"],
        parts["sequence"],
        parts["params"],
    )
    warnings += (
        config_warnings(cfg)
        + parts["precision"]
        + parts["attention_precision"]
        + parts["ring"]
        + text_warnings
    )
    mesh["node_note"] = node_note(dims, world_size, local_world_size, local_source)
    try:
        resident, memory, ac_note = memory_report(cfg, facts, sizes, shape, inputs["reward_bytes"])
    except MemoryBudgetError as e:
        raise PlanMemoryError(str(e)) from None
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
        attention_backend=parts["sp_plan"]["attention_backend"],
        run_dir=inputs["run_dir"],
        resume_from=inputs["resume_from"],
        model_fingerprint=inputs["model_fingerprint"],
        prompts=inputs["prompts"],
        held_out=inputs["held_out"],
        image_to_video=facts.image_to_video,
        num_sde_steps=sequence["num_sde_steps"],
        schedule=rollout_schedule(model, cfg.rollout),
        shape=shape,
        sizes=sizes,
        resident=resident,
        warnings=warnings,
        mesh=mesh,
        sp_plan=parts["sp_plan"],
        sequence=sequence,
        params=params,
        memory_gib=memory,
        activation_checkpointing=ac_note,
        inputs=inputs["summary"],
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _check_parts(cfg: Config, facts: PlanFacts, all_ranks: bool = False) -> dict[str, Any]:
    """Every part's check, each given ``cfg`` and ``facts``, every one run: a refusal lists them all
    in one message (:func:`~miles.train.input_checks.join_errors`). Returns each part's result by
    name. ``all_ranks`` (the real run, every rank calling): every rank raises the errors of all."""
    found: dict[str, Any] = {}

    def part(name: str, check: Callable[[], Any]) -> Callable[[], None]:
        return lambda: found.__setitem__(name, check())

    errors = _input_errors(cfg, facts, found)
    errors += collect_errors(
        part("precision", lambda: _check_precision(cfg, facts.device_type)),
        part("attention_precision", lambda: _check_attention_precision(cfg, facts)),
        part("ring", lambda: check_ring_dtype(cfg, facts.dims, facts.device_type)),
        part("sp_plan", lambda: sp_plan_report(cfg, facts)),
        part("sequence", lambda: sequence_report(cfg, facts)),
        part("params", lambda: param_report(cfg, facts.model)),
    )
    errors = _errors_of_every_rank(errors) if all_ranks else errors
    if errors:
        raise PlanError(join_errors(errors))
    return found


def _errors_of_every_rank(errors: list[str]) -> list[str]:
    """Under torch.distributed: the errors of every rank, each once, in rank order, so that all ranks
    refuse together (some checks answer on rank 0 alone: the run directory's lock). The gather is
    also the point no rank passes before every rank has checked (rank 0 takes the lock after it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return errors
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    return list(dict.fromkeys(e for rank_errors in gathered for e in rank_errors or []))


def _input_errors(cfg: Config, facts: PlanFacts, found: dict[str, Any]) -> list[str]:
    """The checks of run directory, checkpoint to resume, model folder files, prompt files, batch
    source and rewards; sets ``found["inputs"]``: the run directory, the checkpoint (or None), the
    model folder's fingerprint, the prompts and held-out prompts, the reward models' estimated
    bytes and a summary line."""
    prompt_file = cfg.data.prompt_file or TINY_PROMPTS
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    image_to_video = facts.image_to_video
    got: dict[str, Any] = {"resume_from": None, "fingerprint": None, "reward_bytes": 0}
    prompts: list[Prompt] = []
    held_out: list[Prompt] = []

    def resume() -> None:  # the checkpoint it would resume: whole, its bytes intact, saved with this config
        if cfg.train.resume:
            got["resume_from"] = resume_checkpoint(run_dir, cfg)

    def fingerprint() -> None:  # every JSON parses, no safetensors cut short; saved with each checkpoint
        got["fingerprint"] = model_fingerprint(facts.model.path)

    def rewards() -> None:  # what building them refuses, and their models' bytes, loading none
        check_reward_inputs(cfg.reward)
        got["reward_bytes"] = estimated_reward_bytes(cfg.reward)

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
                len(prompts), cfg.data.prompts_per_rank, cfg.data.group_size, dp_rank=0, dp_size=facts.dims.dp
            )
        ),
        lambda: check_batch_source(cfg),  # e.g. SFT's video JSONL: every line and video
        rewards,
        lambda: check_image_rewards(cfg.reward, image_to_video),
    )
    summary = f"{len(prompts)} prompts from {prompt_file}" + (
        f" ({len(held_out)} held out from {cfg.eval.prompt_file})" if held_out else ""
    )
    weights = ", ".join(f"{name} {weight:g}" for name, weight in cfg.reward.weights.items())
    found["inputs"] = {
        "run_dir": run_dir,
        "resume_from": got["resume_from"],
        "model_fingerprint": got["fingerprint"],
        "prompts": prompts,
        "held_out": held_out,
        "reward_bytes": got["reward_bytes"],
        "summary": f"{summary}; rewards {weights}; run dir {run_dir}",
    }
    return errors


def _check_precision(cfg: Config, device_type: str) -> list[str]:
    """``rollout.precision``: fp8 needs CUDA sm >= 89, torchao, bf16 weights and a gathered rollout."""
    return check_rollout_precision(
        cfg.rollout.precision,
        device_type,
        model_dtype=cfg.model.dtype,
        rollout_unsharded=cfg.parallel.rollout_unsharded,
    )


def _check_attention_precision(cfg: Config, facts: PlanFacts) -> list[str]:
    """``rollout.attention_precision``: its kernel's package and GPU, bf16 weights, ring degree 1, no
    deterministic mode, a head dim the kernel has."""
    return check_attention_precision(
        cfg.rollout.attention_precision,
        facts.device_type,
        model_dtype=cfg.model.dtype,
        ring=facts.dims.ring,
        deterministic=cfg.parallel.deterministic_mode,
        head_dim=getattr(facts.model.transformers[0].config, "attention_head_dim", None),
    )
