"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout under the run directory::

    checkpoints/
      step_000004/            a complete checkpoint (it has a COMPLETE marker)
        .metadata, __*_*.distcp   DCP shards: every rank writes its own part
        trainer.json           counters, data position, config, model fingerprint (rank 0)
        SHA256SUMS             the sha256 of every file above (``sha256sum -c SHA256SUMS`` checks it)
        COMPLETE
      step_000006.partial/    being written, or left by a crash: never loaded, removed on save

A checkpoint is written into ``step_N.partial`` and renamed to ``step_N`` by rank 0 after every
rank has finished writing, so a crash mid-save leaves no directory that looks complete.
Before the marker, ``SHA256SUMS`` records the sha256 of every shard (each rank hashes the files it
wrote, while they are still in the page cache), of ``.metadata`` and of ``trainer.json``; a resume
and ``python -m miles.eval --checkpoint`` recompute them (:func:`digest_problem`) before any file of
the checkpoint is parsed, so bytes changed after the save (a flaky disk, a bad copy, an edit) are
found before a weight is loaded, and the file is named. A checkpoint without ``SHA256SUMS`` (or with a
file it does not list) is damaged: this version always writes it. The DCP index (``.metadata``, a
pickle) is read admitting only DCP's own classes, and the shards' non-tensor entries with
``weights_only=True`` (:mod:`miles.files`): a checkpoint's files are data, never code.
DCP stores each tensor with its global shape, so a checkpoint loads into any dp x sp layout and
any world size (FSDP re-shards on load). The rollout noise and SDE windows are derived from the
seed and the rollout index, so counters + data position are the whole RNG state.

Checkpoints are lean: they hold the trainable parameters (``model.*``: everything for a full
fine-tune, only the adapters for LoRA), the optimizer state (``optim.*``), the EMA and the old
policy where present (``ema.*``, ``old_policy.*``: trainable parameters only) and ``trainer.json``.
The frozen rest (LoRA's base, the text encoder, the VAE) is re-read from ``model.path``, whose
fingerprint is saved in ``trainer.json`` and checked at resume (miles/train/resume.py). A load asks
only for what the model trains, so an older checkpoint that also holds the frozen weights still
loads (they are left unread).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# The checks that need no process group live a floor down (``python -m miles.eval`` uses them too);
# read_digests and verify_checkpoint are re-exported for the trainer's callers.
from miles.files import (  # noqa: F401
    DIGESTS,
    checkpoint_problem,
    digest_problem,
    file_sha256,
    load_checkpoint_state,
    read_dcp_metadata,
    read_digests,
    verify_checkpoint,
)

_NAME = re.compile(r"^step_(\d{6,})$")

# Trainable parameters only; strict=False on load because the frozen ones are absent by design
# (DCP itself raises for a trainable parameter the checkpoint lacks).
STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "COMPLETE").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _model_state(models: nn.Module, optimizer: torch.optim.Optimizer, **extras) -> dict:
    """Trainable weights and optimizer state, plus ``extras`` (name -> object with ``state_dict``;
    None: left out). The model's entries are its own (sharded) parameters: nothing is copied."""
    model_sd, optim_sd = get_state_dict(models, optimizer, options=STATE_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    state.update({name: obj.state_dict() for name, obj in extras.items() if obj is not None})
    return state


def has_state(path: Path, name: str) -> bool:
    """Whether the checkpoint at ``path`` holds the extra state ``name`` (``ema``, ``old_policy``)."""
    meta = read_dcp_metadata(path)
    return any(k.startswith(f"{name}.") for k in meta.state_dict_metadata)


def has_ema(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds an EMA of the weights (``train.ema_decay``)."""
    return has_state(path, "ema")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only or vanished run directory); raised on
    every rank, after the ``.partial`` folder was removed."""


def _all_ok(ok: bool) -> bool:
    """Collective: whether ``ok`` holds on every rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def checkpoint_error_reason(error: BaseException) -> str:
    """The first underlying OS error of ``error`` (DCP wraps each rank's), as one line."""
    if isinstance(error, CheckpointException):
        inner = [exc for exc, _ in error.failures.values()]
        error = next((e for e in inner if isinstance(e, OSError)), inner[0] if inner else error)
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}" + (f": {error.filename}" if error.filename else "")
    return f"{type(error).__name__}: {error}"


def _write_failed(root: Path, partial: Path, final: Path, error: BaseException | None) -> None:
    """Remove the partial folder (rank 0), then raise on every rank naming the reason and the fix."""
    reason = checkpoint_error_reason(error) if error is not None else "another rank failed to write its shard"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    latest = last_good_checkpoint(root.parent)
    raise CheckpointWriteError(
        f"could not write the checkpoint {final} ({reason}). Free space on that disk, or set "
        f"--run.output-dir to a writable folder with room (a checkpoint holds the weights and the AdamW "
        f"state); the last good checkpoint is {latest or 'none'}"
    )


def _prepare(root: Path, final: Path) -> None:
    """Rank 0, before a save: the checkpoints folder exists; leftovers of interrupted saves (a
    ``.partial``, or a step folder without its marker) and an old copy of ``final`` are gone."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        if stale.name.endswith(".partial") or (
            _NAME.match(stale.name) and not (stale / "COMPLETE").is_file()
        ):
            shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)


def _own_digests(partial: Path, rank: int) -> dict[str, str]:
    """The sha256 of the shard files this rank wrote (DCP names them ``__<rank>_<i>.distcp``)."""
    return {p.name: file_sha256(p) for p in sorted(partial.glob(f"__{rank}_*.distcp"))}


def _write_digests(partial: Path, digests: dict[str, str]) -> None:
    """Rank 0: ``SHA256SUMS`` for every file in ``partial`` (those no rank hashed are hashed here),
    written whole under a temporary name and renamed, so it is never seen half written."""
    for p in sorted(partial.iterdir()):
        if p.is_file() and p.name not in digests and p.name not in (DIGESTS, "COMPLETE"):
            digests[p.name] = file_sha256(p)
    tmp = partial / f"{DIGESTS}.tmp"
    with open(tmp, "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / DIGESTS)


def _finalize(partial: Path, final: Path, step: int, trainer_state: dict, digests: dict[str, str]) -> None:
    """Rank 0, after every shard is written: ``trainer.json``, ``SHA256SUMS`` (``digests``: the
    shards' sha256), ``COMPLETE``, then the rename."""
    with open(partial / "trainer.json", "w") as f:
        json.dump(trainer_state, f, indent=1)
    _write_digests(partial, dict(digests))
    (partial / "COMPLETE").write_text(f"{step}\n")
    os.replace(partial, final)


def save_checkpoint(
    run_dir: Path,
    step: int,
    models: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    keep: int,
    ema=None,
    old_policy=None,
) -> Path:
    """Collective: every rank writes its shards; rank 0 finalises. Returns the checkpoint path.
    ``ema`` / ``old_policy``: the EMA of the weights and the old policy, saved where given. A write
    that fails on any rank raises :class:`CheckpointWriteError` on every rank, leaving no ``.partial``."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:06d}"
    partial = root / f"step_{step:06d}.partial"
    rank = dist.get_rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            _prepare(root, final)
        except OSError as e:
            error = e
    if not _all_ok(error is None):
        _write_failed(root, partial, final, error)
    own: dict[str, str] = {}
    try:
        dcp.save(_model_state(models, optimizer, ema=ema, old_policy=old_policy), checkpoint_id=str(partial))
        own = _own_digests(partial, rank)
    except (OSError, CheckpointException) as e:  # DCP raises on every rank when one fails
        error = e
    if not _all_ok(error is None):
        _write_failed(root, partial, final, error)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, own)
    if rank == 0:
        try:
            _finalize(partial, final, step, trainer_state, {k: v for d in shards for k, v in d.items()})
        except OSError as e:
            error = e
    if not _all_ok(error is None):
        _write_failed(root, partial, final, error)
    if rank == 0:
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files are whole and have their saved sha256 (reads them
    all: for messages after a failure, not for the training loop)."""
    for path in reversed(list_checkpoints(run_dir)):
        if digest_problem(path) is None and checkpoint_problem(path) is None:
            return path
    return None


def load_checkpoint(
    path: Path, models: nn.Module, optimizer: torch.optim.Optimizer, ema=None, old_policy=None
) -> dict:
    """Collective: load the trainable weights and optimizer state into the (already sharded) models,
    and the EMA and the old policy where given and the checkpoint holds them; returns the trainer
    state saved with them. Frozen weights an older checkpoint holds are not read."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    extras = {
        name: obj
        for name, obj in (("ema", ema), ("old_policy", old_policy))
        if obj is not None and has_state(path, name)
    }
    # Read before the collective load: once every rank has passed it, rank 0 may save this step
    # again (removing the folder) while another rank would still be reading.
    trainer_state = json.loads((path / "trainer.json").read_text())
    state = _model_state(models, optimizer, **extras)
    load_checkpoint_state(state, path)  # data only: DCP's index and the shards' tensors and values
    set_state_dict(
        models,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=STATE_OPTIONS,
    )
    for name, obj in extras.items():
        obj.load_state_dict(state[name])
    return trainer_state


def weights_digest(models: nn.Module) -> str | None:
    """Collective: sha256 over every full (unsharded) tensor of ``models`` — name, dtype, shape and
    bytes — on rank 0 (None elsewhere). The same bits give the same digest in any dp x sp layout."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(models, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
