"""Prompt sets and the sampler that deals prompt groups to data-parallel ranks.

``load_prompts`` reads a ``.txt`` file (one prompt a line) or a ``.jsonl`` file (one object a
line with a ``prompt`` key and, for image-to-video, an ``image`` path relative to the file; the
other keys are kept as metadata for rewards such as GenEval). ``check_prompt_images`` opens
every image before any rollout and names those missing or unreadable.
``truncation_warning`` counts the prompts the text encoder will see cut short, from the
tokenizer alone.

``GroupSampler`` decides, for every rollout step, which prompts each data-parallel rank
samples. Each epoch is a seeded permutation of all prompts; a step takes the next
dp_size × prompts_per_dp_rank of them, rank r gets its disjoint slice, and every prompt is
repeated group_size times back to back (one GRPO group). Sequence-parallel peers pass the same
dp_rank and so get the same samples. Everything is a function of (seed, epoch, position), so
resuming needs only ``state_dict()``. Departures from flow_grpo's DistributedKRepeatSampler:
whole groups stay on one rank (advantages need no cross-rank gather unless ``global_std``), an
epoch is a permutation without replacement (the tail shorter than a step is dropped), and the
position is counted in prompts, so a run resumed on a different dp_size continues the same
epoch's permutation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TINY_PROMPTS = Path(__file__).with_name("tiny_prompts.txt")
"""The project's own small prompt list, used by the tiny default recipe."""


@dataclass(frozen=True)
class Prompt:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other key of a JSONL record (empty for .txt files)."""
    image: Path | None = None
    """The first frame to animate (JSONL ``image``, resolved against the prompt file's folder)."""


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a UTF-8 ``.txt`` or ``.jsonl`` file; blank lines are skipped, a BOM is dropped.

    Raises FileNotFoundError for a missing file and ValueError (naming file and line) for an
    unreadable or empty file, a line that is not UTF-8, a JSONL line that is not a JSON object,
    or one without a non-empty string ``prompt``.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a directory: give a .txt (one prompt a line) or .jsonl file")
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if not path.is_file():
        raise ValueError(f"prompt file {path} is not a regular file: give a .txt or .jsonl file")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use .txt or .jsonl")
    try:
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise ValueError(
                f"{path}: {size} bytes; a prompt file may hold at most {MAX_PROMPT_FILE_BYTES} "
                f"({MAX_PROMPTS} prompts): take a subset of it"
            )
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the prompt file ({e.strerror})") from None
    check_prompt_lines(path, data)

    prompts: list[Prompt] = []
    # Editors on Windows start UTF-8 files with a byte-order mark; it is not part of the prompt.
    for lineno, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").splitlines(), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "save the prompt file as UTF-8"
            ) from None
        if not line:
            continue
        if suffix == ".txt":
            prompts.append(Prompt(line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        text = record.pop("prompt", None)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{lineno}: needs a non-empty string 'prompt' key")
        image = record.pop("image", None)
        if image is not None and (not isinstance(image, str) or not image.strip()):
            raise ValueError(
                f"{path}:{lineno}: 'image' must be a non-empty string (a path relative to the file)"
            )
        prompts.append(Prompt(text, record, path.parent / image if image else None))
    if not prompts:
        raise ValueError(f"{path}: no prompts in file; data.prompt_file needs at least one non-empty line")
    return prompts


MAX_PROMPTS = 1_000_000
"""Lines a prompt file may hold: every prompt is read, checked and tokenized (the truncation count)
before the first rollout; a larger set is subsampled first."""
MAX_PROMPT_LINE_BYTES = 65_536
"""Bytes a line may hold: far above any text encoder's window (Wan reads 512 tokens)."""
MAX_PROMPT_FILE_BYTES = 256 << 20
"""Bytes a prompt file may hold (checked before it is read)."""


def check_prompt_lines(path: Path, data: bytes) -> None:
    """Refuse (ValueError) a prompt file with more than :data:`MAX_PROMPTS` lines or a line over
    :data:`MAX_PROMPT_LINE_BYTES`, naming the file (and the line), before anything parses it."""
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    if lines > MAX_PROMPTS:
        raise ValueError(
            f"{path}: {lines} lines; a prompt file may hold at most {MAX_PROMPTS} prompts (each is read and "
            "tokenized before the first rollout): take a subset of it"
        )
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        if end - start > MAX_PROMPT_LINE_BYTES:
            lineno = data.count(b"\n", 0, start) + 1
            raise ValueError(
                f"{path}:{lineno}: a line of {end - start} bytes; a prompt line may hold at most "
                f"{MAX_PROMPT_LINE_BYTES} (the text encoder reads data.max_sequence_length tokens of it)"
            )
        start = end + 1


def check_prompt_images(prompts: Sequence[Prompt], source: str | Path, image_to_video: bool) -> None:
    """Refuse (ValueError) what an image-to-video run cannot use, naming it: a prompt without an
    ``image``, an image file that is missing or that PIL cannot read; and, for a text-to-video
    model, a prompt file that gives images (they would be ignored)."""
    from PIL import Image, UnidentifiedImageError

    with_image = [p for p in prompts if p.image is not None]
    if not image_to_video:
        if with_image:
            raise ValueError(
                f"{source} gives images ({len(with_image)} of {len(prompts)} prompts) but the model is "
                "text-to-video: use an image-to-video folder, or model.task i2v for a TI2V-5B folder"
            )
        return
    problems = [f"'{p.text}' has no 'image'" for p in prompts if p.image is None]
    for image in dict.fromkeys(p.image for p in with_image):
        try:
            with Image.open(image) as im:
                im.verify()
        except FileNotFoundError:
            problems.append(f"{image}: no such file")
        except (OSError, UnidentifiedImageError, SyntaxError) as e:
            problems.append(f"{image}: not a readable image ({type(e).__name__}: {e})")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(
            f"{source}: an image-to-video model needs a readable image per prompt (JSONL 'image', a path "
            f"relative to the prompt file): {shown}"
        )


def load_image(path: Path):
    """The RGB PIL image at ``path``, EXIF orientation applied (diffusers' ``load_image``)."""
    from diffusers.utils import load_image as diffusers_load_image

    return diffusers_load_image(str(path))


def count_truncated(texts: Sequence[str], tokenizer: Any, max_sequence_length: int) -> int:
    """How many of ``texts`` the text encoder sees cut short: longer than ``max_sequence_length``.

    Counted as ``WanPipeline`` encodes prompts (its ``prompt_clean``, then the tokenizer with
    special tokens, truncated to ``max_sequence_length``). Needs only the tokenizer, so it runs
    before the text encoder loads.
    """
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    count = 0
    for start in range(0, len(texts), 4096):  # a bounded batch: a tokenizer's memory grows with it
        batch = [prompt_clean(t) for t in texts[start : start + 4096]]
        ids = tokenizer(batch, add_special_tokens=True, verbose=False)["input_ids"]
        count += sum(len(x) > max_sequence_length for x in ids)
    return count


def truncation_warning(
    prompts: Sequence[Prompt | str], tokenizer: Any, max_sequence_length: int, source: str
) -> str | None:
    """The one warning line for prompts of ``source`` that will be truncated, or None."""
    texts = [p.text if isinstance(p, Prompt) else p for p in prompts]
    n = count_truncated(texts, tokenizer, max_sequence_length)
    if not n:
        return None
    return (
        f"{n} of {len(texts)} prompts in {source} are longer than data.max_sequence_length = "
        f"{max_sequence_length} text tokens; the text encoder sees them cut short (raise "
        "data.max_sequence_length or shorten them)"
    )


@dataclass(frozen=True)
class GroupBatch:
    """The samples one rank generates in one rollout step."""

    prompt_indices: list[int]
    """prompts_per_dp_rank × group_size indices into the prompt list, each repeated group_size
    times consecutively."""
    group_ids: list[int]
    """Per sample, its group's global index within this step (j × dp_size + dp_rank for the
    rank's j-th group): unique across dp ranks, the ids ``group_advantages`` normalises over."""
    epoch: int


class GroupSampler:
    """Deterministic, resumable assignment of prompt groups to data-parallel ranks."""

    def __init__(
        self,
        num_prompts: int,
        prompts_per_dp_rank: int,
        group_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
    ) -> None:
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO normalises within a group), got {group_size}")
        if prompts_per_dp_rank < 1:
            raise ValueError(f"prompts_per_dp_rank must be >= 1, got {prompts_per_dp_rank}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size = {dp_size}), got {dp_rank}")
        self.prompts_per_step = dp_size * prompts_per_dp_rank
        if num_prompts < self.prompts_per_step:
            raise ValueError(
                f"{num_prompts} prompts are fewer than one rollout needs (dp size {dp_size} × "
                f"data.prompts_per_rank {prompts_per_dp_rank} = {self.prompts_per_step}): add prompts "
                "to data.prompt_file, lower data.prompts_per_rank, or use fewer dp ranks (more sp)"
            )
        self.num_prompts = num_prompts
        self.prompts_per_dp_rank = prompts_per_dp_rank
        self.group_size = group_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # prompts of this epoch's permutation already dealt (to all ranks)

    def permutation(self, epoch: int) -> np.ndarray:
        """The prompt order of an epoch: depends only on (seed, epoch)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def __iter__(self) -> GroupSampler:
        return self

    def __next__(self) -> GroupBatch:
        if self.position + self.prompts_per_step > self.num_prompts:
            self.epoch += 1
            self.position = 0
        step_prompts = self.permutation(self.epoch)[self.position : self.position + self.prompts_per_step]
        self.position += self.prompts_per_step
        # Strided: local group j of rank r is global group j * dp_size + r. Splitting every
        # rank's groups into consecutive optimizer steps then gives each step the same global
        # groups whatever dp_size is, so dp4, dp2 x sp2 and sp4 train on the same batches.
        mine = step_prompts[self.dp_rank :: self.dp_size].tolist()
        return GroupBatch(
            prompt_indices=[p for p in mine for _ in range(self.group_size)],
            group_ids=[
                j * self.dp_size + self.dp_rank for j in range(len(mine)) for _ in range(self.group_size)
            ],
            epoch=self.epoch,
        )

    def state_dict(self) -> dict[str, int]:
        """Identical on every rank; save it from any one."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "num_prompts"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]}, this run has {getattr(self, key)}: "
                    "resume with the same prompt file and seed"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
