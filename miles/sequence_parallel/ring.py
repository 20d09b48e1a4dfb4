"""Ring attention over a process group with torch's ring templates and an aten kernel pair.

Each ring step attends the local queries to one rank's K/V chunk with a fused kernel that
returns the log-sum-exp (LSE); torch's ``_templated_ring_attention`` merges the partial
results with the online-softmax rule, and ``_templated_ring_attention_backward`` replays the
ring with the kernel's real backward. Non-causal only, so load balancing is switched off
for the duration of each call (torch's default of True raises for non-causal attention).

Kernels (``RING_KERNELS``), chosen by the call site's diffusers attention backend:

    backend                        CUDA tensors                          CPU tensors
    None, "native", "_native_flash" aten flash  (LSE (B, H, S))          aten flash_for_cpu
    "_native_cudnn"                 aten cudnn  (LSE (B, H, S, 1) -> squeezed)  aten flash_for_cpu
    anything else                   rejected by ``validate_sp_args``

``None``/``"native"`` map to flash: diffusers' default SDPA picks flash for these shapes
anyway, and flash has a stable LSE layout across torch versions. On CPU every accepted
backend runs the CPU flash pair (LSE (B, H, S), fp32, natural log), so the ring path runs in
CI. The templates are private torch API (torch >= 2.11); they are imported at the first
ring call, which raises ``ModuleNotFoundError`` with what to change if they are missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RING_BACKENDS",
    "RING_KERNELS",
    "CPU_RING_KERNEL",
    "RingKernel",
    "ring_attention",
    "select_ring_kernel",
]

aten = torch.ops.aten

_TEMPLATES_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


@dataclass(frozen=True)
class RingKernel:
    """A fused attention kernel pair in the calling convention of torch's ring templates.

    ``forward(query, key, value, *, is_causal, scale) -> (out, lse, extras)`` on (B, H, S, D)
    tensors with ``lse`` of shape (B, H, S); ``extras`` is a dict of keyword arguments the
    backward needs (identical for every ring step, since all chunks have the same shape).
    ``backward(*, grad_out, query, key, value, out, logsumexp, is_causal, scale, **extras)
    -> (dq, dk, dv)``.
    """

    name: str
    forward: Callable[..., tuple[Any, ...]]
    backward: Callable[..., tuple[Any, ...]]


def _flash_forward(query, key, value, *, is_causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, is_causal, False, scale=scale
    )
    extras = dict(
        cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, philox_seed=seed, philox_offset=offset
    )
    return out, lse, extras


def _flash_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, scale, **extras):
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(),
        query,
        key,
        value,
        out.contiguous(),
        logsumexp.contiguous(),
        extras["cum_seq_q"],
        extras["cum_seq_k"],
        extras["max_q"],
        extras["max_k"],
        0.0,
        is_causal,
        extras["philox_seed"],
        extras["philox_offset"],
        scale=scale,
    )


def _cudnn_forward(query, key, value, *, is_causal, scale):
    # cuDNN produces wrong results for non-contiguous inputs when called through aten.
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale
    )
    trailing = lse.dim() == 4
    if trailing:  # (B, H, S, 1) on torch >= 2.9 -> (B, H, S) like every other kernel
        lse = lse.squeeze(-1)
    extras = dict(
        cum_seq_q=cum_q,
        cum_seq_k=cum_k,
        max_q=max_q,
        max_k=max_k,
        philox_seed=seed,
        philox_offset=offset,
        lse_trailing_dim=trailing,
    )
    return out, lse, extras


def _cudnn_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, scale, **extras):
    lse = logsumexp.contiguous()
    if extras["lse_trailing_dim"]:
        lse = lse.unsqueeze(-1)
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out.contiguous(),
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        out.contiguous(),
        lse,
        extras["philox_seed"],
        extras["philox_offset"],
        None,
        extras["cum_seq_q"],
        extras["cum_seq_k"],
        extras["max_q"],
        extras["max_k"],
        0.0,
        is_causal,
        scale=scale,
    )


def _cpu_forward(query, key, value, *, is_causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    return out, lse, {}


def _cpu_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), query, key, value, out, logsumexp, 0.0, is_causal, scale=scale
    )


RING_KERNELS: dict[str, RingKernel] = {
    "_native_flash": RingKernel("_native_flash", _flash_forward, _flash_backward),
    "_native_cudnn": RingKernel("_native_cudnn", _cudnn_forward, _cudnn_backward),
}
CPU_RING_KERNEL = RingKernel("cpu_flash", _cpu_forward, _cpu_backward)

# Attention backends (diffusers ``AttentionBackendName`` values) accepted when ring > 1.
_RING_BACKEND_ALIASES: dict[str | None, str] = {None: "_native_flash", "native": "_native_flash"}
RING_BACKENDS: tuple[str | None, ...] = (None, "native", *RING_KERNELS)


def _backend_name(backend: Any) -> str | None:
    return getattr(backend, "value", backend)  # AttentionBackendName is a str Enum


def select_ring_kernel(backend: Any, device: torch.device) -> RingKernel:
    """The ring kernel for a diffusers attention backend name on ``device``."""
    name = _backend_name(backend)
    name = _RING_BACKEND_ALIASES.get(name, name)
    if name not in RING_KERNELS:
        raise ValueError(
            f"attention backend {_backend_name(backend)!r} has no ring kernel; with ring degree > 1 use one of "
            f"{list(RING_BACKENDS)} (--fsdp-attention-backend), or set --ulysses-degree equal to "
            f"--sequence-parallel-size (ring = 1), which works with any backend."
        )
    if device.type == "cpu":
        return CPU_RING_KERNEL
    return RING_KERNELS[name]


def _ring_templates():
    try:
        import importlib

        module = importlib.import_module(_TEMPLATES_MODULE)
    except ImportError as e:  # includes ModuleNotFoundError
        raise ModuleNotFoundError(
            f"ring attention (ring degree > 1) needs torch's ring templates ({_TEMPLATES_MODULE}), "
            f"available from torch 2.11 on; this is torch {torch.__version__}. Upgrade torch, or set "
            f"--ulysses-degree equal to --sequence-parallel-size (Ulysses only, no ring)."
        ) from e
    names = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise ImportError(
            f"torch {torch.__version__} lacks {missing} in {_TEMPLATES_MODULE}; ring attention needs "
            f"torch >= 2.11. Upgrade torch, or set --ulysses-degree equal to --sequence-parallel-size."
        )
    return module


@contextlib.contextmanager
def _load_balance_off(templates):
    # torch keeps this option in a module global; restore it so other users see no change.
    old = templates._cp_options.enable_load_balance
    templates._cp_options.enable_load_balance = False
    try:
        yield
    finally:
        templates._cp_options.enable_load_balance = old


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, kernel, scale):
        templates = _ring_templates()
        with _load_balance_off(templates):
            out, lse, extras = templates._templated_ring_attention(
                group, 2, kernel.forward, query, key, value, is_causal=False, scale=scale
            )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.kernel, ctx.scale, ctx.extras = group, kernel, scale, extras
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        templates = _ring_templates()
        with _load_balance_off(templates):
            dq, dk, dv, *_ = templates._templated_ring_attention_backward(
                ctx.group,
                2,
                ctx.kernel.backward,
                grad_out=grad_out.contiguous(),
                grad_out_name="grad_out",
                query=query,
                key=key,
                value=value,
                out=out,
                logsumexp=lse,
                is_causal=False,
                scale=ctx.scale,
                **ctx.extras,
            )
        return dq, dk, dv, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    backend: Any = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Non-causal attention of local queries over the K/V of every rank in ``group``.

    Layout (B, S_local, H, D) in and out (diffusers' layout); the kernels run on (B, H, S, D).
    """
    kernel = select_ring_kernel(backend, query.device)
    # (B, S, H, D) -> (B, H, S, D)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, group, kernel, scale)
    # (B, H, S, D) -> (B, S, H, D)
    return out.transpose(1, 2)
