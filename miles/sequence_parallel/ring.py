"""Ring attention over a process group with torch's ring templates and an aten kernel pair.

Each ring step attends the local queries to one rank's K/V chunk with a fused kernel that
returns the log-sum-exp (LSE); torch's ``_templated_ring_attention`` merges the partial
results with the online-softmax rule, and ``_templated_ring_attention_backward`` replays the
ring with the kernel's real backward. Non-causal only, so load balancing is switched off
for the duration of each call (torch's default of True raises for non-causal attention).

Padded sequences: the templates rotate fixed-shape K/V buffers, so a sequence of S real
tokens in ``ring`` chunks of n carries its trailing pads in the last chunk(s). The kernel
wrapper given to the templates (``_PaddedRingStep``, a fresh one per forward and per backward)
counts its calls: call i attends to the chunk of ring rank src = (rank - i) mod ring, whose
real length is L = clamp(S - src·n, 0, n). It cuts K/V to L before the kernel (forward) and
zero-pads dK/dV back to n (backward). A chunk of pads only (L = 0) contributes out = 0,
lse = -inf, which the online-softmax merge leaves bitwise unchanged. A rank whose own chunk is
all pads has pad queries only: it skips the kernel and returns finite zeros (its outputs are
dropped, and its output gradient is zero).

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
import torch.nn.functional as F

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
    backward needs (identical for every ring step except ``max_q``/``max_k``, which the ring
    sets per step from the actual shapes).
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


class _PaddedRingStep:
    """The kernel of one ring forward or backward, called once per ring step by the templates.

    ``seq_len``: the real length S of the ring's ring·n tokens (None: no pads). See the module
    docstring for what it does with the pads.
    """

    def __init__(self, kernel: RingKernel, rank: int, size: int, chunk: int, seq_len: int | None):
        self.kernel, self.rank, self.size, self.chunk, self.seq_len = kernel, rank, size, chunk, seq_len
        self.step = 0
        self.extras: dict[str, Any] = {}

    def _real_length(self, ring_rank: int) -> int:
        if self.seq_len is None:
            return self.chunk
        return min(max(self.seq_len - ring_rank * self.chunk, 0), self.chunk)

    def _next(self) -> tuple[int, int]:
        """(real length of this rank's queries, real length of this step's K/V chunk)."""
        src = (self.rank - self.step) % self.size  # the templates pass K/V from rank - 1 each step
        self.step += 1
        return self._real_length(self.rank), self._real_length(src)

    def forward(self, query, key, value, *, is_causal, scale):
        own, length = self._next()
        if own == 0 or length == 0:
            b, h, s, d = query.shape
            out = query.new_zeros(b, h, s, value.shape[-1])
            # Pad queries only: any finite value (0). Pad keys only: lse = -inf, a no-op in the merge.
            fill = 0.0 if own == 0 else float("-inf")
            lse = torch.full((b, h, s), fill, dtype=torch.float32, device=query.device)
            return out, lse, self.extras
        if length < self.chunk:
            # (B, H, n, D) -> (B, H, L, D): the real keys of this chunk
            key, value = key[:, :, :length].contiguous(), value[:, :, :length].contiguous()
        out, lse, self.extras = self.kernel.forward(query, key, value, is_causal=is_causal, scale=scale)
        return out, lse, self.extras

    def backward(self, *, grad_out, query, key, value, out, logsumexp, is_causal, scale, **extras):
        own, length = self._next()
        if own == 0 or length == 0:
            return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        if length < self.chunk:
            key, value = key[:, :, :length].contiguous(), value[:, :, :length].contiguous()
        if "max_k" in extras:  # shapes of this step (varlen-only for the CUDA kernels, kept honest)
            extras = dict(extras, max_q=query.shape[2], max_k=length)
        dq, dk, dv, *_ = self.kernel.backward(
            grad_out=grad_out,
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=logsumexp,
            is_causal=is_causal,
            scale=scale,
            **extras,
        )
        if length < self.chunk:
            # (B, H, L, D) -> (B, H, n, D): pad keys get no gradient
            dk, dv = (F.pad(t, (0, 0, 0, self.chunk - length)) for t in (dk, dv))
        return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, kernel, scale, seq_len):
        templates = _ring_templates()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        step = _PaddedRingStep(kernel, rank, size, query.shape[2], seq_len)
        with _load_balance_off(templates):
            out, lse, extras = templates._templated_ring_attention(
                group, 2, step.forward, query, key, value, is_causal=False, scale=scale
            )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.kernel, ctx.scale, ctx.extras, ctx.seq_len = group, kernel, scale, extras, seq_len
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        templates = _ring_templates()
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        step = _PaddedRingStep(ctx.kernel, rank, size, query.shape[2], ctx.seq_len)
        with _load_balance_off(templates):
            dq, dk, dv, *_ = templates._templated_ring_attention_backward(
                ctx.group,
                2,
                step.backward,
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
        return dq, dk, dv, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    backend: Any = None,
    scale: float | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Non-causal attention of local queries over the K/V of every rank in ``group``.

    Layout (B, n, H, D) in and out (diffusers' layout); the kernels run on (B, H, n, D). Rank r
    holds tokens [r·n, (r+1)·n) of a ring·n sequence; ``seq_len`` (None: ring·n) is the real
    length S: keys at positions >= S are excluded, outputs there are don't-care.
    """
    kernel = select_ring_kernel(backend, query.device)
    # (B, n, H, D) -> (B, H, n, D)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, group, kernel, scale, seq_len)
    # (B, H, n, D) -> (B, n, H, D)
    return out.transpose(1, 2)
