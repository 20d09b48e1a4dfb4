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
All of it is the run plan (:func:`miles.train.plan.plan_run`), the very one the trainer runs:
this module only prints it.

World size: ``--world-size`` > ``$WORLD_SIZE`` > 1.

Memory per rank (GiB; an ESTIMATE, not a measurement). Everything but the training activations
comes from :class:`miles.train.memory_budget.ResidentMemory`, the terms the trainer fits its
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
             eager 54·D + 4·F); eager blocks keep 32·D more with per-token timesteps (Wan2.2 TI2V:
             the fp32 shift/scale/gate products of the bf16 (B, S, 6, D)
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

train peak = weights + optimizer + EMA + old policy + reference + text encoder + VAE + reward
models + buffers + gradients + in flight + activations; rollout peak = the same persistent terms +
max(one gathered expert + rollout working set, VAE decode). The reward models' bytes are estimated
from their weight files (the trainer counts them as loaded). Not counted: attention kernel
workspaces and communication buffers — what the 5% slack is for.
"""

from __future__ import annotations

from typing import Any

from miles.train.memory_budget import block_bytes_per_token as _block_bytes_per_token
from miles.train.plan import PlanError, RunPlan, plan_run
from miles.train.prompt_checks import truncation_warnings

__all__ = ["DryRunError", "dry_run", "format_report"]

_SHOW_GROUPS = 4  # groups printed per kind before "... (N groups)"
_SHOW_RANKS = 8  # ranks printed per group before eliding

DryRunError = PlanError  # the run as configured would be refused at startup; the message names the fix
_ = _block_bytes_per_token  # the coefficients of the module docstring (tests measure them)


def dry_run(
    cfg,
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
    plan = plan_run(cfg, world_size, local_world_size=local_world_size, device_type=device_type)
    plan.warnings += _truncation_warnings(plan)
    if verbose:
        print(format_report(plan), flush=True)
    return plan.report()


def _truncation_warnings(plan: RunPlan) -> list[str]:
    """The prompts the text encoder will cut short, counted with the model folder's tokenizer (a
    folder without one is already reported as one the real run refuses); the real run warns alike
    (:func:`miles.train.prompt_checks.warn_truncated_prompts`)."""
    tokenizer_dir = plan.model.path / "tokenizer"
    if not tokenizer_dir.is_dir():
        return []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return truncation_warnings(plan.cfg, tokenizer, plan.prompts, plan.held_out)


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


def format_report(rep: RunPlan | dict[str, Any]) -> str:
    """The readable form of a run plan (or of the :func:`dry_run` report)."""
    if isinstance(rep, RunPlan):
        rep = rep.report()
    m, mesh = rep["model"], rep["mesh"]
    experts = f"{m['num_experts']} x {m['transformer_class']}"
    if m["expert_switch"]:
        experts += f", {m['expert_switch']}"
    lines = [
        "miles dry run: no GPU, no torch.distributed, no weights loaded",
        f"model     {m['path']} ({m['pipeline']}: {experts})",
        f"          {m['num_attention_heads']} heads x {m['attention_head_dim']} = hidden {m['hidden_size']}, "
        f"{m['num_layers']} layers, ffn {m['ffn_dim']}, text_dim {m['text_dim']}, patch {tuple(m['patch_size'])}"
        + (f", {m['timestep_layout']}" if m["timestep_layout"] else "")
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
        only = ""
        if row["module"] == "" and row["what"] == "input 'timestep'":
            only = f" (only when {row['expected_dims']}-D: per-token timesteps)"
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
        f"{seq['micro_batch']}{cfg_note} per forward; {seq['num_sde_steps']} SDE steps trained"
        + _precision_note(seq),
        f"schedule  {seq['schedule']}",
    ]


def _precision_note(seq: dict) -> str:
    linears, attention = seq.get("rollout_precision", "bf16"), seq.get("rollout_attention_precision", "bf16")
    if linears == attention == "bf16":
        return ""
    cap = seq["tis_cap"]
    fix = f"bf16 old log-probs, importance weights capped at {cap:g}" if cap else "no correction (tis_cap 0)"
    what = " + ".join(
        [linears] * (linears != "bf16") + [f"{attention} self-attention"] * (attention != "bf16")
    )
    return f"; rollout in {what} ({fix})"


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
        f"memory    per rank, GiB (an estimate; {par['dtype']} compute; formulas in miles/train/memory_budget.py)",
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
        ("decode_beside_rollout", "VAE decode beside the rollout (overlap)"),
        ("buffers", "rollout buffers"),
        ("text_encoder", "text encoder (resident unless offloaded)"),
        ("vae", "VAE"),
        ("rewards", "reward models (from their weight files)"),
    ]
    for key, label in labels:
        lines.append(f"  {label:<42} {mem[key]:10.3f}")
    lines.append(f"  {'= train peak':<42} {mem['train_peak']:10.3f}")
    lines.append(f"  {'= rollout peak':<42} {mem['rollout_peak']:10.3f}")
    if mem["allocator_slack"]:
        lines.append(f"  {'+ allocator slack (5% of the budget)':<42} {mem['allocator_slack']:10.3f}")
    return lines
