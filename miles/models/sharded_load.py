"""Sharded loading of the Wan transformers: no rank ever holds a whole expert.

    skeleton = build_skeleton(path, "transformer")        # meta parameters, real RoPE buffers
    adapters = add_lora(skeleton, lora_config)             # peft's own draw, captured on the CPU
    ... install SP, fully_shard (as the trainer does) ...
    materialize(skeleton, device, source=WeightFiles(path / "transformer"), adapters=adapters)

``build_skeleton`` builds the model from its ``config.json`` with its parameters on the meta
device (accelerate's ``init_empty_weights(include_buffers=False)``, as diffusers'
``from_pretrained`` does), so its non-persistent buffers (RoPE tables) are computed for real on
the CPU. LoRA is applied on the skeleton: peft draws each adapter on the CPU and only then moves
it to its base layer's (meta) device; :func:`add_lora` keeps that draw, so the adapters are
bitwise those of LoRA applied to a loaded model, with the same RNG consumption. After SP and
FSDP2 are installed, :func:`materialize` allocates each rank's local shards (``to_empty``),
puts the buffers back and fills every local shard by reading only its slice of the safetensors
files (``safe_open(...).get_slice``), at the offsets of the parameter's DTensor placements
(``compute_local_shape_and_global_offset``: flat FSDP and 2-D HSDP meshes alike). A rank reads
1/shards of each expert; host memory per node stays near one copy of the file's weights.

``RandomInit`` fills the local shards with deterministic random weights instead (``model.init:
random``): each block of rows of a parameter is drawn from its own generator seeded by the run
seed, the parameter's name and the block, so the weights do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
# name parts that wrappers add to parameter names (activation checkpointing, torch.compile, peft)
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def transformer_class(path: Path, subfolder: str) -> type:
    """The diffusers class ``model_index.json`` names for ``subfolder`` (WanTransformer3DModel...)."""
    import diffusers

    info = json.loads((path / "model_index.json").read_text())
    entry = info.get(subfolder)
    if not entry or entry[0] is None:
        raise ValueError(f"{path}/model_index.json names no '{subfolder}' component")
    cls = getattr(diffusers, entry[1], None)
    if cls is None:
        raise ValueError(f"{path}/model_index.json: diffusers has no class {entry[1]} for '{subfolder}'")
    return cls


def build_skeleton(path: Path, subfolder: str) -> nn.Module:
    """The transformer in ``path/subfolder`` built from its config.json: fp32 parameters on the meta
    device, buffers real on the CPU. Reads no weight file and draws no random numbers."""
    from accelerate import init_empty_weights

    cls = transformer_class(path, subfolder)
    config = cls.load_config(path / subfolder)
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    return model


@contextlib.contextmanager
def _capture_adapters():
    """Record each adapter peft draws on the CPU before it moves it to a meta base layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    captured: list[tuple[nn.Module, str, torch.Tensor]] = []
    original = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def move(self, adapter_name, device=None):
        for layer_name in self.adapter_layer_names:
            layer = getattr(self, layer_name, None)
            if isinstance(layer, nn.ModuleDict) and adapter_name in layer:
                for n, p in layer[adapter_name].named_parameters():
                    if not p.is_meta:
                        captured.append((self, f"{layer_name}.{adapter_name}.{n}", p.detach().clone()))
        return original(self, adapter_name, device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    try:
        yield captured
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original


def add_lora(model: nn.Module, lora_config) -> dict[str, torch.Tensor]:
    """``model.add_adapter(lora_config)`` on a (meta) skeleton; returns the adapters' full initial
    values by parameter name (CPU, as peft drew them) for :func:`materialize`."""
    with _capture_adapters() as captured:
        model.add_adapter(lora_config)
    names = {id(m): name for name, m in model.named_modules()}
    return {f"{names[id(m)]}.{suffix}": value for m, suffix, value in captured}


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen parameters in ``dtype`` but for those diffusers keeps in fp32
    (``_keep_in_fp32_modules``), as ``from_pretrained(dtype=...)`` loads them. Trainable ones keep
    their dtype (fp32 masters)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, p in model.named_parameters():
        if not p.requires_grad and p.is_floating_point() and not keep.intersection(name.split(".")):
            p.data = p.data.to(dtype)


def clean_name(name: str) -> str:
    """A parameter's name without the parts wrappers add (its name in the unwrapped model)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def file_key(name: str) -> str:
    """The safetensors key of a (cleaned) parameter name: peft's ``base_layer`` removed."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


class WeightFiles:
    """The safetensors weights of one diffusers component folder: a single
    ``diffusion_pytorch_model.safetensors`` or a sharded one with its ``.index.json``."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        if (folder / INDEX_NAME).is_file():
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            self.files = {key: folder / file for key, file in weight_map.items()}
        elif (folder / WEIGHTS_NAME).is_file():
            from safetensors import safe_open

            with safe_open(folder / WEIGHTS_NAME, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), folder / WEIGHTS_NAME)
        else:
            raise ValueError(
                f"{folder} has neither {WEIGHTS_NAME} nor {INDEX_NAME}: no weights to load "
                "(model.init: random builds from the config alone)"
            )
        self.folder = folder
        self._open: dict[Path, object] = {}

    def read(
        self, key: str, offset: tuple[int, ...], shape: tuple[int, ...], full_shape, device
    ) -> torch.Tensor:
        """The block ``[offset, offset + shape)`` of tensor ``key`` (global shape ``full_shape``),
        read alone from its file."""
        from safetensors import safe_open

        if key not in self.files:
            raise ValueError(f"{self.folder}: the weights have no tensor {key!r}")
        file = self.files[key]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        sl = self._open[file].get_slice(key)
        if list(sl.get_shape()) != list(full_shape):
            raise ValueError(
                f"{self.folder}: {key} has shape {sl.get_shape()} in the file, the model's is {list(full_shape)}"
            )
        if len(full_shape) == 0:
            return self._open[file].get_tensor(key)
        return sl[tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def close(self) -> None:
        self._open.clear()


@dataclass(frozen=True)
class RandomInit:
    """Deterministic random weights (``model.init: random``): matrices N(0, 1/fan_in), 1-D
    weights (norm scales) 1, biases 0; drawn per block of rows from a generator seeded by
    (seed, name, block), so the same whatever the layout."""

    seed: int
    salt: str = ""  # e.g. the expert's subfolder: two experts get different weights
    block_numel: int = 1 << 20

    def read(
        self, key: str, offset: tuple[int, ...], shape: tuple[int, ...], full_shape, device
    ) -> torch.Tensor:
        if len(full_shape) < 2:
            value = 0.0 if key.endswith("bias") else 1.0
            return torch.full(shape, value, device=device, dtype=torch.float32)
        rest = math.prod(full_shape[1:])
        rows = max(1, self.block_numel // rest)
        first, last = offset[0], offset[0] + shape[0]
        parts = []
        for block in range(first // rows, -(-last // rows)):
            lo = block * rows
            n = min(rows, full_shape[0] - lo)
            g = torch.Generator(device=device)
            g.manual_seed(zlib.crc32(f"{self.seed}/{self.salt}/{key}/{block}".encode()))
            full = torch.empty((n, *full_shape[1:]), device=device).normal_(0.0, rest**-0.5, generator=g)
            parts.append(full[max(first - lo, 0) : min(last - lo, n)])
        out = torch.cat(parts) if parts else torch.empty((0, *full_shape[1:]), device=device)
        return out[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))]


def local_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of ``param`` (a DTensor, or a plain
    tensor: the whole of it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.dim()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    source: WeightFiles | RandomInit,
    adapters: dict[str, torch.Tensor] | None = None,
) -> None:
    """Allocate the local shards of a sharded skeleton on ``device`` and fill them: adapters from
    ``adapters`` (:func:`add_lora`), every other parameter and persistent buffer from ``source``.
    Non-persistent buffers (RoPE tables) keep the values they were built with."""
    adapters = adapters or {}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    meta = [name for name, b in buffers.items() if b.is_meta]
    if meta:
        raise ValueError(f"buffers {meta[:3]} are on the meta device: build the model with build_skeleton")
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    for name, param in model.named_parameters():
        clean = clean_name(name)
        shape, offset = local_block(param)
        local = _local(param)
        assert tuple(local.shape) == shape, (name, local.shape, shape)
        if local.numel() == 0:
            continue
        if clean in adapters:
            full = adapters[clean]
            value = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        else:
            value = source.read(file_key(clean), offset, shape, tuple(param.shape), device)
        local.copy_(value)
    persistent = {n for n, _ in model.named_buffers()} & set(model.state_dict())
    for name in sorted(persistent):
        b = model.get_buffer(name)
        key = file_key(clean_name(name))
        if isinstance(source, WeightFiles) and key in source.files:
            b.copy_(source.read(key, (0,) * b.dim(), tuple(b.shape), tuple(b.shape), device))
    if isinstance(source, WeightFiles):
        source.close()


@torch.no_grad()
def copy_local_shards(dst: nn.Module, src: nn.Module) -> None:
    """Copy every parameter's local shard of ``src`` into ``dst`` (built and sharded alike; ``dst``
    may store them in another dtype) after allocating ``dst``'s shards on ``src``'s device. The
    old policy and the KL reference are made this way: no rank holds a whole expert."""
    device = next(src.parameters()).device
    buffers = {name: b.detach().clone() for name, b in dst.named_buffers()}
    dst.to_empty(device=device)
    for name, b in dst.named_buffers():
        b.copy_(buffers[name])
    # by unwrapped name: the source's blocks may carry activation-checkpointing wrappers the copy lacks
    srcs = {clean_name(n): p for n, p in src.named_parameters()}
    for name, p in dst.named_parameters():
        s = srcs.get(clean_name(name))
        if s is None or s.shape != p.shape:
            raise ValueError(f"the copy's parameter {name} {tuple(p.shape)} has no twin in the source")
        if hasattr(p, "placements") and (p.placements != s.placements or p.device_mesh != s.device_mesh):
            raise ValueError(f"{name} is sharded unlike its source ({p.placements} vs {s.placements})")
        _local(p).copy_(_local(s.detach()))
