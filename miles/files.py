"""The run's files, checked by one process without a process group: an output folder that can be
written (``check_writable``), and a checkpoint that is whole and holds the bytes it was saved with
(``digest_problem``: each file's sha256 against its ``SHA256SUMS``; ``checkpoint_problem``: metadata
and shard sizes; ``verify_checkpoint``: both, in that order, raising). The trainer
(``miles.train.checkpoint``, ``miles.train.run_dir``) and the standalone evaluation
(``python -m miles.eval``) use them alike.

Checkpoint files are data, never code. Every checkpoint this version writes has a ``SHA256SUMS``
listing every file, so a missing one (or a file it does not list) is damage, found before any file of
the checkpoint is parsed. DCP's ``.metadata`` is a pickle and torch's ``FileSystemReader`` unpickles
it unrestricted (torch's ``weights_only`` unpickler cannot read it: it lacks pickle protocol 4's
opcodes); :func:`read_dcp_metadata` reads it with an unpickler that admits only DCP's own metadata
classes and the few torch/pathlib values they hold (``find_class`` restricted, Python's documented
way), refusing anything else. :class:`SafeReader` and :class:`SafeLoadPlanner` make ``dcp.load`` use
it, and read the non-tensor entries (optimizer hyperparameters) with ``torch.load(weights_only=True)``
where DCP's default planner uses ``weights_only=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

DIGESTS = "SHA256SUMS"  # sha256sum's format: "<hex>  <file name>" per line
METADATA = ".metadata"  # DCP's index of the shards (a pickle)


def _allowed_globals() -> dict[tuple[str, str], object]:
    """What a DCP ``.metadata`` pickle may name: DCP's metadata classes and its file system's storage
    info, ``torch.Size``, torch's dtypes, layouts and memory formats, and paths (``StorageMeta``)."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_meta

    allowed: dict[tuple[str, str], object] = {
        (dcp_meta.__name__, name): obj
        for name, obj in vars(dcp_meta).items()
        if isinstance(obj, type) and obj.__module__ == dcp_meta.__name__
    }
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, obj in vars(torch).items():
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = obj
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global (a function, a class DCP does not use) is refused."""

    allowed: dict[tuple[str, str], object] = {}

    def find_class(self, module: str, name: str):
        if not self.allowed:
            type(self).allowed = _allowed_globals()
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}") from None


class MetadataRefused(ValueError):
    """A ``.metadata`` that is not DCP's metadata; ``problem`` says why, as ``its .metadata ...``."""

    def __init__(self, path: Path, problem: str):
        self.problem = problem
        super().__init__(f"the checkpoint {path} is refused: {problem}")


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint at ``path``, unpickled admitting only DCP's own classes.
    Raises :class:`MetadataRefused` (a ``ValueError``) when it holds anything else (a pickle that
    would run code) or does not parse."""
    try:
        with open(Path(path) / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as e:
        raise MetadataRefused(
            path,
            f"its {METADATA} is not a DCP checkpoint index ({e}): a checkpoint's files are data and this one "
            "holds what a checkpoint never does (a pickle that would run code, or damaged bytes). Nothing of "
            "it was run or loaded; delete this checkpoint, or restore it from a trusted copy",
        ) from None
    if not isinstance(metadata, Metadata):
        raise MetadataRefused(path, f"its {METADATA} holds a {type(metadata).__name__}, not a DCP index")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader``, its metadata read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP metadata is not supported")
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries read with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as DCP's own planner

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_checkpoint_state(state: dict, path: Path, **kwargs) -> None:
    """``dcp.load`` of ``state`` from the checkpoint at ``path``, reading only data (``SafeReader``,
    ``SafeLoadPlanner``); ``kwargs`` go to ``dcp.load`` (e.g. ``no_dist``). A refused index raises
    :class:`MetadataRefused` here, before DCP (which would log it and try per-rank metadata)."""
    from torch.distributed.checkpoint.api import CheckpointException

    read_dcp_metadata(path)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:  # DCP gathers every rank's failure
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, pickle.UnpicklingError)]
        if not refused:
            raise
        reason = next((line for line in str(refused[0]).splitlines() if "Unsupported global" in line), "")
        raise ValueError(
            f"the checkpoint {path} is refused: a value stored in its shards is not plain data "
            f"({reason.strip() or type(refused[0]).__name__}); nothing of it was run. Delete this "
            "checkpoint, or restore it from a trusted copy"
        ) from None


def file_sha256(path: Path) -> str:
    """sha256 of the file at ``path``, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_problem(path: Path) -> str | None:
    """Why the complete checkpoint at ``path`` cannot be loaded, or None when it looks whole: an
    unreadable ``trainer.json`` or ``.metadata`` (one that is not DCP's: :func:`read_dcp_metadata`), or
    a shard missing or shorter than the metadata says (a copy or a disk that cut it short). Reads only
    file sizes and the metadata: call it after :func:`digest_problem` found the bytes as saved."""
    try:
        json.loads((path / "trainer.json").read_text())
        meta = read_dcp_metadata(path)
    except MetadataRefused as e:
        return e.problem
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


MARKER = "COMPLETE"
# A checkpoint from before digests gets one with this (the message of a missing SHA256SUMS says it).
WRITE_DIGESTS = f"sha256sum {METADATA} trainer.json __*.distcp > {DIGESTS}"


def _listing_problem(path: Path, digests: dict[str, str] | None) -> str | None:
    """Whether ``SHA256SUMS`` is there and lists every file of the checkpoint (and its index)."""
    if digests is None:
        return (
            f"its {DIGESTS} is missing: every checkpoint this version writes has one, so the folder was "
            "damaged or assembled by hand (if it is a checkpoint from before digests that you trust, give "
            f"it one: cd {path} && {WRITE_DIGESTS})"
        )
    on_disk = {p.name for p in path.iterdir()} - {DIGESTS, MARKER}
    if unlisted := sorted(on_disk - set(digests)):
        return f"its file {unlisted[0]} is not listed in its {DIGESTS} (a file added after the save)"
    for name in (METADATA, "trainer.json"):
        if name not in digests:
            return f"its {DIGESTS} does not list {name} (it was written by hand or damaged)"
    if any("/" in name or name in (".", "..") for name in digests):
        return f"its {DIGESTS} names a file outside the checkpoint folder"
    return None


def digest_problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Whether the files of the checkpoint at ``path`` still have the sha256 recorded when it was
    saved: None when they do, else the first file that differs. A missing ``SHA256SUMS``, or a file
    it does not list, is damage (every checkpoint this version writes has one listing every file).
    Reads no file of the checkpoint but as bytes, so it runs before anything is parsed. This rank
    hashes every ``world_size``-th file from ``rank`` on (the ranks share the reading)."""
    path = Path(path)
    try:
        digests = read_digests(path)
        problem = _listing_problem(path, digests)
    except (OSError, ValueError) as e:
        return f"its {DIGESTS} cannot be read ({e})"
    if problem is not None:
        return problem
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
    """Raise ``ValueError`` naming the file when the checkpoint at ``path`` is incomplete, its bytes
    differ from those saved (checked first, before any file is parsed), or it is cut short or its
    index is not DCP's (one process reads every file)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    problem = digest_problem(path) or checkpoint_problem(path)
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
