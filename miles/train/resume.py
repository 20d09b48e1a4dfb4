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
heavy happens, naming the folder the checkpoint was trained from. So must the training prompt
file's bytes (their sha256, ``prompt_fingerprint`` in ``trainer.json``): an edited prompt file is
refused on resume, in the plan, before the model loads. Checkpoints saved before these fingerprints
existed are not checked for them.

Nothing of a checkpoint is parsed before its bytes are checked against its ``SHA256SUMS``
(:func:`shared_digest_problem`); a checkpoint without one is damaged (this version always writes it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from miles.config import Config
from miles.data.prompts import TINY_PROMPTS
from miles.models.family import model_folder
from miles.models.fingerprint import check_base_model, model_fingerprint
from miles.train.checkpoint import checkpoint_problem, digest_problem, file_sha256, list_checkpoints
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


def current_fingerprint(cfg: Config) -> dict | None:
    """This launch's model folder fingerprint (None: the folder does not exist yet)."""
    path = model_folder(cfg.model)
    return model_fingerprint(path) if path.is_dir() else None


def prompt_fingerprint(cfg: Config) -> dict | None:
    """The training prompt file's path and the sha256 of its bytes, saved with every checkpoint (None:
    the file cannot be read; the plan refuses that on its own)."""
    file = Path(cfg.data.prompt_file or TINY_PROMPTS)
    try:
        return {"file": str(file), "sha256": file_sha256(file)}
    except OSError:
        return None


def check_prompt_file(path: Path, saved: dict | None, cfg: Config) -> None:
    """Refuse (``ValueError``) to resume ``path`` when the prompt file's bytes differ from those the
    checkpoint was trained on (``saved``: its ``prompt_fingerprint``; None: saved before fingerprints
    of the prompt file existed, not checked). Edited prompts would shift what the saved sampler
    position and the rollouts done refer to: the resumed run would not be the run it continues."""
    current = prompt_fingerprint(cfg)
    if not saved or current is None or saved.get("sha256") == current["sha256"]:
        return
    raise ValueError(
        f"cannot resume {path}: the prompt file {current['file']} changed since the checkpoint was saved "
        f"(sha256 {saved.get('sha256', '?')[:12]}... then, {current['sha256'][:12]}... now). The saved prompt "
        "sampler position and the rollouts already trained refer to its old content, so the resumed run "
        "would train on other prompts than the run it continues. Restore the file as it was, or start a "
        "new run with the edited prompts in its own directory (--run.name NEW_NAME)"
    )


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


def shared_digest_problem(path: Path) -> str | None:
    """Whether the checkpoint's files have the sha256 its ``SHA256SUMS`` recorded (None: they do), the
    same on every rank: each rank hashes its share of the files when torch.distributed is initialised
    and they agree by a gather, so no rank parses a file of it before every file was checked."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return digest_problem(path)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, digest_problem(path, dist.get_rank(), dist.get_world_size()))
    return next((p for p in found if p is not None), None)


def _check_saved_with(path: Path, cfg: Config, fingerprint: dict | None) -> dict | None:
    """Refuse to resume ``path`` unless it was saved with this config, model folder (``fingerprint``,
    computed here when None and needed) and prompt file; returns this launch's model fingerprint.
    Reads its ``trainer.json``: call it once the checkpoint's bytes are known to be as saved."""
    saved = json.loads((path / "trainer.json").read_text())
    check_resume_config(path, saved.get("config", {}), cfg)
    if saved.get("model_fingerprint"):
        fingerprint = fingerprint or current_fingerprint(cfg)
        check_base_model(path, saved["model_fingerprint"], fingerprint)
    check_prompt_file(path, saved.get("prompt_fingerprint"), cfg)
    return fingerprint


def resume_checkpoint(run_dir: Path, cfg: Config) -> Path | None:
    """The checkpoint to resume from (None: none saved yet): the newest one whose bytes match their
    saved sha256 and whose files are whole (collective under torch.distributed); a damaged one is
    named in a warning and the previous one tried. The one it picks must have been saved with this
    config, model folder and prompt file (each refused otherwise, before its index is parsed); no file
    of a checkpoint is parsed before its sha256 was checked."""
    bad = []
    fingerprint: dict | None = None
    for path in reversed(list_checkpoints(run_dir)):
        problem = shared_digest_problem(path)
        if problem is None:  # its bytes are as saved: its trainer.json, then its index, may be read
            try:
                fingerprint = _check_saved_with(path, cfg, fingerprint)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                problem = f"its trainer.json cannot be read ({type(e).__name__}: {e})"
            problem = problem or checkpoint_problem(path)
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
