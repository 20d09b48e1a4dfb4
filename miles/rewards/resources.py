"""A reward's local files, checked as its loader will read them, every problem listed at once.

A reward with weights defines ``check_resources(**its options)``; its constructor calls it before
loading anything, and the run plan (the dry run and the real run's startup) calls the same function
through :func:`miles.rewards.registry.check_resources`, so a folder the loader would refuse is refused
before any model loads, by the same code:

    files = ResourceCheck()
    model = files.folder(model_path, "reward.clipscore.model_path", REPO, [("config.json",), MODEL_FILES])
    if model:
        files.attempt(load_processor, model, "reward.clipscore.model_path", REPO)
    files.done()  # ResourceError listing every problem found

A folder must exist and hold one file of each group; each of those files must be whole: a JSON file
must parse (an index's shards must exist and be whole too), a safetensors file must be as long as its
header says (:func:`miles.models.fingerprint.safetensors_header`), a torch checkpoint (``.bin``,
``.pt``, ``.pth``) must be a zip whose directory reads (torch's own format) or a pickle. Weights are
never read: a folder of GBs is checked in milliseconds. What a loader reads cheaply (a processor, a
tokenizer) it loads, through the same function the constructor uses.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from miles.models.fingerprint import safetensors_header

T = TypeVar("T")


class ResourceError(ValueError):
    """Every problem found with a reward's files (``problems``, one message each)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems with the reward files:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(text)


def download_hint(repo: str) -> str:
    return f"download {repo} to a local folder (e.g. `hf download {repo} --local-dir DIR`)"


def file_problem(path: str) -> str | None:
    """Why the loader could not read the file at ``path`` (by its kind), or None if it is whole."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        if size == 0:
            return f"{name} is empty (0 bytes)"
        if name.endswith(".safetensors"):
            safetensors_header(path)
        elif name.endswith(".json"):
            return _json_problem(path, name)
        elif name.endswith((".bin", ".pt", ".pth")):
            return _torch_file_problem(path, name)
    except ValueError as e:
        return f"{name}: {e}"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    return None


def _json_problem(path: str, name: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        return f"{name} is not valid JSON ({e})"
    if not isinstance(data, dict):
        return f"{name} holds a {type(data).__name__}, not a JSON object"
    if name.endswith(".index.json"):  # a sharded checkpoint: every shard it names, whole
        shards = sorted(set((data.get("weight_map") or {}).values()))
        if not shards:
            return f"{name} names no weight files (no 'weight_map')"
        folder = os.path.dirname(path)
        for shard in shards:
            shard_path = os.path.join(folder, shard)
            if not os.path.isfile(shard_path):
                return f"{name} names {shard}, which is missing"
            problem = file_problem(shard_path)
            if problem:
                return problem
    return None


def _torch_file_problem(path: str, name: str) -> str | None:
    """torch.save's format is a zip (its directory at the end: a cut file has none); older files a pickle."""
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{name} is a damaged torch checkpoint ({e})"
        return None
    with open(path, "rb") as f:
        start = f.read(4)
    if start == b"PK\x03\x04":  # a zip's first entry, but no directory at the end
        return f"{name} is a damaged torch checkpoint (a zip without its directory: cut short)"
    if start[:1] != b"\x80":  # a pickle's PROTO opcode
        return f"{name} is not a torch checkpoint (neither torch.save's zip nor a pickle)"
    return None


class ResourceCheck:
    """Collects the problems of one reward's files; :meth:`done` raises them all as one error."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def folder(
        self, path: str | os.PathLike | None, key: str, repo: str, groups: Sequence[Sequence[str]]
    ) -> str | None:
        """``path`` as str if it is a folder holding one whole file of each group; else None, with every
        problem recorded (unset, not a folder, a group with no file, a file not whole)."""
        need = " and ".join("one of " + "/".join(g) if len(g) > 1 else g[0] for g in groups)
        fix = download_hint(repo)
        if path is None or str(path) == "":
            self.problems.append(
                f"set {key} to a local folder holding {need}: {fix}; models are never downloaded"
            )
            return None
        path = os.fspath(path)
        if not os.path.isdir(path):
            self.problems.append(f"{key}={path!r} is not a folder; {fix} and point {key} at it")
            return None
        present, before = set(os.listdir(path)), len(self.problems)
        for group in groups:
            found = [name for name in group if name in present]
            if not found:
                self.problems.append(f"{key}={path!r} holds no {'/'.join(group)}; it must hold {need}: {fix}")
            for name in found[:1]:  # the file the loader reads first
                problem = file_problem(os.path.join(path, name))
                if problem:
                    self.problems.append(f"{key}={path!r}: {problem}; {fix}")
        return path if len(self.problems) == before else None

    def file(self, path: str | os.PathLike | None, key: str, repo: str, names: Sequence[str]) -> str | None:
        """A weights file: ``path`` itself, or the first of ``names`` inside the folder ``path``; whole."""
        fix = f"download {'/'.join(names)} from {repo}"
        if path is None or str(path) == "":
            self.problems.append(f"set {key} to a local file or folder: {fix}; models are never downloaded")
            return None
        path = os.fspath(path)
        found = None
        if os.path.isfile(path):
            found = path
        elif os.path.isdir(path):
            found = next(
                (os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))), None
            )
            if found is None:
                self.problems.append(f"{key}={path!r} holds no {'/'.join(names)}: {fix}")
        else:
            self.problems.append(f"{key}={path!r} does not exist: {fix}")
        if found is not None and (problem := file_problem(found)):
            self.problems.append(f"{key}={path!r}: {problem}; {fix}")
            return None
        return found

    def attempt(self, load: Callable[..., T], *args: Any) -> T | None:
        """``load(*args)``, its ``ValueError`` recorded (the loader's own message) instead of raised."""
        try:
            return load(*args)
        except ValueError as e:
            self.problems.append(str(e))
            return None

    def done(self) -> None:
        if self.problems:
            raise ResourceError(self.problems)
