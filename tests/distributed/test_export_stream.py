"""The streaming export against the former gather-all export, on the real Trainer (2 gloo ranks).

The tiny two-expert model (copied to a folder with ordinary 0o644 files, so that linking applies),
its trainable weights moved by a fixed random step so that the comparison is not vacuous, exported
both ways (``export_pipeline``: tensor by tensor; ``export_pipeline_gathered``: the former path, the
full fp32 state on rank 0 and ``save_pretrained``):

- full fine-tune at dp1 x sp2 in bf16 (the fp32-kept modules stay fp32), with the shard size cut so
  that every transformer is split into several files with an index: every tensor of both experts
  equals the reference's bit for bit (name, dtype, shape, bytes), the folder loads with
  ``WanPipeline.from_pretrained``, and the other components are hard links to the model folder's files;
- LoRA at dp2, fp32 and bf16: the adapter files hold the reference's metadata and tensors; the merged
  transformers equal (W from the base files in fp32 + (alpha/r) B A) rounded once to each tensor's
  output dtype bit for bit, and in fp32 also the reference's (in bf16 the trainer holds the frozen
  base in bf16, so the former path merged an already-rounded W: it rounded twice).

About 40 s on 2 cores.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "two_expert"
EXPERTS = ("transformer", "transformer_2")


def _model_copy(root: Path) -> Path:
    """The tiny model with the umask's file modes (the tiny builder leaves safetensors at 0o600)."""
    dst = root / "model"
    shutil.copytree(TINY, dst)
    umask = os.umask(0)
    os.umask(umask)
    for path in [dst, *dst.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    return dst


def _trainer(out_dir: Path, model: Path, name: str, *flags: str):
    import miles.train.trainer as T
    from miles.config import parse_args

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", str(out_dir)]
        + [
            "--run.name",
            name,
            "--run.wandb-mode",
            "disabled",
            "--run.no-progress",
            "--model.path",
            str(model),
        ]
        + ["--train.no-export", *flags]
    )
    return T.Trainer(cfg)


def _move_weights(trainer, seed: int) -> None:
    """A fixed random step on every rank's local shard of the trainable weights."""
    import torch

    g = torch.Generator().manual_seed(seed + trainer.rank)
    with torch.no_grad():
        for p in trainer.experts.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.randn(local.shape, generator=g, dtype=local.dtype) * 0.05)


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_same_transformers(got: Path, want: Path) -> None:
    import torch

    for name in EXPERTS:
        a, b = _tensors(got / name), _tensors(want / name)
        assert a.keys() == b.keys() and a, (name, sorted(set(a) ^ set(b))[:5])
        for key in b:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (name, key, a[key].dtype)


def _assert_same_file(got: Path, want: Path) -> None:
    """The same safetensors content: metadata and every tensor bit for bit (the bytes themselves may
    differ: safetensors writes its metadata map in a per-process hash order)."""
    import torch
    from safetensors import safe_open

    with safe_open(got, framework="pt") as a, safe_open(want, framework="pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys()), got
        for key in b.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and torch.equal(x, y), (got, key)


def _assert_merged_formula(new: Path, model: Path, old: Path, scale: float = 64 / 4) -> None:
    """merged = (W_file in fp32 + scale * B A) rounded once to the dtype the former export gave each
    tensor, bit for bit; A, B from the exported adapter files."""
    import torch

    for name in EXPERTS:
        base, merged, former = (
            _tensors(model / name),
            _tensors(new / "merged" / name),
            _tensors(old / "merged" / name),
        )
        lora = _tensors(new / "lora" / name)
        assert merged.keys() == base.keys() == former.keys(), name
        adapted = 0
        for key, w in base.items():
            expect = w.float()
            module = key.removesuffix(".weight")
            if f"transformer.{module}.lora_A.weight" in lora:
                a, b = (
                    lora[f"transformer.{module}.lora_A.weight"],
                    lora[f"transformer.{module}.lora_B.weight"],
                )
                expect = expect + (b @ a) * scale
                adapted += 1
            expect = expect.to(former[key].dtype)
            assert merged[key].dtype == expect.dtype and torch.equal(merged[key], expect), (name, key)
        assert adapted >= 10, adapted


def _assert_linked(pipeline: Path, model: Path) -> None:
    """Every file of the non-expert components is a hard link to the model folder's file."""
    linked = 0
    for path in pipeline.rglob("*"):
        if path.is_file() and path.relative_to(pipeline).parts[0] not in EXPERTS:
            assert os.path.samefile(path, model / path.relative_to(pipeline)), path
            linked += 1
    assert linked >= 5, linked


def _export_both(trainer, root: Path, tag: str) -> tuple[Path, Path]:
    from miles.train.export import export_pipeline, export_pipeline_gathered

    experts = list(trainer.model.transformers)
    new = export_pipeline(trainer.cfg, trainer.model.path, experts, root / f"{tag}_stream")
    old = export_pipeline_gathered(trainer.cfg, trainer.model.path, experts, root / f"{tag}_gathered")
    return new, old


def _full(rank, root: Path, model: Path) -> None:
    import torch.distributed as dist

    import miles.train.export as E

    trainer = _trainer(root, model, "full", "--sequence-parallel-size", "2", "--model.dtype", "bfloat16")
    _move_weights(trainer, 1)
    shard_bytes, E.MAX_SHARD_BYTES = E.MAX_SHARD_BYTES, 200_000  # several shards per expert (~600 kB)
    try:
        new, old = _export_both(trainer, root, "full")
    finally:
        E.MAX_SHARD_BYTES = shard_bytes  # the ranks serve other tests next (run_pooled)
    trainer.close()
    if rank == 0:
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("full_")) == [
            "full_gathered",
            "full_stream",
        ]
        assert len(list((new / "pipeline" / "transformer").glob("*.safetensors"))) > 1
        assert (new / "pipeline" / "transformer" / f"{E.WEIGHTS_NAME}.index.json").is_file()
        _assert_same_transformers(new / "pipeline", old / "pipeline")
        _assert_linked(new / "pipeline", model)
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(new / "pipeline", local_files_only=True)
        assert pipe.transformer_2 is not None
    dist.barrier()


def _lora(rank, root: Path, model: Path, dtype: str) -> None:
    import torch.distributed as dist

    flags = ["--model.lora-rank", "4", "--model.lora-alpha", "64", "--model.dtype", dtype]
    trainer = _trainer(root, model, f"lora_{dtype}", *flags)
    _move_weights(trainer, 2)
    new, old = _export_both(trainer, root, f"lora_{dtype}")
    trainer.close()
    if rank == 0:
        assert sorted(p.name for p in new.iterdir()) == ["lora", "merged"]
        for name in EXPERTS:
            (file,) = (new / "lora" / name).iterdir()
            _assert_same_file(file, old / "lora" / name / file.name)
        if dtype == "float32":  # the trainer holds the base in fp32: the former path is the reference
            _assert_same_transformers(new / "merged", old / "merged")
        # The formula from the model folder's fp32 base, rounded once (in bf16 the trainer holds the
        # base in bf16, and the former path merged that already-rounded copy: it rounded twice).
        _assert_merged_formula(new, model, old)
        _assert_linked(new / "merged", model)
    dist.barrier()


def _body(rank, world_size, root):
    root = Path(root)
    model = root / "model"
    _full(rank, root, model)
    _lora(rank, root, model, "float32")
    _lora(rank, root, model, "bfloat16")


def test_streaming_export_equals_the_gathered_export(tmp_path):
    _model_copy(tmp_path)
    run_pooled(_body, 2, str(tmp_path))
