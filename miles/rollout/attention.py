"""The rollout's self-attention arithmetic (``rollout.attention_precision``): bf16, or SageAttention's INT8.

``sage_int8`` samples with SageAttention 1 (Zhang et al. 2024, arXiv 2410.02367; the ``sageattention``
package, 1.0.6, pure Python + Triton, ``pip install -e '.[attn-lowp]'``): K is smoothed (its mean over
the sequence subtracted, which softmax ignores), Q and K are quantized to INT8 with one scale per block
of 128 query / 64 key tokens, QK^T runs on INT8 tensor cores, P and V in fp16. While a gathered expert
samples, the processors of its self-attention modules (``attn1`` of every block) are switched to the
diffusers backend name ``_sage_qk_int8_pv_fp16_triton`` — diffusers' own name for this arithmetic, whose
registry entry (written for SageAttention 2, which is not on PyPI) is pointed at this kernel once per
process — and switched back when the phase ends: the log-prob recompute, the backward, the KL reference
and evaluation stay bf16. Under USP the name reaches the local attention as ``backend=`` (ring = 1);
ring attention needs a kernel that returns the softmax's log-sum-exp, which this one does not, so
ring > 1 is refused. Cross-attention (text, image) stays bf16: 512 keys against the video's tens of
thousands, about 1.5% of the attention FLOPs at 32,760 tokens.

The sampling policy then differs slightly from the trained one, as with ``rollout.precision fp8``:
the same truncated importance weights correct the loss (``rollout.tis_cap``, docs/fp8_rollout.md).

:func:`sage_int8_reference` is the float formula of what the kernel computes, for the tests (CPU
plumbing, the GPU kernel's check); it is a reference, not a fast path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from miles.blocks import transformer_blocks

__all__ = [
    "ATTENTION_PRECISIONS",
    "KERNELS",
    "AttentionKernel",
    "check_attention_precision",
    "rollout_attention",
    "sage_int8_reference",
    "self_attention_processors",
]

ATTENTION_PRECISIONS = ("bf16", "sage_int8")
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]


def _quantize_int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, S, H, D) float -> the same values after SageAttention's per-block INT8 round trip: one scale
    amax / 127 per (batch, head, block of ``block`` tokens), rounded half away from zero."""
    b, s, h, d = x.shape
    pad = -s % block
    xb = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).reshape(b, (s + pad) // block, block, h, d)
    scale = xb.abs().amax(dim=(2, 4), keepdim=True) / 127.0
    q = xb / torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.trunc(q + 0.5 * torch.sign(q))  # the kernel's rounding: x + 0.5·sign(x), cast toward 0
    return (q * scale).reshape(b, s + pad, h, d)[:, :s]


def sage_int8_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *, quantize: bool = True
) -> torch.Tensor:
    """SageAttention 1's arithmetic in float32, (B, S, H, D) layout as diffusers calls a backend:
    K smoothed in the input dtype (minus its mean over the sequence, as the kernel's caller does),
    Q·scale·log2(e) and K each quantized to INT8 per block (128 query / 64 key tokens, one scale per
    batch, head and block), the scores exp2-softmaxed in float32, P and V rounded to fp16 and PV
    summed in fp16 within each block of 64 keys (the kernel's ``tl.dot(p, v, out_dtype=fp16)``),
    the blocks in float32, the output in the input dtype. The kernel's online softmax rounds P
    against a running max block by block; this takes the row's max at once, so the two differ at
    fp16 rounding, not at INT8's. ``quantize=False``: the same without the INT8 step (exact
    attention up to fp16 P and V: the smoothing leaves softmax unchanged)."""
    dtype = q.dtype
    b, s, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qf, kf, vf = q.float(), (k - k.mean(dim=1, keepdim=True)).float(), v.float()
    qf = qf * (scale * 1.4426950408889634)  # log2(e): the kernel's softmax is exp2
    if quantize:
        qf, kf = _quantize_int8_blocks(qf, 128), _quantize_int8_blocks(kf, 64)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf)
    p = torch.exp2(scores - scores.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.zeros(b, h, q.shape[1], d, dtype=torch.float32, device=q.device)
    for start in range(0, k.shape[1], 64):  # PV block by block, each block's sum rounded to fp16
        p16 = p[..., start : start + 64].half().float()
        v16 = vf[:, start : start + 64].half().float()
        out += torch.einsum("bhqk,bkhd->bhqd", p16, v16).half().float()
    return (out / denom).transpose(1, 2).to(dtype)


@functools.cache
def _sage_int8_kernel() -> Kernel:
    from sageattention import sageattn  # 1.0.6: the Triton kernels, CUDA only

    def attention(q, k, v, scale):
        # sageattn smooths K in place (k -= mean): smoothed here out of place, the caller's K untouched
        k = k - k.mean(dim=1, keepdim=True)
        return sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)

    return attention


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One ``rollout.attention_precision`` value: the kernel, where it comes from, what it needs."""

    name: str
    diffusers_backend: str  # the diffusers backend name the self-attention processors are switched to
    packages: tuple[str, ...]  # the import names checked at plan time
    extra: str  # pyproject's optional extra that pins it
    min_capability: tuple[int, int]
    head_dims: tuple[int, ...]
    load: Callable[[], Kernel]
    reference: Kernel


KERNELS = {
    "sage_int8": AttentionKernel(
        name="sage_int8",
        diffusers_backend="_sage_qk_int8_pv_fp16_triton",
        packages=("sageattention", "triton"),
        extra="attn-lowp",
        min_capability=(8, 0),  # Triton's INT8 tensor-core dot (A100, H100/H200, L40S)
        head_dims=(64, 96, 128),
        load=_sage_int8_kernel,
        reference=sage_int8_reference,
    ),
}


def _fix(precision: str) -> str:
    return f"or set rollout.attention_precision bf16 (it is {precision})"


def check_attention_precision(
    precision: str,
    device_type: str,
    *,
    model_dtype: str,
    ring: int,
    deterministic: bool,
    head_dim: int | None = None,
    package_found: bool | None = None,
    capability: tuple[int, int] | None = None,
    cuda_visible: bool | None = None,
) -> list[str]:
    """Refuse (``ValueError`` naming the fix) a rollout attention this run cannot use; the same in the
    dry run and the real run. What depends on the host (the package, the GPU's compute capability) is
    refused where a GPU is visible and a warning where the plan only assumes CUDA (a dry run on a CPU
    host). Defaults: ``package_found`` whether it imports here, ``capability`` the current device's,
    ``cuda_visible`` ``torch.cuda.is_available()``."""
    if precision not in ATTENTION_PRECISIONS:
        raise ValueError(
            f"rollout.attention_precision must be one of {ATTENTION_PRECISIONS}, got {precision!r}"
        )
    if precision == "bf16":
        return []
    kernel, fix = KERNELS[precision], _fix(precision)
    what = f"rollout.attention_precision {precision}"
    if device_type != "cuda":
        raise ValueError(f"{what} runs Triton kernels on a CUDA GPU; this run is on {device_type}: {fix}")
    if model_dtype != "bfloat16":
        raise ValueError(f"{what} replaces the bf16 rollout's attention: set model.dtype bfloat16 {fix}")
    if ring > 1:
        raise ValueError(
            f"{what} has no ring kernel (ring attention merges chunks by the softmax's log-sum-exp, which "
            f"SageAttention does not return) and this run's ring degree is {ring}: set --ulysses-degree equal "
            f"to --sequence-parallel-size (ring 1) {fix}"
        )
    if deterministic:
        raise ValueError(
            f"{what} with --deterministic-mode: a deterministic run holds the log-probs recomputed bit for bit "
            f"as rolled out, which an INT8 rollout breaks by design: drop --deterministic-mode {fix}"
        )
    if head_dim is not None and head_dim not in kernel.head_dims:
        raise ValueError(f"{what} supports head dims {kernel.head_dims}; this model's is {head_dim}: {fix}")
    cuda_visible = torch.cuda.is_available() if cuda_visible is None else cuda_visible
    if package_found is None:
        package_found = all(importlib.util.find_spec(name) is not None for name in kernel.packages)
    found: list[str] = []
    if not package_found:
        needs = " and ".join(kernel.packages)
        message = f"{what} needs {needs} (torch's CUDA wheels bring triton): pip install -e '.[{kernel.extra}]' {fix}"
        if cuda_visible:
            raise ValueError(message)
        found.append(f"{message} (not installed on this host, which has no GPU: checked again at startup)")
    if capability is None and cuda_visible:
        capability = torch.cuda.get_device_capability()
    cap = ".".join(map(str, kernel.min_capability))
    if capability is None:
        return found + [f"{what}: no CUDA device visible here to check its compute capability (>= {cap})"]
    if tuple(capability) < kernel.min_capability:
        raise ValueError(
            f"{what} needs CUDA compute capability >= {cap} (A100, H100, H200, L40S); this GPU is sm "
            f"{capability[0]}{capability[1]}: use such a GPU {fix}"
        )
    return found


def self_attention_processors(module: nn.Module) -> list:
    """The processors of the self-attention (``attn1``) of every block of ``module``: the attention
    that switches; cross-attention (``attn2``) keeps the compute dtype's backend."""
    found = []
    for block in transformer_blocks(module):
        attn = getattr(block, "attn1", None)
        if attn is not None and getattr(attn, "processor", None) is not None:
            found.append(attn.processor)
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no self-attention module named attn1 in its blocks: "
            "rollout.attention_precision cannot switch it; set rollout.attention_precision bf16"
        )
    return found


# The kernel each backend runs, set by :func:`rollout_attention` for its context. The function
# registered with diffusers reads it (under a compiled block that function is a graph break, so the
# compiled code guards on the processors' backend name only, never on this table or the registry).
_ACTIVE_KERNELS: dict[str, Kernel] = {}


def _backend_function(name: str) -> Callable[..., torch.Tensor]:
    """The function diffusers' dispatch calls for ``name``'s backend: the arguments diffusers passes
    (it keeps only the parameters named here), refusing what the kernel cannot do."""

    @torch.compiler.disable
    def lowp_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if attn_mask is not None or dropout_p or is_causal:
            raise ValueError(
                f"rollout.attention_precision {name}: self-attention without a mask, dropout or causality "
                "only; set rollout.attention_precision bf16"
            )
        kernel = _ACTIVE_KERNELS.get(name)
        if kernel is None:
            raise RuntimeError(f"the {name} attention backend was called outside rollout_attention")
        return kernel(query, key, value, scale)

    return lowp_attention


@functools.cache
def _registered(name: str):
    """Register ``name``'s backend function under its diffusers backend name, once per process (the
    same function object for every rollout: nothing for a compiled block to re-guard); returns the
    diffusers backend member the processors are switched to. Diffusers' own entry for that name
    calls SageAttention 2 (not on PyPI), which this process never runs."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    member = AttentionBackendName(KERNELS[name].diffusers_backend)
    _AttentionBackendRegistry.register(member)(_backend_function(name))
    return member


@contextlib.contextmanager
def rollout_attention(
    modules: Sequence[nn.Module], precision: str, *, kernel: Kernel | None = None
) -> Iterator[None]:
    """Sample with the self-attention of ``modules`` (gathered experts) in ``precision``: ``bf16``
    changes nothing; else every ``attn1`` processor runs the low-precision kernel for the context
    and gets its own backend back on exit (also on error). ``kernel``: a stand-in (the tests' float
    reference on CPU); default the package's kernel."""
    if precision == "bf16":
        yield
        return
    if precision not in KERNELS:
        raise ValueError(
            f"rollout.attention_precision must be one of {ATTENTION_PRECISIONS}, got {precision!r}"
        )
    spec = KERNELS[precision]
    processors = [p for m in modules for p in self_attention_processors(m)]
    # (processor, had an instance attribute, its backend): diffusers' default lives on the class
    saved = [(p, "_attention_backend" in vars(p), getattr(p, "_attention_backend", None)) for p in processors]
    name = _registered(precision)
    previous = _ACTIVE_KERNELS.get(precision)
    _ACTIVE_KERNELS[precision] = kernel if kernel is not None else spec.load()
    try:
        for p in processors:
            p._attention_backend = name
        yield
    finally:
        for p, had_own, backend in saved:
            if had_own:
                p._attention_backend = backend
            else:
                del p._attention_backend
        if previous is None:
            del _ACTIVE_KERNELS[precision]
        else:
            _ACTIVE_KERNELS[precision] = previous
