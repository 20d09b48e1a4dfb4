"""The tiny world with its first frame given: committed prompt sets, the world_i2v reward, the model folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from miles.data.prompts import load_prompts
from miles.models.i2v import condition_mode
from miles.rewards import build_rewards
from miles.rewards.shaping import EvalRewards
from miles.rewards.world_i2v import world_i2v_scores
from miles.world.i2v import PROMPT_DIR, build_i2v_world, first_frame, i2v_records
from miles.world.world import Attributes, is_heldout, parse_prompt, render

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
COLOUR_SHIFT = {"red": "green", "green": "blue", "blue": "yellow", "yellow": "red"}


def _records() -> list[dict]:
    return i2v_records("train") + i2v_records("heldout")


def _ground_truth(records: list[dict]) -> tuple[torch.Tensor, list[str], list]:
    videos = torch.stack([render(parse_prompt(r["prompt"]), r["seed"]) for r in records])
    return videos, [r["prompt"] for r in records], [PROMPT_DIR / r["image"] for r in records]


def test_committed_prompt_sets_are_the_generated_ones():
    for split in ("train", "heldout"):
        records = i2v_records(split)
        lines = (PROMPT_DIR / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == records
        assert [p.text for p in load_prompts(PROMPT_DIR / f"{split}.jsonl")] == [r["prompt"] for r in records]
        for r in records:
            committed = np.asarray(Image.open(PROMPT_DIR / r["image"]).convert("RGB"))
            np.testing.assert_array_equal(
                committed, first_frame(r["prompt"], r["seed"]).permute(1, 2, 0).numpy()
            )


def test_splits_follow_the_worlds_latin_square():
    train, heldout = i2v_records("train"), i2v_records("heldout")
    assert (len(train), len(heldout)) == (48, 16)
    assert not any(is_heldout(parse_prompt(r["prompt"])) for r in train)
    assert all(is_heldout(parse_prompt(r["prompt"])) for r in heldout)
    assert len({r["seed"] for r in train + heldout}) == 64  # every image its own render


def test_ground_truth_scores_one_and_a_wrong_direction_half():
    videos, prompts, images = _ground_truth(_records())
    s = world_i2v_scores(videos, prompts, images)
    assert s["i2v"].min() > 0.98, s["i2v"]
    wrong = [p.rsplit(" ", 1)[0] + " " + OPPOSITE[p.split()[-1]] for p in prompts]
    w = world_i2v_scores(videos, wrong, images)
    assert torch.allclose(w["motion"], torch.zeros(len(prompts)))
    assert torch.allclose(
        w["i2v"], s["i2v"] - s["quality"] * s["motion"] / 2 + s["quality"] * w["motion"] / 2
    )
    assert (w["i2v"] - 0.5).abs().max() < 0.02


def test_videos_inconsistent_with_the_given_frame_score_low():
    records = _records()
    _, prompts, images = _ground_truth(records)
    # the prompt's motion, but another colour than the image's, from the image's start
    recoloured = []
    for r in records:
        a = parse_prompt(r["prompt"])
        recoloured.append(render(Attributes(COLOUR_SHIFT[a.colour], a.motion, a.size), r["seed"]))
    s = world_i2v_scores(torch.stack(recoloured), prompts, images)
    assert torch.allclose(s["colour"], torch.zeros(len(records)), atol=1e-3)
    assert (s["i2v"] - 5 / 6).abs().max() < 0.02, s["i2v"]
    # wrong in everything: colour, size, motion, and started elsewhere
    others = []
    for r in records:
        a = parse_prompt(r["prompt"])
        other = Attributes(COLOUR_SHIFT[a.colour], OPPOSITE[a.motion], "small" if a.size == "big" else "big")
        others.append(render(other, r["seed"] + 555))
    s = world_i2v_scores(torch.stack(others), prompts, images)
    assert s["i2v"].max() < 0.07 and s["i2v"].mean() < 0.01, s["i2v"]


def test_a_ball_that_jumps_away_from_the_given_start_loses_start():
    r = i2v_records("heldout")[0]
    video = render(parse_prompt(r["prompt"]), r["seed"])
    shifted = video.clone()
    shifted[1:] = torch.roll(video[1:], shifts=12, dims=-2)  # frames 1.. 12 px lower: a jump
    s = world_i2v_scores(torch.stack([video, shifted]), [r["prompt"]] * 2, [PROMPT_DIR / r["image"]] * 2)
    assert s["start"][0] > 0.99 and s["start"][1] < 1e-6, s["start"]


def test_images_as_tensors_equal_image_files():
    records = i2v_records("heldout")[:4]
    videos, prompts, files = _ground_truth(records)
    tensors = [first_frame(r["prompt"], r["seed"]).float() / 255 for r in records]
    assert torch.equal(
        world_i2v_scores(videos, prompts, files)["i2v"], world_i2v_scores(videos, prompts, tensors)["i2v"]
    )


def test_the_mix_passes_images_only_to_rewards_that_need_them():
    videos, prompts, images = _ground_truth(i2v_records("heldout")[:2])
    mix = build_rewards({"world_i2v": 1.0, "world_adherence": 0.5})
    assert mix.needs_images and not build_rewards({"world_adherence": 1.0}).needs_images
    combined, per = mix(videos, prompts, images)
    expected = world_i2v_scores(videos, prompts, images)["i2v"] + 0.5 * per["world_adherence"]
    assert torch.allclose(combined, expected)
    with pytest.raises(ValueError, match="'image' per prompt"):
        mix(videos, prompts)
    # evaluation's mix (trained + gold rewards) passes the images on to both
    gold = build_rewards({"world_i2v": 0.0})
    combined_eval, per_eval = EvalRewards(mix, gold)(videos, prompts, images)
    assert torch.equal(combined_eval, combined) and torch.equal(per_eval["world_i2v"], per["world_i2v"])


def test_i2v_world_folder_is_ti2v_image_mode_over_the_committed_weights(tmp_path):
    out = build_i2v_world(tmp_path / "world-i2v")
    index = json.loads((out / "model_index.json").read_text())
    assert index["expand_timesteps"] is True
    assert (out / "transformer").resolve() == (PROMPT_DIR.parent / "pipeline" / "transformer").resolve()
    assert condition_mode(out, index, "i2v") == "first_frame"
    assert condition_mode(out, index, "auto") is None  # a WanPipeline folder: T2V unless asked
