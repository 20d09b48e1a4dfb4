"""Video-caption data for supervised fine-tuning: a JSONL of ``{"video": path, "prompt": ...}``.

    items = read_video_jsonl("data/train.jsonl")          # every line and file checked up front
    clip = load_clip(items[0], num_frames=9, height=64, width=64)   # (F, 3, H, W) fp32 in [0, 1]

One object a line: a non-empty ``prompt``; a ``video``, relative to the JSONL's folder: an mp4
(any file ffmpeg reads, through the ffmpeg binary that the pinned ``imageio-ffmpeg`` wheel ships)
or a folder of frames (``.png``, ``.jpg``, ``.jpeg``, ``.webp``, ``.bmp``, read with PIL in name
order); optionally ``image``, the first frame an image-to-video model is conditioned on. The
trainer reads the same file as ``data.prompt_file`` (``miles.data.prompts`` keeps ``video`` as the
prompt's metadata), so prompt i of the run is item i here.

A clip is the video's first ``num_frames`` frames, scaled (bilinear, antialiased) so that it covers
``height x width`` and centre-cropped to it; a frame that already has the size is used as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

__all__ = [
    "FRAME_SUFFIXES",
    "VideoItem",
    "check_clip",
    "check_clips",
    "fit_clip",
    "load_clip",
    "read_frames",
    "read_video_jsonl",
]


@dataclass(frozen=True)
class VideoItem:
    """One line of the JSONL: its video, caption, optional first-frame image and line number."""

    video: Path
    prompt: str
    image: Path | None
    line: int
    source: Path  # the JSONL file

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def _frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)


def _check_video(path: Path, where: str) -> None:
    if path.is_dir():
        if not _frame_files(path):
            raise ValueError(f"{where}: the frame folder {path} holds no {'/'.join(FRAME_SUFFIXES)} frames")
    elif not path.is_file():
        raise ValueError(f"{where}: 'video' {path} does not exist (paths are relative to the JSONL's folder)")


def _item(record, path: Path, lineno: int) -> VideoItem:
    where = f"{path}:{lineno}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt, video, image = record.get("prompt"), record.get("video"), record.get("image")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: needs a non-empty string 'prompt' key")
    if not isinstance(video, str) or not video.strip():
        raise ValueError(f"{where}: needs a 'video' key: an mp4 file or a folder of frames")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ValueError(f"{where}: 'image' must be a non-empty string (a path relative to the file)")
    item = VideoItem(path.parent / video, prompt, path.parent / image if image else None, lineno, path)
    _check_video(item.video, where)
    return item


def read_video_jsonl(path: str | Path) -> list[VideoItem]:
    """Every item of the JSONL at ``path`` (blank lines skipped, as ``load_prompts`` skips them);
    ValueError naming the file and line for bad JSON, a missing key, or a video that is missing."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"video JSONL {path} is a directory: give a .jsonl file of {{'video': ..., 'prompt': ...}}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"video JSONL not found: {path}")
    if path.suffix.lower() != ".jsonl":
        raise ValueError(f"{path}: supervised fine-tuning reads a .jsonl of {{'video': ..., 'prompt': ...}}")
    items = []
    text = path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        items.append(_item(record, path, lineno))
    if not items:
        raise ValueError(f"{path}: no videos in file")
    return items


def _read_mp4(path: Path, max_frames: int | None) -> np.ndarray:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        meta = next(reader)
        w, h = meta["size"]
        frames = []
        for raw in reader:
            frames.append(np.frombuffer(raw, dtype=np.uint8).reshape(h, w, 3))
            if max_frames is not None and len(frames) == max_frames:
                break
    finally:
        reader.close()
    if not frames:
        raise ValueError(f"{path}: no frames decoded")
    return np.stack(frames)


def read_frames(video: Path, max_frames: int | None = None) -> np.ndarray:
    """The first ``max_frames`` (all: None) frames of an mp4 or a frame folder: (F, H, W, 3) uint8."""
    if not video.is_dir():
        return _read_mp4(video, max_frames)
    frames = []
    for f in _frame_files(video)[:max_frames]:
        with Image.open(f) as im:
            frames.append(np.asarray(im.convert("RGB")))
    if len({fr.shape for fr in frames}) > 1:
        raise ValueError(f"{video}: the frames differ in size ({sorted({fr.shape for fr in frames})})")
    return np.stack(frames)


def _ffmpeg_problem(e: Exception) -> str:
    """ffmpeg's own last line (its error) instead of its banner."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if not line.startswith(("===", "ffmpeg version"))), "")
    return f"ffmpeg cannot read it ({last or type(e).__name__})"


def check_clip(video: Path, num_frames: int) -> None:
    """Refuse (ValueError) a video that :func:`load_clip` could not cut a clip of ``num_frames`` from:
    an mp4 ffmpeg cannot read, with no frames or fewer than ``num_frames``; a frame folder with fewer
    frames, a frame PIL cannot read, or frames of mixed sizes. Reads no pixels of an mp4 (ffmpeg counts
    its packets) and only the headers of a folder's frames: the run plan checks every video with it,
    and ``load_clip`` checks each again before decoding."""
    if video.is_dir():
        files = _frame_files(video)[:num_frames]
        sizes = {}
        for f in files:
            try:
                with Image.open(f) as im:
                    sizes[f.name] = im.size
            except (OSError, SyntaxError) as e:
                raise ValueError(f"the frame {f.name} is not a readable image ({e})") from None
        if len(set(sizes.values())) > 1:
            shown = sorted({(w, h) for w, h in sizes.values()})
            raise ValueError(
                f"the frames differ in size (width x height {shown}): every frame must have one size"
            )
        count = len(files)
    else:
        import imageio_ffmpeg

        try:
            count = int(imageio_ffmpeg.count_frames_and_secs(str(video))[0])
        except (OSError, RuntimeError, ValueError) as e:
            raise ValueError(_ffmpeg_problem(e)) from None
    if count == 0:
        raise ValueError("holds no frames")
    if count < num_frames:
        raise ValueError(f"has {count} frames; the recipe needs rollout.num_frames = {num_frames}")


def check_clips(items: list[VideoItem], num_frames: int) -> None:
    """:func:`check_clip` of every item (a few ffmpeg processes at a time), every refusal listed at once
    naming its JSONL line (a ValueError with ``problems``, one each)."""
    from concurrent.futures import ThreadPoolExecutor

    def problem(item: VideoItem) -> str | None:
        try:
            check_clip(item.video, num_frames)
        except ValueError as e:
            return f"{item.where}: video {item.video}: {e}"
        return None

    with ThreadPoolExecutor(max_workers=min(8, len(items) or 1)) as pool:
        problems = [p for p in pool.map(problem, items) if p]
    if problems:
        shown = problems[:20] + ([f"and {len(problems) - 20} more videos"] if len(problems) > 20 else [])
        error = ValueError("\n".join(shown))
        error.problems = shown
        raise error


def fit_clip(frames: np.ndarray, num_frames: int, height: int, width: int) -> torch.Tensor:
    """The first ``num_frames`` of ``frames`` (F, H, W, 3) uint8 scaled to cover ``height x width``
    and centre-cropped: (num_frames, 3, height, width) fp32 in [0, 1]."""
    if frames.shape[0] < num_frames:
        raise ValueError(f"has {frames.shape[0]} frames; the recipe needs rollout.num_frames = {num_frames}")
    clip = torch.from_numpy(np.ascontiguousarray(frames[:num_frames])).permute(0, 3, 1, 2).float() / 255.0
    h, w = clip.shape[-2:]
    if (h, w) != (height, width):
        scale = max(height / h, width / w)
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        clip = F.interpolate(clip, size=size, mode="bilinear", antialias=True, align_corners=False)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        clip = clip[:, :, top : top + height, left : left + width].clamp(0.0, 1.0)
    return clip.contiguous()


def load_clip(item: VideoItem, num_frames: int, height: int, width: int) -> torch.Tensor:
    """``item``'s clip (``fit_clip``), errors naming its JSONL line."""
    try:
        check_clip(item.video, num_frames)
        return fit_clip(read_frames(item.video, num_frames), num_frames, height, width)
    except (ValueError, OSError, RuntimeError) as e:
        problem = _ffmpeg_problem(e) if "ffmpeg version" in str(e) else e
        raise ValueError(f"{item.where}: video {item.video}: {problem}") from None
