"""The embedded tiny pipelines: complete diffusers folders built from configs, no download.

    python -m miles.models.tiny .cache/tiny-wan      # or: make tiny-model

writes two ordinary diffusers Wan folders (safetensors) with fixed seeds:

- ``two_expert/``: the Wan2.2 A14B layout — ``transformer`` (high noise), ``transformer_2``
  (low noise) and ``boundary_ratio`` in ``model_index.json``;
- ``single_expert/``: the Wan2.1 layout — one ``transformer``;

the image-to-video variants of ``miles.models.tiny_i2v`` (``i2v``, ``i2v_two_expert``,
``ti2v``), and ``ltx``: the tiny ``LTXPipeline`` of ``miles.models.tiny_ltx`` (the second family).

Each Wan variant has a UMT5 text encoder, a byte-level BPE tokenizer (built in code, reloads through
``AutoTokenizer``), an ``AutoencoderKLWan`` with Wan's 4x temporal / 8x spatial compression,
and a flow-matching scheduler. They load through the same ``WanPipeline.from_pretrained(dir)``
path real Wan checkpoints use. The transformer has 4 heads x 16 (Ulysses degrees 2 and 4
divide them) and 2 blocks: a CPU forward+backward at ~1k tokens takes well under a second.
Building twice gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from miles.models.tiny_i2v import I2V_VARIANTS, build_i2v_pipeline
from miles.models.tiny_ltx import build_ltx_pipeline
from miles.models.tiny_t2v import (  # noqa: F401 (the tiny model's parts, named here too)
    BOUNDARY_RATIO,
    TINY_TEXT_ENCODER,
    TINY_TRANSFORMER,
    TINY_VAE,
    VARIANTS,
    build_t2v_pipeline,
    build_tokenizer,
)

LTX_VARIANTS = ("ltx",)
ALL_VARIANTS = (*VARIANTS, *I2V_VARIANTS, *LTX_VARIANTS)


def build_pipeline(variant: str = "two_expert"):
    """Construct the tiny pipeline of ``variant`` (a WanPipeline, an I2V variant's pipeline, or the
    LTXPipeline) in memory with fixed seeds."""
    if variant in LTX_VARIANTS:
        return build_ltx_pipeline()
    if variant in I2V_VARIANTS:
        return build_i2v_pipeline(variant)
    return build_t2v_pipeline(variant)


# Written last into a built variant's folder (before it is moved into place): every file and its
# size. A folder without it, or with a file missing or of another size (an interrupted build, a
# folder emptied by hand), is rebuilt; ``model_index.json`` alone says nothing about its components.
MANIFEST = ".complete.json"


def build_tiny_models(root: str | Path, force: bool = False) -> Path:
    """Write every variant under ``root``. Each is built in a temporary folder and renamed into
    place, so a half-written folder never appears; a file lock (``root/.build.lock``) makes the
    processes that start at once (the ranks of a launch, runs side by side) build each variant
    once: the first builds, the others wait for it and find the folder complete."""
    root = Path(root)
    if not force and all(is_complete(root / v) for v in ALL_VARIANTS):
        return root  # the common case: no lock, no write (a read-only cache works)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".build.lock"):
        for variant in ALL_VARIANTS:
            dest = root / variant
            if is_complete(dest) and not force:
                continue
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{variant}-"))
            try:
                build_pipeline(variant).save_pretrained(tmp, safe_serialization=True)
                _write_manifest(tmp)
                _publish(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_manifest(folder: Path) -> None:
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()
    }
    (folder / MANIFEST).write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a whole built variant: its manifest lists every file, each present
    with its size, and the pipeline's components (``model_index.json``) each have their folder."""
    try:
        files = json.loads((folder / MANIFEST).read_text())
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(files, dict) or not isinstance(index, dict):
        return False
    for rel, size in files.items():
        f = folder / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    parts = [k for k, v in index.items() if isinstance(v, list) and v and v[0] is not None]
    return all(any(rel.startswith(f"{k}/") for rel in files) for k in parts)


def _publish(tmp: Path, dest: Path) -> None:
    """Move a built variant into place (under the build lock). An old folder is renamed aside
    first and removed after, so ``dest`` is never a half-removed folder."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-old-"))
        os.replace(dest, old / dest.name)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tiny_model_path(root: str | Path, variant: str) -> Path:
    """The folder of a tiny variant, building the tiny models first if they are missing."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {ALL_VARIANTS}")
    build_tiny_models(root)
    return Path(root) / variant


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-wan"
    build_tiny_models(out, force="--force" in sys.argv)
    print(f"tiny pipelines written to {out}/{{{','.join(ALL_VARIANTS)}}}")
