"""A cheap fingerprint of a diffusers model folder: what a lean checkpoint was trained from.

A lean checkpoint (miles/train/checkpoint.py) holds only the trained parameters; the frozen rest
(LoRA's base, the text encoder, the VAE) comes from ``model.path`` at resume. The fingerprint saved
with the checkpoint lets a resume refuse another base model before any weights load:

    fp = model_fingerprint(path)      # {"path", "sha256", "components": {name: sha256}}
    fingerprint_mismatch(saved, fp)   # None, or the components that differ

Per component folder (and ``model_index.json``), sha256 over: its config JSON files (parsed, without
the ``_``-prefixed bookkeeping keys such as ``_diffusers_version``), every file's name and size, and
the sha256 of each safetensors header (the JSON with every tensor's name, dtype, shape and offsets).
No weight bytes are read: a folder of tens of GB is fingerprinted in milliseconds. On the way every
JSON file must parse and every safetensors file must be as long as its header says, so a truncated
weight file or a broken ``config.json`` is refused naming the file, before any weights load. Two folders with
the same headers and sizes but different weight values (a re-trained base) are not told apart;
the names, shapes and sizes of every file are.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

_SKIP = {".git", ".cache", "__pycache__"}


_FIX = "re-download or re-convert the model folder (or restore the file from a good copy)"


MAX_HEADER_BYTES = 100_000_000
"""The largest header safetensors itself reads (its ``MAX_HEADER_SIZE``): a length beyond it is damage,
and reading it would allocate what the file claims (a sparse file can claim tens of GB)."""


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON), checked:
    a ``ValueError`` names the file when it is cut short or its header is not a safetensors header.
    The length is bounded before anything is read, and safetensors' own reader (``safe_open``: the
    lengths, the JSON, every tensor's offsets within the file) has the last word."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    total = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{path} is not a safetensors file (shorter than its 8-byte header length); {_FIX}"
            )
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(
                f"{path} is not a safetensors file: its header claims {size} bytes, more than safetensors "
                f"reads ({MAX_HEADER_BYTES}); {_FIX}"
            )
        if size > total - 8:
            raise ValueError(
                f"{path} is truncated or not a safetensors file ({total} bytes; its header alone claims "
                f"{size}); {_FIX}"
            )
        header = f.read(size)
    try:
        entries = json.loads(header)
        end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"{path} has a malformed safetensors header ({e}); {_FIX}") from None
    if 8 + size + end > total:
        raise ValueError(
            f"{path} is truncated ({total} bytes; its header needs {8 + size + end}): it was cut short "
            f"(an interrupted download or copy, a full disk); {_FIX}"
        )
    try:
        with safe_open(path, framework="pt"):
            pass
    except SafetensorError as e:
        raise ValueError(f"{path} is not a valid safetensors file ({e}); {_FIX}") from None
    return header


def _config_bytes(path: Path) -> bytes:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {_FIX}") from None
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if not k.startswith("_")}
    return json.dumps(data, sort_keys=True).encode()


def _digest(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for file in sorted(files):
        rel = file.relative_to(root).as_posix()
        h.update(f"{rel}|{file.stat().st_size}|".encode())
        if file.suffix == ".json":
            h.update(_config_bytes(file))
        elif file.suffix == ".safetensors":
            h.update(hashlib.sha256(safetensors_header(file)).digest())
        h.update(b"\n")
    return h.hexdigest()


def model_fingerprint(path: Path) -> dict:
    """The fingerprint of the diffusers folder at ``path`` (see the module docstring)."""
    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"model.path {path} is not a folder; point it at a local diffusers Wan folder")
    components: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if entry.name in _SKIP or entry.name.startswith("."):
            continue
        if entry.is_dir():
            files = [f for f in entry.rglob("*") if f.is_file() and not f.name.startswith(".")]
            components[entry.name] = _digest(root, files)
        elif entry.name == "model_index.json":
            components[entry.name] = _digest(root, [entry])
    total = hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()
    return {"path": str(root), "sha256": total, "components": components}


def fingerprint_mismatch(saved: dict, current: dict) -> list[str] | None:
    """None when ``saved`` and ``current`` fingerprint the same model; else the differing components."""
    if saved.get("sha256") == current.get("sha256"):
        return None
    a, b = saved.get("components", {}), current.get("components", {})
    return sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name)) or ["model_index.json"]


def check_base_model(path: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse (``ValueError``) to resume ``path`` when the model fingerprint saved with it (``saved``)
    differs from this launch's (``current``); either None (an older checkpoint, no folder): no check."""
    if not saved or not current:
        return
    differ = fingerprint_mismatch(saved, current)
    if differ:
        raise ValueError(
            f"cannot resume {path}: the checkpoint was trained from another base model: {', '.join(differ)} "
            f"of {current['path']} differ from the folder it was saved with ({saved.get('path')}). The "
            f"checkpoint holds only the trained parameters; set model.path to {saved.get('path')} (or an "
            "unchanged copy of it), or start a new run in its own directory (--run.name NEW_NAME)"
        )
