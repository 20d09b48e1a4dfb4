"""The run's files, checked by one process without a process group: an output folder that can be
written (``check_writable``), and a checkpoint that is whole and holds the bytes it was saved with
(``checkpoint_problem``: metadata and shard sizes; ``digest_problem``: each file's sha256 against its
``SHA256SUMS``; ``verify_checkpoint``: both, raising). The trainer (``miles.train.checkpoint``,
``miles.train.run_dir``) and the standalone evaluation (``python -m miles.eval``) use them alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed.checkpoint as dcp

DIGESTS = "SHA256SUMS"  # sha256sum's format: "<hex>  <file name>" per line


def file_sha256(path: Path) -> str:
    """sha256 of the file at ``path``, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_problem(path: Path) -> str | None:
    """Why the complete checkpoint at ``path`` cannot be loaded, or None when it looks whole: an
    unreadable ``trainer.json`` or ``.metadata``, or a shard missing or shorter than the metadata says
    (a copy or a disk that cut it short). Reads only file sizes and the metadata."""
    try:
        json.loads((path / "trainer.json").read_text())
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata makes the checkpoint unusable
        return f"its metadata cannot be read ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        shard = path / name
        if not shard.is_file():
            return f"its shard {name} is missing"
        if (have := shard.stat().st_size) < size:
            return f"its shard {name} is truncated ({have} bytes; the metadata needs {size})"
    return None


def read_digests(path: Path) -> dict[str, str] | None:
    """File name -> sha256 recorded in the checkpoint's ``SHA256SUMS`` (None: saved without one)."""
    try:
        text = (Path(path) / DIGESTS).read_text()
    except FileNotFoundError:
        return None
    digests = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise ValueError(f"{Path(path) / DIGESTS} is malformed (line {line!r})")
        digests[name] = digest
    return digests


def digest_problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Whether the files of the checkpoint at ``path`` still have the sha256 recorded when it was
    saved: None when they do (or it has no ``SHA256SUMS``), else the first file that differs. This
    rank checks every ``world_size``-th file from ``rank`` on (the ranks share the reading)."""
    path = Path(path)
    try:
        digests = read_digests(path)
    except (OSError, ValueError) as e:
        return f"its {DIGESTS} cannot be read ({e})"
    if digests is None:
        return None
    for name in sorted(digests)[rank::world_size]:
        file = path / name
        if not file.is_file():
            return f"its file {name} is missing"
        if file_sha256(file) != digests[name]:
            return (
                f"its file {name} does not match the sha256 recorded when it was saved (its bytes "
                "changed after the save: a disk or copy error, or an edit)"
            )
    return None


def verify_checkpoint(path: Path) -> None:
    """Raise ``ValueError`` naming the file when the checkpoint at ``path`` is incomplete, cut short
    or its bytes differ from those saved (one process reads every file)."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    problem = checkpoint_problem(path) or digest_problem(path)
    if problem:
        raise ValueError(f"the checkpoint {path} is corrupt: {problem}; use another checkpoint of the run")


def check_writable(run_dir: Path, what: str = "") -> None:
    """Raise ``ValueError`` unless this process may write into ``run_dir`` (or create it): a read-only
    disk found now costs nothing, found at the first checkpoint it costs the training until then.
    ``what``: the flag that named another output folder (e.g. ``--out``), for the message."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{what or 'the run directory'} {run_dir} is a file; choose a folder")
    targets = [p for p in (run_dir, run_dir / "checkpoints") if p.is_dir()]
    if not targets:  # not created yet: the nearest folder above it must take it
        targets = [next(p for p in run_dir.absolute().parents if p.exists())]
    for path in targets:
        if not path.is_dir():
            raise ValueError(f"{path} is a file, so {run_dir} cannot be created; choose another folder")
        if not os.access(path, os.W_OK | os.X_OK):
            fix = f"set {what} to a writable folder" if what else "set --run.output-dir to a writable folder"
            raise ValueError(
                f"{path} is not writable (a read-only disk or folder), so "
                + (
                    f"{what} {run_dir} cannot be written: "
                    if what
                    else "the run cannot save its checkpoints: "
                )
                + f"{fix}, or fix the permissions"
            )
