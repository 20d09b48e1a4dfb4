"""Videos on disk: H.264 mp4 decoded back close to the frames written, GIF as the exact fallback,
and the sample logger writing mp4 files with their prompts and rewards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from miles.eval import videos as vid
from miles.train.logging import MetricsLogger


def smooth_video(f: int = 6, h: int = 32, w: int = 48) -> np.ndarray:
    """A gradient background with a square moving right: (F, H, W, 3) uint8."""
    y, x = np.mgrid[0:h, 0:w]
    frames = []
    for t in range(f):
        frame = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, 80)], axis=-1).astype(np.uint8)
        frame[8:20, 4 + 4 * t : 16 + 4 * t] = (230, 40, 40)
        frames.append(frame)
    return np.stack(frames)


def read_mp4(path) -> np.ndarray:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = reader.__next__()
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def test_mp4_round_trip(tmp_path):
    frames = smooth_video()
    path = vid.write_video(frames, tmp_path / "clip")
    assert path == tmp_path / "clip.mp4"
    assert path.read_bytes()[4:8] == b"ftyp"  # an ISO-BMFF (mp4) file
    back = read_mp4(path)
    assert back.shape == frames.shape
    err = np.abs(back.astype(int) - frames.astype(int))
    assert err.mean() < 3 and np.percentile(err, 99) < 40  # crf 18 on 4:2:0 chroma: near lossless
    # each decoded frame is closest to its own source frame: order and motion survive
    for t in range(len(frames)):
        dists = [np.abs(back[t].astype(int) - f.astype(int)).mean() for f in frames]
        assert int(np.argmin(dists)) == t


def test_odd_sizes_are_padded_to_even(tmp_path):
    frames = smooth_video(3, 15, 21)
    back = read_mp4(vid.write_video(frames, tmp_path / "odd"))
    assert back.shape == (3, 16, 22, 3)


def test_gif_fallback_is_exact(tmp_path, monkeypatch):
    from PIL import Image, ImageSequence

    monkeypatch.setenv("MILES_VIDEO_FORMAT", "gif")
    monkeypatch.setattr(vid, "_warned", False)
    frames = np.zeros((4, 16, 16, 3), np.uint8)
    for t in range(4):
        frames[t, :, 4 * t : 4 * t + 4] = (255, 0, 0)  # few colours: the palette keeps them exactly
    with pytest.warns(UserWarning, match="writing videos as GIF"):
        path = vid.write_video(frames, tmp_path / "clip")
    assert path.suffix == ".gif"
    back = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(path))])
    assert np.array_equal(back, frames)


def test_bad_frames_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\(F, H, W, 3\) uint8"):
        vid.write_video(np.zeros((2, 8, 8, 3), np.float32), tmp_path / "x")


def test_logger_writes_mp4_samples_with_prompts_and_rewards(tmp_path):
    logger = MetricsLogger(tmp_path, {}, mode="disabled", project="p", name="n", enabled=True)
    videos = torch.from_numpy(smooth_video()).permute(0, 3, 1, 2).float().div(255)[None].repeat(2, 1, 1, 1, 1)
    logger.log_videos(videos, ["a red square", "b"], [0.5, -1.25], step=3)
    logger.close()
    out = tmp_path / "samples" / "step_000003"
    assert sorted(p.name for p in out.iterdir()) == ["00.mp4", "01.mp4", "captions.json"]
    captions = json.loads((out / "captions.json").read_text())
    assert captions == [
        {"file": "00.mp4", "prompt": "a red square", "reward": 0.5},
        {"file": "01.mp4", "prompt": "b", "reward": -1.25},
    ]
    assert read_mp4(out / "00.mp4").shape == (6, 32, 48, 3)


def test_logger_takes_uint8_frames_as_the_trainer_keeps_them(tmp_path):
    # The trainer keeps rank 0's logged videos as to_uint8 copies on the CPU: the files must be those
    # the float videos give.
    videos = torch.from_numpy(smooth_video()).permute(0, 3, 1, 2).float().div(255)[None].repeat(2, 1, 1, 1, 1)
    for name, given in (("float", videos), ("uint8", [vid.to_uint8(v) for v in videos])):
        logger = MetricsLogger(tmp_path / name, {}, mode="disabled", project="p", name="n", enabled=True)
        logger.log_videos(given, ["a", "b"], [0.5, 1.0], step=1)
        logger.close()
    for i in ("00", "01"):
        a = read_mp4(tmp_path / "float" / "samples" / "step_000001" / f"{i}.mp4")
        b = read_mp4(tmp_path / "uint8" / "samples" / "step_000001" / f"{i}.mp4")
        assert np.array_equal(a, b)
