"""Image-to-video: what is refused, until it is supported."""

from __future__ import annotations

import json

import pytest

from miles.models.wan import check_wan_folder


def _folder(tmp_path, class_name: str, in_channels: int):
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        (tmp_path / sub).mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    config = {"in_channels": in_channels, "out_channels": 16}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("class_name, in_channels", [("WanImageToVideoPipeline", 36), ("WanPipeline", 36)])
def test_image_to_video_folders_are_refused(tmp_path, class_name, in_channels):
    with pytest.raises(ValueError, match="image-to-video training is not supported yet"):
        check_wan_folder(_folder(tmp_path, class_name, in_channels))


def test_text_to_video_folder_passes(tmp_path):
    assert check_wan_folder(_folder(tmp_path, "WanPipeline", 16))["_class_name"] == "WanPipeline"
