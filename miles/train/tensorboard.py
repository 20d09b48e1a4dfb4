"""TensorBoard beside wandb (``run.tensorboard``): the same metric names, evaluation and sample videos.

    tensorboard --logdir runs/<name>/tensorboard

Scalars go through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` extra). Videos are
animated GIFs in TensorBoard's image tab: ``SummaryWriter.add_video`` needs moviepy, so the frames
of the mp4 (or GIF) the run already wrote are read back and re-encoded as a GIF with PIL, and written
as the same image summary ``add_video`` writes; a caption goes beside it as text.
"""

from __future__ import annotations

import io
import numbers
from pathlib import Path

import numpy as np

from miles.eval.videos import FPS


def read_frames(path: Path) -> np.ndarray:
    """The (F, H, W, 3) uint8 frames of an mp4 (imageio-ffmpeg) or a GIF (PIL)."""
    path = Path(path)
    if path.suffix == ".gif":
        from PIL import Image, ImageSequence

        with Image.open(path) as im:
            return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def gif_bytes(frames: np.ndarray, fps: int = FPS) -> bytes:
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(
        buf, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0
    )
    return buf.getvalue()


class TensorBoardLog:
    """Scalars and videos of one run (rank 0), under ``log_dir``."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "run.tensorboard needs the tensorboard package: pip install 'miles[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, row: dict, step: int) -> None:
        """Every numeric entry of a metrics row under its own name (``step`` and ``time`` excluded)."""
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, numbers.Real) and not isinstance(v, bool):
                self.writer.add_scalar(k, float(v), global_step=step)
        self.writer.flush()

    def video(self, tag: str, path: Path, step: int, caption: str = "") -> None:
        """The video file at ``path`` as an animated GIF image summary ``tag`` (and its caption as text)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        frames = read_frames(path)
        image = Summary.Image(
            height=frames.shape[1],
            width=frames.shape[2],
            colorspace=3,
            encoded_image_string=gif_bytes(frames),
        )
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
        if caption:
            self.writer.add_text(f"{tag}/caption", caption.replace("\n", "  \n"), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
