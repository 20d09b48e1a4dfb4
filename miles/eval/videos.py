"""Writing videos to disk: H.264 mp4 through imageio-ffmpeg's bundled ffmpeg, GIF as the fallback.

    path = write_video(frames, out_dir / "sample_00")   # frames (F, H, W, 3) uint8 -> .mp4 or .gif

mp4 is what wandb plays inline and what users share; it is about 10x smaller than a GIF and
keeps full colour (a GIF has 256). ``imageio-ffmpeg`` ships an ffmpeg binary in its wheel (pinned
in pyproject.toml); when it cannot be imported or its encoder fails, the same frames are written
as a GIF and a note is printed once. Odd frame sizes are padded to even with edge pixels (H.264's
4:2:0 chroma needs even sides). ``MILES_VIDEO_FORMAT=gif`` forces the fallback.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

FPS = 8
_warned = False


def mp4_encoder() -> str | None:
    """The ffmpeg executable imageio-ffmpeg bundles, or None (no mp4; GIFs are written)."""
    if os.environ.get("MILES_VIDEO_FORMAT", "mp4") == "gif":
        return None
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return None


def _even(frames: np.ndarray) -> np.ndarray:
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    return np.ascontiguousarray(frames)


def write_mp4(frames: np.ndarray, path: Path, fps: int = FPS) -> None:
    """Frames (F, H, W, 3) uint8 as H.264 (yuv420p, crf 18: visually lossless) at ``path``."""
    import imageio_ffmpeg

    frames = _even(frames)
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (frames.shape[2], frames.shape[1]),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=2,
        output_params=["-crf", "18"],
        ffmpeg_log_level="error",
    )
    writer.send(None)  # start the encoder
    for frame in frames:
        writer.send(frame)
    writer.close()


def write_gif(frames: np.ndarray, path: Path, fps: int = FPS) -> None:
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)


def write_video(frames: np.ndarray, stem: Path, fps: int = FPS) -> Path:
    """Write frames (F, H, W, 3) uint8 to ``stem.mp4`` (or ``stem.gif`` without an encoder); the path."""
    global _warned
    stem = Path(stem)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"write_video takes (F, H, W, 3) uint8 frames; got {frames.dtype} {frames.shape}")
    if mp4_encoder() is not None:
        path = stem.with_suffix(".mp4")
        try:
            write_mp4(frames, path, fps)
            return path
        except (OSError, RuntimeError) as e:
            path.unlink(missing_ok=True)
            reason = f"the mp4 encoder failed ({e})"
    else:
        reason = "imageio-ffmpeg is not installed (or MILES_VIDEO_FORMAT=gif)"
    if not _warned:
        warnings.warn(f"[miles] writing videos as GIF: {reason}", stacklevel=2)
        _warned = True
    path = stem.with_suffix(".gif")
    write_gif(frames, path, fps)
    return path


def to_uint8(video) -> np.ndarray:
    """A video (F, 3, H, W) float tensor in [0, 1] -> (F, H, W, 3) uint8 numpy."""
    return (video.detach().float().permute(0, 2, 3, 1).clamp(0, 1) * 255).round().byte().cpu().numpy()
