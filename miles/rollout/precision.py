"""The rollout's arithmetic (``rollout.precision``): bf16, or float8 Linear layers through torchao.

With ``fp8`` the experts sample from a float8 copy of their transformer blocks' Linear layers:
while an expert is gathered for the rollout (``parallel.rollout_unsharded``), every Linear of its
blocks is swapped for a quantized copy (torchao's ``Float8DynamicActivationFloat8WeightConfig``,
per-row scales: the weight is quantized once, each activation on the fly) and swapped back when
the phase ends. The trained parameters are never modified: training, the KL reference and
evaluation stay bf16. The copy costs the blocks' Linear weights at 1 byte each on top of the
gathered bf16 expert.

What stays bf16: the patch embedding (a Conv3d), the time/text/image embedders, the output
projection and attention itself (cudnn SDPA); peft's LoRA adapters (the quantized base layer
plus the bf16 adapter is the LoRA policy in FP8). Only Linear layers whose in and out features are
multiples of 16 are quantized (``torch._scaled_mm``'s rule).

The sampling policy then differs slightly from the trained one; ``miles.algorithms.rollout_correction``
measures the gap and corrects the loss for it. FP8 needs CUDA compute capability >= 8.9
(H100/H200, L40S, RTX 4090) and torchao (``pip install -e '.[fp8]'``): :func:`check_rollout_precision`
refuses anything else at plan time, so the dry run refuses it too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from miles.blocks import transformer_blocks

__all__ = [
    "PRECISIONS",
    "check_rollout_precision",
    "fp8_linear",
    "fp8_or_keep",
    "quantizable_linears",
    "rollout_precision",
    "swapped_linears",
]

PRECISIONS = ("bf16", "fp8")
FP8_MIN_CAPABILITY = (8, 9)
_INSTALL = "pip install -e '.[fp8]' (torchao)"
ACTIVATION_AMAX_FLOOR = 1e-12  # the smallest per-row activation amax a float8 scale is computed from


def check_rollout_precision(
    precision: str,
    device_type: str,
    *,
    model_dtype: str,
    rollout_unsharded: bool,
    capability: tuple[int, int] | None = None,
    torchao_found: bool | None = None,
) -> list[str]:
    """Refuse (``ValueError`` naming the fix) a rollout precision this run cannot use; returns
    warnings for what cannot be checked here. ``capability``: the CUDA device's (default: the
    current device's when CUDA is visible); ``torchao_found``: default, whether it is importable."""
    if precision not in PRECISIONS:
        raise ValueError(f"rollout.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return []
    fix = "or set rollout.precision bf16"
    if device_type != "cuda":
        raise ValueError(
            f"rollout.precision fp8 needs a CUDA GPU of compute capability >= 8.9 (H100, H200, L40S); "
            f"this run is on {device_type}: run it on such a GPU {fix}"
        )
    if model_dtype != "bfloat16":
        raise ValueError(
            f"rollout.precision fp8 quantizes the bf16 rollout weights: set model.dtype bfloat16 {fix}"
        )
    if not rollout_unsharded:
        raise ValueError(
            "rollout.precision fp8 quantizes the gathered expert once per rollout: set "
            f"parallel.rollout_unsharded true {fix}"
        )
    if torchao_found is None:
        torchao_found = importlib.util.find_spec("torchao") is not None
    if not torchao_found:
        raise ValueError(f"rollout.precision fp8 needs torchao: {_INSTALL} {fix}")
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    if capability is None:
        return [
            "rollout.precision fp8: no CUDA device visible here to check its compute capability "
            "(FP8 needs >= 8.9: H100, H200, L40S); the run refuses it on an older GPU"
        ]
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"rollout.precision fp8 needs CUDA compute capability >= 8.9 (H100, H200, L40S); this GPU is "
            f"sm {capability[0]}{capability[1]}: use such a GPU {fix}"
        )
    return []


def quantizable_linears(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, linear)`` of every Linear inside ``module.blocks`` that FP8 takes: not a
    LoRA adapter, in and out features multiples of 16. The adapters must stay bf16: peft zero-
    initialises ``lora_B``, and a float8 row scale of a zero row is 0, so its quantized weight is
    0/0 = NaN (torchao computes the scale as amax / 448 with no floor)."""
    found = []
    for block in transformer_blocks(module):
        for path, parent in block.named_modules():
            if any(part.startswith("lora_") for part in path.split(".")):
                continue  # peft keeps its adapters in ModuleDicts: lora_A.default is a Linear too
            for name, child in parent.named_children():
                if (
                    type(child) is nn.Linear
                    and not name.startswith("lora_")
                    and child.in_features % 16 == 0
                    and child.out_features % 16 == 0
                ):
                    found.append((parent, name, child))
    return found


@contextlib.contextmanager
def swapped_linears(modules: Sequence[nn.Module], convert: Callable[[nn.Linear], nn.Module]) -> Iterator[int]:
    """Within the context, every :func:`quantizable_linears` layer of ``modules`` is replaced by
    ``convert(layer)``; the originals are put back on exit (also on error). Yields the count."""
    swaps = [(parent, name, lin) for m in modules for parent, name, lin in quantizable_linears(m)]
    try:
        for parent, name, lin in swaps:
            setattr(parent, name, convert(lin))
        yield len(swaps)
    finally:
        for parent, name, lin in swaps:
            setattr(parent, name, lin)


def fp8_linear(linear: nn.Linear, fast_accum: bool = True) -> nn.Module:
    """A float8 copy of ``linear`` (torchao, dynamic per-row activation and weight scales): its
    weight is the gathered one read once, never written. ``fast_accum``: torchao's default
    ``torch._scaled_mm`` mode (Hopper's FP8 accumulation without periodic promotion: faster, less
    exact over long inner dimensions); False accumulates as precisely as the hardware allows."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    with torch.device("meta"):
        copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    copy.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
    if linear.bias is not None:
        copy.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    # set_inductor_config would switch on coordinate-descent tuning for every compile in the process.
    # activation_value_lb: an all-zero activation row (zero-padded text tokens through a bias-free
    # projection) would get the scale 0 and quantize to 0/0 = NaN; the floor makes it 0, and leaves
    # every row whose amax is above it exactly as before.
    config = Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(),
        mm_config=Float8MMConfig(use_fast_accum=fast_accum),
        set_inductor_config=False,
        activation_value_lb=ACTIVATION_AMAX_FLOOR,
    )
    quantize_(copy, config)
    return copy


def fp8_or_keep(linear: nn.Linear, fast_accum: bool = True) -> nn.Module:
    """:func:`fp8_linear`, or ``linear`` itself (bf16) when a row of its weight is all zeros: that
    row's float8 scale would be 0 and its quantized weight NaN (a pruned or zero-initialised row)."""
    if bool((linear.weight.detach().abs().amax(dim=1) == 0).any()):
        return linear
    return fp8_linear(linear, fast_accum=fast_accum)


@contextlib.contextmanager
def rollout_precision(
    modules: Sequence[nn.Module], precision: str, *, fast_accum: bool = True
) -> Iterator[None]:
    """Sample with ``modules`` (gathered experts) in ``precision``: ``bf16`` changes nothing,
    ``fp8`` swaps their block Linear layers for :func:`fp8_linear` copies for the context
    (``fast_accum``: see there; the trainer keeps torchao's default)."""
    if precision == "bf16":
        yield
        return
    if precision != "fp8":
        raise ValueError(f"rollout.precision must be one of {PRECISIONS}, got {precision!r}")
    with torch.no_grad(), swapped_linears(modules, functools.partial(fp8_or_keep, fast_accum=fast_accum)):
        yield
