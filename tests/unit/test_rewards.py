"""Tests for miles.rewards: the registry's weighted mix, the DDPO JPEG rewards and PickScore.

Every score is compared against a reference written out here: JPEG sizes straight from PIL, and
PickScore from a ``CLIPModel`` run by hand on hand-normalised pixels (a tiny random CLIP saved
and reloaded from a local folder with the hub offline).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import miles.rewards.registry as registry
from miles.rewards import (
    MultiReward,
    PickScore,
    Reward,
    build_rewards,
    register_reward,
    registered_rewards,
    sample_frame_indices,
    tiny_clip,
)

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def ref_uint8(frames: torch.Tensor) -> np.ndarray:
    """(..., C, H, W) in [0, 1] -> (..., H, W, C) uint8, as DDPO writes it."""
    return (
        (frames * 255)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        .permute(*range(frames.ndim - 3), -2, -1, -3)
        .numpy()
    )


def ref_jpeg_kb(videos: torch.Tensor, frame_idx: list[int]) -> torch.Tensor:
    """Mean JPEG (quality 95) size in kB over ``frame_idx`` of each video: (B,) float64."""
    out = []
    for video in videos:
        sizes = []
        for i in frame_idx:
            buf = io.BytesIO()
            Image.fromarray(ref_uint8(video[i])).save(buf, format="JPEG", quality=95)
            sizes.append(len(buf.getvalue()) / 1000)
        out.append(sum(sizes) / len(sizes))
    return torch.tensor(out, dtype=torch.float64)


@pytest.fixture
def mean_intensity_reward():
    """A throwaway registered reward (mean pixel value), removed from the registry afterwards."""

    @register_reward("test_mean_intensity")
    class MeanIntensity(Reward):
        def __init__(self, num_frames: int | None = 4) -> None:
            pass

        def __call__(self, videos, prompts):
            return videos.mean(dim=(1, 2, 3, 4))

    yield "test_mean_intensity"
    del registry._REGISTRY["test_mean_intensity"]


# --- frame sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_total, num_samples, expected",
    [
        (10, 4, [0, 3, 6, 9]),
        (81, 4, [0, 27, 53, 80]),
        (5, 1, [0]),
        (3, 4, [0, 1, 2]),
        (1, 4, [0]),
        (6, None, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_sample_frame_indices(num_total, num_samples, expected):
    assert sample_frame_indices(num_total, num_samples).tolist() == expected


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_sample_frame_indices_rejects_bad_count(bad):
    with pytest.raises(ValueError, match="num_frames"):
        sample_frame_indices(10, bad)


# --- registry ------------------------------------------------------------------------------------


def test_multireward_is_the_weighted_sum(mean_intensity_reward):
    torch.manual_seed(0)
    videos = torch.rand(3, 7, 3, 16, 24)
    videos[0] = 0.5  # one smooth video so the JPEG sizes differ a lot across the batch
    prompts = ["a", "b", "c"]
    weights = {"jpeg_compressibility": 0.5, "jpeg_incompressibility": -2.0, mean_intensity_reward: 3.0}

    rewards = build_rewards(weights, num_frames=3)
    assert isinstance(rewards, MultiReward) and rewards.names == list(weights)
    combined, per_reward = rewards(videos, prompts)

    kb = ref_jpeg_kb(videos, [0, 3, 6]).float()
    expected = {
        "jpeg_compressibility": -kb,
        "jpeg_incompressibility": kb,
        mean_intensity_reward: videos.mean((1, 2, 3, 4)),
    }
    assert per_reward.keys() == expected.keys()
    for name, value in expected.items():
        assert per_reward[name].shape == (3,) and per_reward[name].dtype == torch.float32
        torch.testing.assert_close(per_reward[name], value)
    reference = sum(weights[name] * value for name, value in expected.items())
    torch.testing.assert_close(combined, reference)


def test_unknown_reward_lists_registered_names():
    with pytest.raises(ValueError, match="unknown reward 'imagereward'") as e:
        build_rewards({"imagereward": 1.0})
    for name in ["jpeg_compressibility", "jpeg_incompressibility", "pickscore"]:
        assert name in str(e.value)
    assert {"jpeg_compressibility", "jpeg_incompressibility", "pickscore"} <= set(registered_rewards())


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf"), "1.0", None, True, [1.0]])
def test_bad_weight_is_rejected(weight):
    with pytest.raises(ValueError, match="jpeg_compressibility.*finite number"):
        build_rewards({"jpeg_compressibility": weight})


def test_empty_specs_and_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="at least one reward"):
        build_rewards({})
    with pytest.raises(ValueError, match="unknown reward argument.*num_frame"):
        build_rewards({"jpeg_compressibility": 1.0}, num_frame=2)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("pickscore")(PickScore)


def test_bad_videos_and_prompts_are_rejected():
    rewards = build_rewards({"jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match=r"\(B, F, C, H, W\)"):
        rewards(torch.rand(2, 3, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="one prompt per video"):
        rewards(torch.rand(2, 1, 3, 8, 8), ["a"])


# --- JPEG ----------------------------------------------------------------------------------------


def test_jpeg_matches_pil_and_orders_smooth_above_noise():
    torch.manual_seed(0)
    noise = torch.rand(1, 5, 3, 32, 48)
    constant = torch.full((1, 5, 3, 32, 48), 0.3)
    videos = torch.cat([constant, noise])
    comp = build_rewards({"jpeg_compressibility": 1.0}, num_frames=2).rewards["jpeg_compressibility"]
    incomp = build_rewards({"jpeg_incompressibility": 1.0}, num_frames=2).rewards["jpeg_incompressibility"]

    c, i = comp(videos, ["", ""]), incomp(videos, ["", ""])
    kb = ref_jpeg_kb(videos, [0, 4]).float()
    torch.testing.assert_close(c, -kb)
    torch.testing.assert_close(i, kb)
    assert c[0] > c[1] and i[0] < i[1]  # a constant frame compresses better than noise
    assert torch.equal(comp(videos, ["", ""]), c)  # deterministic


# --- PickScore -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture
def offline(monkeypatch):
    """The hub offline, as on the cluster: loading must work from the folder alone."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def ref_pickscore(model, tokenizer, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """PickScore written out: pixels (B, K, 3, h, w) already normalised -> (B,) float64."""
    b, k = pixels.shape[:2]
    with torch.no_grad():
        tokens = tokenizer(prompts, padding=True, return_tensors="pt")
        text = model.get_text_features(**tokens).pooler_output.double()
        image = model.get_image_features(pixel_values=pixels.flatten(0, 1)).pooler_output.double()
        scale = model.logit_scale.exp().double()
    text = text / text.norm(dim=-1, keepdim=True)
    image = (image / image.norm(dim=-1, keepdim=True)).view(b, k, -1)
    per_frame = scale * torch.einsum("bd,bkd->bk", text, image) / 26
    return per_frame.mean(dim=1)


def test_pickscore_matches_clip_reference(clip_dir, offline):
    from transformers import CLIPModel, CLIPTokenizer

    torch.manual_seed(1)
    videos = torch.rand(2, 10, 3, 32, 32)  # frames already at the model's 32x32: no resize
    prompts = ["a red fox jumping over a lazy dog", "snow"]
    rewards = build_rewards(
        {"pickscore": 1.0}, {"pickscore": {"model_path": clip_dir}}, num_frames=4, dtype="float32"
    )
    _, per_reward = rewards(videos, prompts)
    score = per_reward["pickscore"]

    model = CLIPModel.from_pretrained(clip_dir).eval()
    tokenizer = CLIPTokenizer.from_pretrained(clip_dir)
    frames = videos[:, [0, 3, 6, 9]]
    uint8 = torch.from_numpy(ref_uint8(frames)).permute(0, 1, 4, 2, 3).double() / 255  # (B, K, 3, H, W)
    mean, std = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1), torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    pixels = ((uint8 - mean) / std).float()
    reference = ref_pickscore(model, tokenizer, pixels, prompts)
    torch.testing.assert_close(score.double(), reference, rtol=1e-5, atol=1e-5)

    # The reference is sensitive to what it checks: other frames, or a missing /26, move it.
    other_frames = ref_pickscore(model, tokenizer, pixels[:, :2], prompts)
    assert (other_frames - reference).abs().min() > 1e-3
    assert (reference * 26 - reference).abs().min() > 1e-3


def test_pickscore_resizes_frames_like_the_processor(clip_dir, offline):
    from transformers import CLIPModel, CLIPProcessor, CLIPTokenizer

    torch.manual_seed(2)
    videos = torch.rand(2, 3, 3, 40, 56)  # not the model's size: the processor resizes and crops
    prompts = ["a", "b c"]
    reward = PickScore(model_path=clip_dir, num_frames=None)
    score = reward(videos, prompts)

    processor = CLIPProcessor.from_pretrained(clip_dir)
    model = CLIPModel.from_pretrained(clip_dir).eval()
    images = [Image.fromarray(f) for f in ref_uint8(videos).reshape(6, 40, 56, 3)]
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (6, 3, 32, 32)
    reference = ref_pickscore(
        model, CLIPTokenizer.from_pretrained(clip_dir), pixels.view(2, 3, 3, 32, 32), prompts
    )
    torch.testing.assert_close(score.double(), reference, rtol=1e-5, atol=1e-5)


def test_pickscore_missing_path_fails_before_loading(clip_dir, tmp_path, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the paths were validated")

    # The processor is part of the check (the constructor's own loader, cheap); the model is not.
    monkeypatch.setattr(transformers.CLIPModel, "from_pretrained", no_loading)

    with pytest.raises(ValueError, match=r"set reward\.pickscore\.model_path"):
        build_rewards({"jpeg_compressibility": 1.0, "pickscore": 1.0})
    with pytest.raises(ValueError, match=r"reward\.pickscore\.model_path=.*is not a folder"):
        build_rewards({"pickscore": 1.0}, {"pickscore": {"model_path": tmp_path / "nope"}})
    with pytest.raises(ValueError, match=r"reward\.pickscore\.model_path=.*config\.json"):
        build_rewards({"pickscore": 1.0}, {"pickscore": {"model_path": tmp_path, "processor_path": clip_dir}})
    with pytest.raises(ValueError, match=r"reward\.pickscore\.processor_path=.*tokenizer\.json"):
        (tmp_path / "preprocessor_config.json").write_text("{}")
        build_rewards({"pickscore": 1.0}, {"pickscore": {"model_path": clip_dir, "processor_path": tmp_path}})
    with pytest.raises(ValueError, match=r"reward\.dtype"):
        build_rewards({"pickscore": 1.0}, {"pickscore": {"model_path": clip_dir}}, dtype="float8")


def test_sharpness_against_numpy_reference():
    import numpy as np

    from miles.rewards import build_rewards

    g = torch.Generator().manual_seed(7)
    videos = torch.rand(3, 5, 3, 12, 10, generator=g)
    videos[1] = 0.5  # flat video: no gradient at all
    got, _ = build_rewards({"sharpness": 1.0}, num_frames=2)(videos, ["a", "b", "c"])
    v = videos.numpy().astype(np.float64)[:, [0, 4]]  # frames sampled uniformly: first and last
    y = 0.299 * v[:, :, 0] + 0.587 * v[:, :, 1] + 0.114 * v[:, :, 2]
    ref = np.abs(np.diff(y, axis=-1)).mean(axis=(-2, -1)) + np.abs(np.diff(y, axis=-2)).mean(axis=(-2, -1))
    ref = 10 * ref.mean(axis=1)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6)
    assert got[1] == 0 and got[0] > 0
