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

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

__all__ = ["FRAME_SUFFIXES", "VideoItem", "fit_clip", "load_clip", "read_frames", "read_video_jsonl"]


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
    from PIL import Image

    frames = []
    for f in _frame_files(video)[:max_frames]:
        with Image.open(f) as im:
            frames.append(np.asarray(im.convert("RGB")))
    if len({fr.shape for fr in frames}) > 1:
        raise ValueError(f"{video}: the frames differ in size ({sorted({fr.shape for fr in frames})})")
    return np.stack(frames)


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
        return fit_clip(read_frames(item.video, num_frames), num_frames, height, width)
    except (ValueError, OSError, RuntimeError) as e:
        raise ValueError(f"{item.where}: video {item.video}: {e}") from None
