"""Export the trained transformer(s) as a diffusers folder that the model's pipeline class loads.

    run_dir/export/pipeline/     full fine-tune: the whole pipeline with the trained transformer(s)
    run_dir/export/lora/<expert>/  LoRA: the adapter of each expert (diffusers LoRA format)
                                 (<expert>: the model family's expert folders, Wan: transformer, transformer_2)
    run_dir/export/merged/       LoRA: the pipeline with the adapters merged into the weights

Streaming: one expert at a time, one tensor at a time. Every rank gathers each (FSDP2-sharded)
tensor in turn (``DTensor.full_tensor``); rank 0 casts it to the compute dtype (the modules the
transformer class keeps in fp32 stay fp32, as ``from_pretrained(torch_dtype=...)`` loads them) and
writes it straight into a safetensors file whose header was written first from the shapes alone.
So rank 0 holds about one tensor more than training, never a model. Files over 10 GB are split
into shards with an index, as diffusers' ``save_pretrained`` names them. The pipeline's other
components (text encoder, VAE, tokenizer, scheduler, ``model_index.json``) are hard-linked from the
model folder (copied where a link is impossible or the file's mode differs from what the umask
grants), not re-saved. LoRA: only the adapters are gathered; the merged weights are computed tensor
by tensor from the model folder's base files in fp32 (W + scaling · B A, as peft's merge computes it)
and rounded once to the output dtype.

The folder is written under a temporary name and renamed when complete. ``export_pipeline_gathered``
is the former path (gather the full fp32 state, rebuild the pipeline on rank 0, ``save_pretrained``):
kept as the reference the streaming export is tested against, and for the bench.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from miles.config import Config
from miles.models.dtypes import DTYPES
from miles.models.family import family_of

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
MAX_SHARD_BYTES = 10 * 10**9  # diffusers' save_pretrained default ("10GB")
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ExportWriteError(RuntimeError):
    """The export could not be written (disk full, read-only run directory); no ``.partial`` is left."""


def _dtype(cfg: Config) -> torch.dtype:
    return DTYPES[cfg.model.dtype]


def export_pipeline(cfg: Config, model_path: Path, experts: list[nn.Module], out_dir: Path) -> Path | None:
    """Collective (every rank gathers, tensor by tensor); rank 0 writes ``out_dir``. Returns the
    folder on rank 0, None elsewhere. A write error on rank 0 is raised after the last gather, so the
    other ranks never wait on it."""
    out_dir, family = Path(out_dir), family_of(model_path)
    writer = _Writer(out_dir) if dist.get_rank() == 0 else None
    for name, expert in zip(family.expert_folders, experts):
        if cfg.model.lora_rank > 0:
            _export_lora_expert(cfg, Path(model_path), name, expert, writer, family)
        else:
            _write_transformer(writer, name, expert, _trained_tensors(expert, _dtype(cfg)), model_path)
    if writer is None:
        return None
    writer.run(
        lambda: _link_components(
            Path(model_path), writer.tmp / writer.pipeline_dir(cfg), family.expert_folders
        )
    )
    writer.finish()
    return out_dir


class _Writer:
    """Rank 0's side of an export: the ``.partial`` folder, and the first OS error (later writes are
    skipped, the gathers go on) raised as :class:`ExportWriteError` by :meth:`finish`."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.tmp = out_dir.with_name(out_dir.name + ".partial")
        self.error: OSError | None = None
        self.run(self._start)

    def _start(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)

    @staticmethod
    def pipeline_dir(cfg: Config) -> str:
        return "merged" if cfg.model.lora_rank > 0 else "pipeline"

    def run(self, fn, *args):
        if self.error is None:
            try:
                return fn(*args)
            except OSError as e:
                self.error = e
        return None

    def finish(self) -> None:
        if self.error is None:
            self.run(self._commit)
        if self.error is not None:
            e = self.error
            shutil.rmtree(self.tmp, ignore_errors=True)
            reason = f"{e.strerror}: {e.filename}" if e.strerror else str(e)
            raise ExportWriteError(
                f"could not write the export {self.out_dir} ({reason}). The final checkpoint is saved: free "
                "space or make the run directory writable, then relaunch the same command with "
                "--train.num-rollouts unchanged to export again"
            )

    def _commit(self) -> None:
        readable_by_umask(self.tmp)
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp, self.out_dir)


def _keep_fp32(module: nn.Module) -> set[str]:
    return set(getattr(module, "_keep_in_fp32_modules", None) or [])


def _out_dtype(name: str, tensor_dtype: torch.dtype, dtype: torch.dtype, keep: set[str]) -> torch.dtype:
    """The dtype ``from_pretrained(torch_dtype=dtype)`` gives the tensor ``name`` (see
    :func:`cast_like_from_pretrained`)."""
    if tensor_dtype.is_floating_point and not keep.intersection(name.split(".")):
        return dtype
    return tensor_dtype


def _full(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: the whole tensor on CPU (every rank gets it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu()


def _trained_tensors(expert: nn.Module, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype, callable]]:
    """(name, shape, output dtype, produce) for every tensor of ``expert``'s state dict, in order;
    ``produce()`` is the collective gather + cast. The state dict holds the module's own (sharded)
    tensors under their canonical names: nothing is copied until ``produce`` runs."""
    keep = _keep_fp32(expert)
    state = get_model_state_dict(expert)
    plan = []
    for name, t in state.items():
        out = _out_dtype(name, t.dtype, dtype, keep)
        plan.append((name, tuple(t.shape), out, lambda t=t, out=out: _full(t).to(out)))
    return plan


def _write_transformer(
    writer: _Writer | None, name: str, expert: nn.Module, plan: list, model_path: Path
) -> None:
    """Every rank runs the gathers of ``plan``; rank 0 writes ``<pipeline>/<name>`` (config + weights)."""
    folder = None
    if writer is not None:
        folder = writer.tmp / ("merged" if _is_lora(expert) else "pipeline") / name
        writer.run(_start_component, Path(model_path) / name, folder)
    shards = _shard_plan([(n, shape, dt) for n, shape, dt, _ in plan])
    producers = {n: produce for n, _, _, produce in plan}
    for file, entries in shards.items():
        tensors = (producers[n]() for n, _, _ in entries)
        if writer is None or writer.error is not None:
            for _ in tensors:  # the collectives, with nothing to write
                pass
            continue
        write_safetensors(folder / file, entries, tensors, on_error=writer)
    if writer is not None and len(shards) > 1:
        writer.run(_write_index, folder, shards)


def _is_lora(expert: nn.Module) -> bool:
    return bool(getattr(expert, "peft_config", None))


def _start_component(source: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "config.json", folder / "config.json")


def _shard_plan(entries: list[tuple[str, tuple, torch.dtype]]) -> dict[str, list]:
    """File name -> entries, split at ``MAX_SHARD_BYTES`` and named as diffusers names them."""
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry[1], entry[2])
        if groups[-1] and size + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_NAME: groups[0]}
    stem, ext = WEIGHTS_NAME.rsplit(".", 1)
    return {f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}": g for i, g in enumerate(groups)}


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _write_index(folder: Path, shards: dict[str, list]) -> None:
    weight_map = {n: file for file, entries in shards.items() for n, _, _ in entries}
    total = sum(_nbytes(shape, dt) for entries in shards.values() for _, shape, dt in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{WEIGHTS_NAME}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_safetensors(
    path: Path, entries: list[tuple[str, tuple, torch.dtype]], tensors: Iterator[torch.Tensor], on_error=None
) -> None:
    """Write a safetensors file tensor by tensor: the header from ``entries`` (name, shape, dtype)
    first, then each tensor of ``tensors`` (in ``entries``' order) as it comes. Every tensor of the
    iterator is consumed even after an OS error (``on_error.run`` records it), so the collectives
    that produce them stay in step across ranks."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = _nbytes(shape, dtype)
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    run = on_error.run if on_error is not None else (lambda fn, *a: fn(*a))
    f = run(open, path, "wb")
    run(lambda: f.write(struct.pack("<Q", len(blob)) + blob))
    for (name, shape, dtype), t in zip(entries, tensors, strict=True):
        if f is None or (on_error is not None and on_error.error is not None):
            continue
        assert t.dtype == dtype and tuple(t.shape) == tuple(shape), (name, t.dtype, t.shape)
        run(lambda t=t: f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data))
    if f is not None:
        run(f.close)


def _link_components(model_path: Path, pipeline: Path, expert_folders: tuple[str, ...]) -> None:
    """``model_index.json`` and every component folder but the experts, hard-linked from the model
    folder (copied where linking fails or the file's mode is not the one the umask grants)."""
    index = json.loads((model_path / "model_index.json").read_text())
    names = [
        k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None
    ]
    pipeline.mkdir(parents=True, exist_ok=True)
    _link(model_path / "model_index.json", pipeline / "model_index.json")
    for name in names:
        if name in expert_folders or not (model_path / name).is_dir():
            continue
        for src in sorted((model_path / name).rglob("*")):
            dst = pipeline / name / src.relative_to(model_path / name)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                _link(src, dst)


def _link(src: Path, dst: Path) -> None:
    src = src.resolve()
    umask = os.umask(0)
    os.umask(umask)
    if src.stat().st_mode & 0o777 == 0o666 & ~umask:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not allowed: copy
            pass
    shutil.copyfile(src, dst)


def _export_lora_expert(cfg: Config, model_path: Path, name: str, expert: nn.Module, writer, family) -> None:
    """LoRA: gather the adapters only (every rank), save them in diffusers' LoRA format, then (rank 0)
    the merged transformer, tensor by tensor from the base files. With ``model.init random`` there
    are no base files: the base tensors are gathered from the model instead (every rank)."""
    state = get_model_state_dict(expert)
    adapters = {k: _full(t) for k, t in state.items() if ".lora_" in k}
    if writer is not None:
        writer.run(_save_adapter, family, writer.tmp / "lora" / name, expert, adapters)
    from_files = cfg.model.init != "random"
    if from_files and writer is None:
        return  # rank 0 reads the base files alone
    base = BaseWeights(model_path / name) if from_files else None
    config = expert.peft_config["default"]
    scaling = config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)
    keep, dtype = _keep_fp32(expert), _dtype(cfg)
    plan = []
    for key, t in state.items():
        if ".lora_" in key:
            continue
        out_key = key.replace(".base_layer.", ".")
        out = _out_dtype(out_key, torch.float32 if t.is_floating_point() else t.dtype, dtype, keep)

        def produce(key=key, out_key=out_key, t=t, out=out):
            w = base.get(out_key) if base is not None else _full(t)
            w = w.float() if w.is_floating_point() else w
            if key.endswith(".base_layer.weight"):
                module = key[: -len(".base_layer.weight")]
                a, b = (
                    adapters[f"{module}.lora_A.default.weight"],
                    adapters[f"{module}.lora_B.default.weight"],
                )
                w = w + (b.float() @ a.float()) * scaling  # peft's get_delta_weight, merged as merge() does
            return w.to(out)

        plan.append((out_key, tuple(t.shape), out, produce))
    _write_transformer(writer, name, expert, plan, model_path)


def _save_adapter(family, folder: Path, expert: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    from peft import get_peft_model_state_dict

    family.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(expert, state_dict=adapters),
        # alpha / rank travel with the adapter, or loading assumes scale 1
        transformer_lora_adapter_metadata=expert.peft_config["default"].to_dict(),
        safe_serialization=True,
    )


class BaseWeights:
    """The weights of one component folder of the model (safetensors, one file or an index), read
    one tensor at a time (memory-mapped)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / f"{WEIGHTS_NAME}.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / WEIGHTS_NAME).is_file():
            with safe_open(folder / WEIGHTS_NAME, framework="pt") as f:
                weight_map = {k: WEIGHTS_NAME for k in f.keys()}
        else:
            raise ValueError(
                f"the merged LoRA export reads the base weights from {folder}, which has no {WEIGHTS_NAME} "
                "(or its .index.json): use a diffusers folder with safetensors weights"
            )
        self.folder, self.weight_map, self._open, self._safe_open = folder, weight_map, {}, safe_open

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise ValueError(f"the base weights in {self.folder} have no tensor {key}: not the model trained")
        file = self.weight_map[key]
        if file not in self._open:
            self._open[file] = self._safe_open(self.folder / file, framework="pt")
        return self._open[file].get_tensor(key)


def full_state_dicts(experts: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Collective: each expert's full (unsharded) state dict, on CPU, on rank 0 (empty elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return [get_model_state_dict(e, options=options) for e in experts]


def export_pipeline_gathered(
    cfg: Config, model_path: Path, experts: list[nn.Module], out_dir: Path
) -> Path | None:
    """The former export (the reference): gather each expert's full fp32 state on rank 0, load it into
    a fresh fp32 copy of the pipeline, ``save_pretrained``. Collective; rank 0 writes ``out_dir``."""
    states = full_state_dicts(experts)
    if dist.get_rank() != 0:
        # No barrier: writing a large pipeline can outlast the collective timeout, and nothing
        # after the export needs the other ranks.
        return None
    out_dir = Path(out_dir)
    try:
        _write_gathered(cfg, model_path, states, out_dir)
    except OSError as e:
        shutil.rmtree(out_dir.with_name(out_dir.name + ".partial"), ignore_errors=True)
        reason = f"{e.strerror}: {e.filename}" if e.strerror else str(e)
        raise ExportWriteError(
            f"could not write the export {out_dir} ({reason}). The final checkpoint is saved: free space "
            "or make the run directory writable, then relaunch the same command with --train.num-rollouts "
            "unchanged to export again"
        ) from None
    return out_dir


def cast_like_from_pretrained(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module`` to ``dtype`` but for the submodules its class keeps in float32 (norms, RoPE,
    time embedding: ``_keep_in_fp32_modules``), as ``from_pretrained(torch_dtype=dtype)`` loads it;
    a plain ``.to(dtype)`` would round them and makes diffusers warn on every export."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or [])
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.to(dtype)


def readable_by_umask(folder: Path) -> None:
    """Give every file and folder under ``folder`` the modes the umask grants (0o644 / 0o755 under
    the usual 022): safetensors writes its files 0o600, unreadable by the user's group. Files with
    other hard links (the components linked from the model folder) are left alone: they are the
    model folder's own, and were only linked when their mode already was the umask's."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir():
            os.chmod(path, 0o777 & ~umask)
        elif path.stat().st_nlink == 1:
            os.chmod(path, 0o666 & ~umask)


def _write_gathered(cfg: Config, model_path: Path, states: list[dict], out_dir: Path) -> None:
    from diffusers import DiffusionPipeline

    dtype, family = _dtype(cfg), family_of(model_path)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # the folder's own pipeline class: an image-to-video folder keeps its image encoder
    pipe = DiffusionPipeline.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    for name, state in zip(family.expert_folders, states):
        transformer = getattr(pipe, name)
        if cfg.model.lora_rank > 0:
            from peft import get_peft_model_state_dict

            from miles.models.lora import lora_config

            transformer.add_adapter(lora_config(cfg.model))
            transformer.load_state_dict(state, strict=True)
            family.save_lora_weights(
                tmp / "lora" / name,
                transformer_lora_layers=get_peft_model_state_dict(transformer),
                # alpha / rank travel with the adapter, or loading assumes scale 1
                transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
                safe_serialization=True,
            )
            transformer.fuse_lora(lora_scale=1.0)
            transformer.unload_lora()
        else:
            transformer.load_state_dict(state, strict=True)
        cast_like_from_pretrained(transformer, dtype)
    pipe.save_pretrained(tmp / ("merged" if cfg.model.lora_rank > 0 else "pipeline"), safe_serialization=True)
    readable_by_umask(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
