"""The run plan's sequence-parallel part: the attention backend, the ring kernel and the model's SP
plan, checked as the trainer installs them (``miles.train.plan`` gathers it with the other parts).

It reads the config by field (``cfg.parallel``, ``cfg.model.dtype``) and the plan's facts
(``facts.dims``: the mesh, ``facts.model``: the family's meta model, ``facts.device_type``), and
raises ``ValueError`` naming the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.parallel.topology import ParallelDims

__all__ = ["HALF_ONLY_BACKENDS", "check_ring_dtype", "default_attention_backend", "sp_plan_report"]

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


def check_backend(backend: str | None, cfg, device_type: str) -> None:
    """An explicit ``--fsdp-attention-backend`` this run cannot use on CUDA, refused naming the fix."""
    if device_type != "cuda":
        return
    if cfg.model.dtype == "float32" and backend in HALF_ONLY_BACKENDS:
        raise ValueError(
            f"--fsdp-attention-backend {backend} has no float32 kernel (model.dtype float32): set "
            "model.dtype bfloat16, or leave --fsdp-attention-backend unset (float32: diffusers' native SDPA)"
        )
    if cfg.parallel.deterministic_mode and backend == "_native_cudnn":
        raise ValueError(
            "--fsdp-attention-backend _native_cudnn with --deterministic-mode: torch's deterministic mode "
            "excludes cudnn attention; leave --fsdp-attention-backend unset (deterministic runs then use "
            "_native_flash) or drop --deterministic-mode"
        )


def check_ring_dtype(cfg, dims: ParallelDims, device_type: str) -> list[str]:
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
        raise ValueError(message)
    return [f"{message} (this plan assumed CUDA; on CPU the ring runs its float32 kernel)"]


def _sp_plan_rows(model, transformer: nn.Module) -> tuple[list[dict], str]:
    """The boundaries of the family's SP plan for ``transformer`` as rows, and the plan's source."""
    from miles.sequence_parallel import GatherOutput, ShardInput, ShardOutput

    plan = model.sequence_parallel_plan(transformer)
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
    return rows, plan.source


def sp_plan_report(cfg, facts) -> dict:
    """The SP plan's boundaries, the attention backend and the ring kernel, checked as the trainer
    checks them (``facts``: ``dims``, ``model``, ``device_type``)."""
    from miles.sequence_parallel import validate_sp_args
    from miles.sequence_parallel.ring import select_ring_kernel

    p, dims, model, device_type = cfg.parallel, facts.dims, facts.model, facts.device_type
    backend = p.fsdp_attention_backend or default_attention_backend(
        torch.device(device_type), cfg.model.dtype, p.deterministic_mode
    )
    check_backend(backend, cfg, device_type)
    backend_note = "--fsdp-attention-backend" if p.fsdp_attention_backend else f"default on {device_type}"
    try:
        validate_sp_args(dims, backend, model_backend=model)
    except ValueError as e:
        raise ValueError(f"invalid sequence-parallel setup: {e}") from None
    plan_rows: list[dict] = []
    plan_error, plan_source = None, ""
    for i, transformer in enumerate(model.transformers):
        try:
            rows, source = _sp_plan_rows(model, transformer)
        except (ValueError, TypeError) as e:
            if dims.sp > 1:
                raise ValueError(f"expert {i} has no usable sequence-parallel plan: {e}") from None
            plan_error, rows, source = str(e), [], f"{type(transformer).__name__}._cp_plan"
        if i == 0:
            plan_rows, plan_source = rows, source
    ring_kernel = None
    if dims.ring > 1:
        ring_kernel = {
            device_type: select_ring_kernel(backend, torch.device(device_type)).name,
            "cpu": select_ring_kernel(backend, torch.device("cpu")).name,
        }
    return {
        "enabled": dims.sp > 1,
        "source": plan_source,
        "boundaries": plan_rows,
        "error": plan_error,
        "attention_backend": backend,
        "attention_backend_note": backend_note,
        "ring_kernel": ring_kernel,
    }
