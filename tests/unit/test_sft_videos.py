"""The SFT video loader (``miles.data.videos``): JSONL errors that name the line, frame folders
read exactly, mp4 through the bundled ffmpeg, and the cover-resize + centre crop against its formula."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from miles.data.videos import fit_clip, load_clip, read_video_jsonl
from miles.eval.videos import mp4_encoder, write_mp4


def _frames(num: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth moving gradients (H.264 keeps them within a few levels)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 6, 3)
    out = [
        np.stack([127 + 100 * np.sin(x / 9 + y / 13 + k / 3 + p) for p in phase], axis=-1) for k in range(num)
    ]
    return np.clip(np.stack(out), 0, 255).round().astype(np.uint8)


def _folder(root, name: str, frames: np.ndarray):
    folder = root / name
    folder.mkdir()
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"{i:03d}.png")
    return folder


def _jsonl(root, lines: list) -> object:
    path = root / "data.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_frame_folder_exact(tmp_path):
    frames = _frames(6, 32, 48)
    _folder(tmp_path, "clip", frames)
    items = read_video_jsonl(_jsonl(tmp_path, [{"video": "clip", "prompt": "a clip"}, ""]))
    assert [(i.prompt, i.line, i.video.name) for i in items] == [("a clip", 1, "clip")]
    clip = load_clip(items[0], num_frames=5, height=32, width=48)
    assert clip.shape == (5, 3, 32, 48)
    assert torch.equal(clip, torch.from_numpy(frames[:5]).permute(0, 3, 1, 2).float() / 255.0)


@pytest.mark.skipif(mp4_encoder() is None, reason="no mp4 encoder")
def test_mp4_round_trip(tmp_path):
    frames = _frames(9, 64, 64, seed=1)
    write_mp4(frames, tmp_path / "v.mp4")
    items = read_video_jsonl(_jsonl(tmp_path, [{"video": "v.mp4", "prompt": "p"}]))
    clip = load_clip(items[0], num_frames=9, height=64, width=64)
    ref = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
    assert clip.shape == ref.shape
    assert float((clip - ref).abs().mean()) < 0.02  # H.264 crf 18 on smooth content
    with pytest.raises(ValueError, match=r"data.jsonl:1: video .*v.mp4: has 9 frames; .* 13"):
        load_clip(items[0], num_frames=13, height=64, width=64)


def test_resize_and_centre_crop_formula():
    # a horizontal ramp, 96 x 128 -> cover 64 x 64: scale 2/3, 64 x 85, crop 10 columns from the left
    h, w = 96, 128
    ramp = np.broadcast_to(np.arange(w, dtype=np.float64)[None, :, None], (h, w, 3))
    frames = np.stack([ramp.round().astype(np.uint8)] * 2)
    clip = fit_clip(frames, 1, 64, 64)
    assert clip.shape == (1, 3, 64, 64)
    scale = 85 / 128
    cols = np.arange(10, 74)
    ref = ((cols + 0.5) / scale - 0.5) / 255.0  # a linear ramp survives an antialiased bilinear resize
    got = clip[0, 0, 32].double().numpy()
    assert np.allclose(got[4:-4], ref[4:-4], atol=2e-3)


@pytest.mark.parametrize(
    "line,match",
    [
        ('{"video": "clip", "prompt": "ok"', r"data.jsonl:2: not valid JSON"),
        ({"video": "missing", "prompt": "p"}, r"data.jsonl:2: 'video' .*missing does not exist"),
        ({"video": "clip"}, r"data.jsonl:2: needs a non-empty string 'prompt'"),
        ({"prompt": "p"}, r"data.jsonl:2: needs a 'video' key"),
        ({"video": "empty", "prompt": "p"}, r"data.jsonl:2: the frame folder .*empty holds no"),
    ],
)
def test_bad_line_is_named(tmp_path, line, match):
    _folder(tmp_path, "clip", _frames(2, 8, 8))
    (tmp_path / "empty").mkdir()
    path = _jsonl(tmp_path, [{"video": "clip", "prompt": "fine"}, line])
    with pytest.raises(ValueError, match=match):
        read_video_jsonl(path)


def test_run_plan_checks_the_video_jsonl(tmp_path):
    """The run plan (and so the dry run) refuses an SFT run whose JSONL names a missing video."""
    from miles.config import Config
    from miles.train.sources import check_batch_source

    path = _jsonl(tmp_path, [{"video": "gone.mp4", "prompt": "p"}])
    cfg = Config()
    cfg.data.prompt_file = str(path)
    check_batch_source(cfg)  # flow_grpo rolls out: the file is only a prompt file to it
    cfg.algorithm.name = "sft"
    with pytest.raises(ValueError, match=r"data.jsonl:1: 'video' .*gone.mp4 does not exist"):
        check_batch_source(cfg)


def test_broken_videos_are_refused_by_the_plan_all_at_once(tmp_path):
    """Every kind of broken video (unreadable or empty mp4, too few frames, frames of mixed sizes, a
    frame that is no image) is refused by the run plan's check, each naming its JSONL line, at once;
    ``load_clip`` (what the SFT source decodes with) refuses each with the same words."""
    from miles.config import Config
    from miles.data.videos import check_clip
    from miles.train.sources import check_batch_source

    _folder(tmp_path, "good", _frames(5, 8, 8))
    _folder(tmp_path, "short", _frames(3, 8, 8))
    mixed = _folder(tmp_path, "mixed", _frames(5, 8, 8))
    Image.fromarray(_frames(1, 16, 8)[0]).save(mixed / "002.png")
    (_folder(tmp_path, "corrupt", _frames(5, 8, 8)) / "001.png").write_bytes(b"not a png")
    (tmp_path / "junk.mp4").write_bytes(b"hello" * 100)
    (tmp_path / "empty.mp4").write_bytes(b"")
    names = ["good", "short", "mixed", "corrupt", "junk.mp4", "empty.mp4"]
    path = _jsonl(tmp_path, [{"video": n, "prompt": n} for n in names])
    cfg = Config()
    cfg.data.prompt_file, cfg.algorithm.name = str(path), "sft"
    with pytest.raises(ValueError) as info:
        check_batch_source(cfg)
    expected = [
        "data.jsonl:2: video .*short: has 3 frames; the recipe needs rollout.num_frames = 5",
        r"data.jsonl:3: video .*mixed: the frames differ in size \(width x height \[\(8, 8\), \(8, 16\)\]\)",
        "data.jsonl:4: video .*corrupt: the frame 001.png is not a readable image",
        r"data.jsonl:5: video .*junk.mp4: ffmpeg cannot read it \(.*\)",
        r"data.jsonl:6: video .*empty.mp4: ffmpeg cannot read it \(.*\)",
    ]
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for problem, pattern in zip(problems, expected):
        assert re.search(pattern, problem), (pattern, problem)
        assert "\n" not in problem and "ffmpeg version" not in problem
    items = read_video_jsonl(path)
    for item, problem in zip(items[1:], problems):
        with pytest.raises(ValueError) as loaded:
            load_clip(item, num_frames=5, height=8, width=8)
        assert str(loaded.value) == problem
    check_clip(items[0].video, 5)


@pytest.mark.skipif(mp4_encoder() is None, reason="no mp4 encoder")
def test_an_mp4_with_too_few_frames_is_refused_without_decoding(tmp_path):
    from miles.data.videos import check_clip

    write_mp4(_frames(9, 64, 64), tmp_path / "v.mp4")
    check_clip(tmp_path / "v.mp4", 9)
    with pytest.raises(ValueError, match="has 9 frames; the recipe needs rollout.num_frames = 13"):
        check_clip(tmp_path / "v.mp4", 13)


def test_the_dry_run_refuses_a_broken_sft_dataset(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    import train_grpo

    repo = Path(__file__).resolve().parents[2]
    _folder(tmp_path, "short", _frames(3, 8, 8))
    (tmp_path / "empty.mp4").write_bytes(b"")
    lines = [{"video": "short", "prompt": f"p{i}"} for i in range(4)] + [
        {"video": "empty.mp4", "prompt": "e"}
    ]
    path = _jsonl(tmp_path, lines)
    monkeypatch.chdir(repo)
    argv = ["--config", "configs/tiny_cpu.yaml", "--model.tiny-model-dir", str(repo / ".cache" / "tiny-wan")]
    argv += [
        "--run.output-dir",
        str(tmp_path / "runs"),
        "--algorithm.name",
        "sft",
        "--data.prompt-file",
        str(path),
    ]
    assert train_grpo.main([*argv, "--dry-run", "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 5 inputs the run would refuse"), err
    assert "data.jsonl:1: video" in err and "has 3 frames; the recipe needs rollout.num_frames = 5" in err
    assert "data.jsonl:5: video" in err and "empty.mp4: ffmpeg cannot read it" in err
