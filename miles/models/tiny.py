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

import os
import shutil
import sys
import tempfile
from pathlib import Path

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


def build_tiny_models(root: str | Path, force: bool = False) -> Path:
    """Write every variant under ``root`` (atomically: a half-written folder never appears)."""
    root = Path(root)
    for variant in ALL_VARIANTS:
        dest = root / variant
        if _complete(dest) and not force:
            continue
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{variant}-"))
        try:
            build_pipeline(variant).save_pretrained(tmp, safe_serialization=True)
            _publish(tmp, dest, force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / "model_index.json").is_file()


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    """Move a built variant into place. Several processes may build at once (runs launched side by
    side on a fresh cache): a complete folder another one published meanwhile is kept as it is —
    never removed under a reader — unless ``force`` asks to rebuild it."""
    if _complete(dest) and not force:
        return
    if dest.exists():
        shutil.rmtree(dest)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process published between the check and the move
        if not _complete(dest):
            raise


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
