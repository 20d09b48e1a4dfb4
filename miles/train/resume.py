"""Which checkpoint a launch resumes from, checked before any weights load.

:func:`resume_checkpoint` takes the newest complete checkpoint in the run directory whose files
are whole (:func:`miles.train.checkpoint.checkpoint_problem`) and still have the sha256 recorded in
their ``SHA256SUMS`` (:func:`~miles.train.checkpoint.digest_problem`; the ranks share the reading and
agree on the result); a newer one that is cut short, unreadable or whose bytes changed is named in a
warning with its file and skipped, so the run falls back to the previous one and never trains on it. The
configuration saved with it must agree with this launch on what the checkpoint's tensors and the
run's data depend on (``RESUME_MUST_MATCH``): the model and its experts, the LoRA adapters, the
prompts, the seed and the algorithm. A difference is refused with a message naming each key, the
checkpoint's value and the flag that restores it. Every rank runs this (it only reads files), so
every rank refuses alike.

A lean checkpoint holds only the trained parameters; the frozen rest comes from ``model.path``. The
fingerprint of the model folder saved with it (:mod:`miles.models.fingerprint`: configs, file names
and sizes, safetensors headers) must equal this launch's, or the resume is refused before anything
heavy happens, naming the folder the checkpoint was trained from. Checkpoints saved before
fingerprints existed are not checked.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from miles.config import Config
from miles.models.family import model_folder
from miles.models.fingerprint import check_base_model, model_fingerprint
from miles.train.checkpoint import checkpoint_problem, digest_problem, list_checkpoints
from miles.train.logging import print0

# dotted config key -> what it decides (for the message)
RESUME_MUST_MATCH = {
    "model.path": "the model (and its experts)",
    "model.tiny_variant": "the embedded tiny model's experts",
    "model.lora_rank": "the LoRA adapters' shapes (0: full fine-tune)",
    "model.lora_alpha": "the LoRA scale",
    "model.lora_target_modules": "the modules LoRA adapts",
    "data.prompt_file": "the prompts and their order",
    "run.seed": "the prompt order and the rollout noise",
    "algorithm.name": "the loss and the state it keeps",
}


def _get(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _same(key: str, saved, current) -> bool:
    if key == "model.path" and saved is not None and current is not None:
        return saved == current or Path(saved).resolve() == Path(current).resolve()
    return saved == current


def _flag(key: str, value) -> str:
    words = " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return f"--{key.replace('_', '-')} {words}"


def config_differences(saved: dict, cfg: Config) -> list[str]:
    """Each key of ``RESUME_MUST_MATCH`` on which ``saved`` (a checkpoint's config) and ``cfg`` differ."""
    current = dataclasses.asdict(cfg)
    diffs = []
    for key, what in RESUME_MUST_MATCH.items():
        if key == "model.tiny_variant" and (_get(saved, "model.path") or cfg.model.path):
            continue  # only the embedded tiny model reads it
        a, b = _get(saved, key), _get(current, key)
        if not _same(key, a, b):
            diffs.append(f"{key} ({what}): the checkpoint has {a!r}, this launch {b!r} [{_flag(key, a)}]")
    return diffs


# the learning-rate schedule the checkpoint's scheduler state continues (miles/train/schedule.py);
# checkpoints saved before schedules existed ran the defaults
SCHEDULE_MUST_MATCH = {"train.lr_schedule": "constant", "train.lr_warmup_steps": 0, "train.lr_min_ratio": 0.0}


def schedule_differences(saved: dict, cfg: Config) -> list[str]:
    """Where the checkpoint's lr schedule and this launch's differ: the kind, the warm-up, the floor,
    and for ``cosine`` its length (``train.num_rollouts`` x ``train.steps_per_rollout``)."""
    current = dataclasses.asdict(cfg)
    diffs = []
    for key, default in SCHEDULE_MUST_MATCH.items():
        a, b = _get(saved, key), _get(current, key)
        a = default if a is None else a
        if a != b:
            diffs.append(
                f"{key} (the lr schedule): the checkpoint has {a!r}, this launch {b!r} [{_flag(key, a)}]"
            )
    if cfg.train.lr_schedule == "cosine" and not diffs:
        length = (_get(saved, "train.num_rollouts") or 0) * (_get(saved, "train.steps_per_rollout") or 0)
        if length != cfg.train.num_rollouts * cfg.train.steps_per_rollout:
            diffs.append(
                f"train.num_rollouts x train.steps_per_rollout (the cosine schedule's length): the checkpoint "
                f"has {length} optimizer steps, this launch {cfg.train.num_rollouts * cfg.train.steps_per_rollout}"
            )
    return diffs


def _saved_state(path: Path) -> dict | None:
    """The trainer state saved with the checkpoint at ``path`` (None: its trainer.json is unreadable)."""
    try:
        return json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError):
        return None


def current_fingerprint(cfg: Config) -> dict | None:
    """This launch's model folder fingerprint (None: the folder does not exist yet)."""
    path = model_folder(cfg.model)
    return model_fingerprint(path) if path.is_dir() else None


def check_resume_config(path: Path, saved: dict, cfg: Config) -> None:
    """Refuse (``ValueError``) to resume ``path``, saved with config ``saved``, under ``cfg``."""
    diffs = config_differences(saved, cfg) + schedule_differences(saved, cfg)
    if diffs:
        raise ValueError(
            f"cannot resume {path}: it was saved with a different configuration: "
            + "; ".join(diffs)
            + ". Resume with the checkpoint's values (the flags in brackets), or start a new run in its "
            "own directory (--run.name NEW_NAME)"
        )


def shared_problem(path: Path, verify_digests: bool = True) -> str | None:
    """What is wrong with the checkpoint at ``path`` (None: nothing), the same on every rank: file
    sizes and metadata, then (``verify_digests``) the sha256 of every file, each rank hashing its
    share of the files when torch.distributed is initialised."""
    problem = checkpoint_problem(path)
    if problem is not None or not verify_digests:
        return problem
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return digest_problem(path)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, digest_problem(path, dist.get_rank(), dist.get_world_size()))
    return next((p for p in found if p is not None), None)


def resume_checkpoint(run_dir: Path, cfg: Config, verify_digests: bool = True) -> Path | None:
    """The checkpoint to resume from (None: none saved yet): the newest whole one whose bytes match
    their saved sha256 (``verify_digests``; collective under torch.distributed). Its config and model
    fingerprint (and those of any newer, corrupt one) are checked first: a mismatch is refused, whole
    or not."""
    bad = []
    fingerprint: dict | None = None
    for path in reversed(list_checkpoints(run_dir)):
        if (saved := _saved_state(path)) is not None:
            check_resume_config(path, saved.get("config", {}), cfg)
            if saved.get("model_fingerprint"):
                fingerprint = fingerprint or current_fingerprint(cfg)
                check_base_model(path, saved["model_fingerprint"], fingerprint)
        problem = shared_problem(path, verify_digests)
        if problem is None:
            return path
        bad.append(path)
        print0(
            f"[miles] warning: the checkpoint {path} is corrupt: {problem}; trying the previous one",
            file=sys.stderr,
        )
    if bad:
        raise ValueError(
            f"every checkpoint in {run_dir / 'checkpoints'} is corrupt ({', '.join(p.name for p in bad)}; "
            "see the warnings above): nothing to resume from. Move them aside to start this run afresh, "
            "or start a new run in its own directory (--run.name NEW_NAME)"
        )
    return None
