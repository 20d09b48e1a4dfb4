"""Local scorers (CLIPScore, HPSv2.1, the LAION aesthetic predictor, VideoAlign) on tiny random builds.

Each test saves a tiny random model in the real layout (``save_pretrained`` folders, an OpenCLIP
state dict under OpenCLIP's key names, the aesthetic head's ``layers.*`` state dict), loads it
through the reward with the hub offline, and compares the score with the formula written out
here in float64 — for HPSv2.1 with a functional OpenCLIP forward straight from the raw state
dict, so the key conversion into transformers' CLIP is checked too; for VideoAlign with the stock
Qwen2-VL and the reward head read from the saved file, and its video patches against the stock
Qwen2-VL image processor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from miles.rewards import build_rewards, tiny_clip
from miles.rewards.from_config import check_reward_config

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FRAMES = [0, 3, 6, 9]  # round(linspace(0, 9, 4))
PROMPTS = ["a red fox jumping over a lazy dog", "snow"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def videos_and_pixels(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos (2, 10, 3, 32, 32) at the tiny model's size (no resize) and the normalised pixels of
    their sampled frames, by hand: (B, K, 3, 32, 32) float64."""
    torch.manual_seed(seed)
    videos = torch.rand(2, 10, 3, 32, 32)
    u8 = (videos[:, FRAMES] * 255).round().clamp(0, 255) / 255
    mean = torch.tensor(OPENAI_CLIP_MEAN, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD, dtype=torch.float64).view(3, 1, 1)
    return videos, (u8.double() - mean) / std


def hf_embeddings(clip_dir, pixels, prompts):
    """Unit image (B, K, D) and text (B, D) embeddings of the saved CLIP, in float64."""
    from transformers import CLIPModel, CLIPTokenizer

    model = CLIPModel.from_pretrained(clip_dir).double().eval()
    tokens = CLIPTokenizer.from_pretrained(clip_dir)(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        image = model.visual_projection(model.vision_model(pixel_values=pixels.flatten(0, 1)).pooler_output)
        text = model.text_projection(model.text_model(**tokens).pooler_output)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    return unit(image).view(*pixels.shape[:2], -1), unit(text)


# --- CLIPScore ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flipped_clip_dir(clip_dir, tmp_path_factory):
    """The tiny CLIP with its text projection negated: every cosine changes sign."""
    from transformers import CLIPModel, CLIPProcessor

    path = tmp_path_factory.mktemp("flipped_clip")
    model = CLIPModel.from_pretrained(clip_dir)
    with torch.no_grad():
        model.text_projection.weight.neg_()
    model.save_pretrained(path)
    CLIPProcessor.from_pretrained(clip_dir).save_pretrained(path)
    return path


def test_clipscore_matches_reference(clip_dir, flipped_clip_dir):
    videos, pixels = videos_and_pixels(0)
    scores, coses = [], []
    for path in (clip_dir, flipped_clip_dir):
        score = build_rewards({"clipscore": 1.0}, {"clipscore": {"model_path": path}}).rewards["clipscore"](
            videos, PROMPTS
        )
        image, text = hf_embeddings(path, pixels, PROMPTS)
        cos = torch.einsum("bkd,bd->bk", image, text)
        reference = (2.5 * cos.clamp(min=0)).mean(dim=1)
        assert score.dtype == torch.float32 and score.shape == (2,)
        torch.testing.assert_close(score.double(), reference, rtol=1e-5, atol=1e-6)
        scores.append(score)
        coses.append(cos)
    # one model's cosines are all of one sign, the flipped one's of the other: the clamp and the
    # 2.5 are both exercised (a score of 0 where cos < 0, 2.5 * cos where cos > 0)
    positive = 0 if (coses[0] > 0).all() else 1
    assert (coses[positive] > 0).all() and (coses[1 - positive] < 0).all()
    assert torch.equal(scores[1 - positive], torch.zeros(2))
    torch.testing.assert_close(
        scores[positive].double(), 2.5 * coses[positive].mean(dim=1), rtol=1e-5, atol=1e-6
    )


# --- the LAION aesthetic predictor -------------------------------------------------------------


def test_aesthetic_matches_reference(clip_dir, tmp_path):
    torch.manual_seed(3)
    dims = [16, 1024, 128, 64, 16, 1]  # the real head's sizes after a tiny CLIP's 16-d embedding
    head = {}
    for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims[:-1], dims[1:])):
        head[f"layers.{i}.weight"] = torch.randn(b, a) / math.sqrt(a)
        head[f"layers.{i}.bias"] = torch.randn(b) * 0.1
    torch.save(head, tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    videos, pixels = videos_and_pixels(1)
    reward = build_rewards({"aesthetic": 1.0}, {"aesthetic": {"clip_path": clip_dir, "head_path": tmp_path}})
    score = reward.rewards["aesthetic"](videos, PROMPTS)

    image, _ = hf_embeddings(clip_dir, pixels, PROMPTS)
    x = image
    for i in (0, 2, 4, 6, 7):  # no activation between the layers, dropout off in eval
        x = x @ head[f"layers.{i}.weight"].double().T + head[f"layers.{i}.bias"].double()
    reference = x.squeeze(-1).mean(dim=1)
    torch.testing.assert_close(score.double(), reference, rtol=1e-5, atol=1e-5)


# --- HPSv2.1 (an OpenCLIP checkpoint) ----------------------------------------------------------


def open_clip_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random OpenCLIP ``CLIP.state_dict()`` for the towers of ``cfg`` (a transformers CLIPConfig)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=0.1: torch.randn(*shape, generator=g) * s  # noqa: E731
    v, t, e = cfg.vision_config, cfg.text_config, cfg.projection_dim
    sd = {"logit_scale": torch.tensor(math.log(1 / 0.07))}

    def blocks(prefix, w, inter, layers):
        for i in range(layers):
            p = f"{prefix}resblocks.{i}."
            sd.update({p + "ln_1.weight": 1 + rnd(w), p + "ln_1.bias": rnd(w), p + "ln_2.weight": 1 + rnd(w)})
            sd.update({p + "ln_2.bias": rnd(w), p + "attn.in_proj_weight": rnd(3 * w, w, s=0.3)})
            sd.update({p + "attn.in_proj_bias": rnd(3 * w), p + "attn.out_proj.weight": rnd(w, w, s=0.3)})
            sd.update({p + "attn.out_proj.bias": rnd(w), p + "mlp.c_fc.weight": rnd(inter, w, s=0.3)})
            sd.update({p + "mlp.c_fc.bias": rnd(inter), p + "mlp.c_proj.weight": rnd(w, inter, s=0.3)})
            sd[p + "mlp.c_proj.bias"] = rnd(w)

    w, grid = v.hidden_size, v.image_size // v.patch_size
    sd.update(
        {"visual.conv1.weight": rnd(w, 3, v.patch_size, v.patch_size), "visual.class_embedding": rnd(w)}
    )
    sd.update({"visual.positional_embedding": rnd(grid * grid + 1, w), "visual.proj": rnd(w, e, s=0.3)})
    sd.update({"visual.ln_pre.weight": 1 + rnd(w), "visual.ln_pre.bias": rnd(w)})
    sd.update({"visual.ln_post.weight": 1 + rnd(w), "visual.ln_post.bias": rnd(w)})
    blocks("visual.transformer.", w, v.intermediate_size, v.num_hidden_layers)
    w = t.hidden_size
    sd.update({"token_embedding.weight": rnd(t.vocab_size, w, s=0.5), "text_projection": rnd(w, e, s=0.3)})
    sd.update({"positional_embedding": rnd(t.max_position_embeddings, w), "ln_final.weight": 1 + rnd(w)})
    sd["ln_final.bias"] = rnd(w)
    blocks("transformer.", w, t.intermediate_size, t.num_hidden_layers)
    return sd


def ref_resblock(x, sd, p, heads, causal):
    """OpenCLIP's ResidualAttentionBlock (pre-LN, nn.MultiheadAttention, GELU MLP), float64."""
    b, s, w = x.shape
    h = F.layer_norm(x, (w,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps=1e-5)
    q, k, v = (h @ sd[p + "attn.in_proj_weight"].T + sd[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
    q, k, v = (t.view(b, s, heads, w // heads).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    att = q @ k.transpose(-1, -2) / math.sqrt(w // heads)
    if causal:
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, w)
    x = x + o @ sd[p + "attn.out_proj.weight"].T + sd[p + "attn.out_proj.bias"]
    h = F.layer_norm(x, (w,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps=1e-5)
    h = F.gelu(h @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"])
    return x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]


def ref_open_clip(sd, cfg, pixels, input_ids, eot_id):
    """OpenCLIP's encode_image / encode_text, unit-normalised: (N, E) and (B, E) float64."""
    sd = {k: v.double() for k, v in sd.items()}
    w = cfg.vision_config.hidden_size
    x = (
        F.conv2d(pixels, sd["visual.conv1.weight"], stride=cfg.vision_config.patch_size)
        .flatten(2)
        .transpose(1, 2)
    )
    x = (
        torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, w), x], dim=1)
        + sd["visual.positional_embedding"]
    )
    x = F.layer_norm(x, (w,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], eps=1e-5)
    for i in range(cfg.vision_config.num_hidden_layers):
        x = ref_resblock(
            x, sd, f"visual.transformer.resblocks.{i}.", cfg.vision_config.num_attention_heads, False
        )
    image = F.layer_norm(x[:, 0], (w,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"], eps=1e-5)
    image = image @ sd["visual.proj"]
    w = cfg.text_config.hidden_size
    x = sd["token_embedding.weight"][input_ids] + sd["positional_embedding"][: input_ids.shape[1]]
    for i in range(cfg.text_config.num_hidden_layers):
        x = ref_resblock(x, sd, f"transformer.resblocks.{i}.", cfg.text_config.num_attention_heads, True)
    x = F.layer_norm(x, (w,), sd["ln_final.weight"], sd["ln_final.bias"], eps=1e-5)
    eot = (input_ids == eot_id).int().argmax(dim=1)  # the first end-of-text token
    text = x[torch.arange(x.shape[0]), eot] @ sd["text_projection"]
    return image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)


def test_hpsv2_loads_open_clip_checkpoint_and_matches_reference(clip_dir, tmp_path):
    from transformers import CLIPConfig, CLIPTokenizer

    arch = tmp_path / "arch"
    tiny_clip(arch)
    cfg = CLIPConfig.from_pretrained(arch)
    cfg.text_config.hidden_act = cfg.vision_config.hidden_act = "gelu"  # as laion's ViT-H-14
    cfg.save_pretrained(arch)
    sd = open_clip_state(cfg)
    torch.save({"state_dict": sd}, tmp_path / "HPS_v2.1_compressed.pt")

    videos, pixels = videos_and_pixels(2)
    reward = build_rewards({"hpsv2": 1.0}, {"hpsv2": {"model_path": tmp_path, "processor_path": arch}})
    reward = reward.rewards["hpsv2"]
    score = reward(videos, PROMPTS)

    tokenizer = CLIPTokenizer.from_pretrained(arch)
    ids = tokenizer(PROMPTS, padding=True, return_tensors="pt")["input_ids"]
    image, text = ref_open_clip(sd, cfg, pixels.flatten(0, 1), ids, tokenizer.eos_token_id)
    reference = torch.einsum("bkd,bd->bk", image.view(2, len(FRAMES), -1), text).mean(dim=1)
    torch.testing.assert_close(score.double(), reference, rtol=1e-5, atol=1e-5)
    assert reference.abs().min() > 1e-3  # not a trivially zero score

    torch.save({"state_dict": {**sd, "visual.extra": torch.zeros(1)}}, tmp_path / "HPS_v2.1_compressed.pt")
    with pytest.raises(ValueError, match="unexpected OpenCLIP tensor visual.extra"):
        build_rewards({"hpsv2": 1.0}, {"hpsv2": {"model_path": tmp_path, "processor_path": arch}})


# --- missing weights are refused before anything loads, naming the repo --------------------------


@pytest.mark.parametrize(
    "weights, options, match",
    [
        ({"clipscore": 1.0}, {}, r"set reward\.clipscore\.model_path .*openai/clip-vit-base-patch32"),
        ({"hpsv2": 1.0}, {"processor_path": "CLIP"}, r"set reward\.hpsv2\.model_path .*xswu/HPSv2"),
        (
            {"hpsv2": 1.0},
            {"model_path": "NOPE"},
            r"reward\.hpsv2\.model_path='.*nope' does not exist.*xswu/HPSv2",
        ),
        ({"aesthetic": 1.0}, {"clip_path": "CLIP"}, r"aesthetic\.head_path.*improved-aesthetic"),
        ({"aesthetic": 1.0}, {"head_path": "x"}, r"aesthetic\.clip_path.*openai/clip-vit-large"),
    ],
)
def test_missing_weights_are_refused_before_loading(clip_dir, tmp_path, monkeypatch, weights, options, match):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the paths were checked")

    # The processor is part of the check (loaded by the constructor's own loader: cheap); no model is.
    monkeypatch.setattr(transformers.CLIPModel, "from_pretrained", no_loading)
    resolved = {k: {"CLIP": clip_dir, "NOPE": str(tmp_path / "nope")}.get(v, v) for k, v in options.items()}
    with pytest.raises(ValueError, match=match):
        build_rewards({"jpeg_incompressibility": 1.0, **weights}, {name: resolved for name in weights})


def test_dry_run_check_refuses_missing_gold_weights(tmp_path):
    from miles.config import RewardConfig
    from miles.rewards.clipscore import CLIPScoreOptions

    with pytest.raises(
        ValueError, match=r"reward\.clipscore\.model_path=.* holds no config\.json.*clip-vit-base"
    ):
        check_reward_config(
            RewardConfig(gold=["clipscore"], clipscore=CLIPScoreOptions(model_path=str(tmp_path)))
        )


# --- VideoAlign-style (Qwen2-VL + rm_head) -----------------------------------------------------


@pytest.fixture(scope="module")
def videoalign_dir(tmp_path_factory):
    from miles.rewards.tiny_videoalign import tiny_videoalign

    return tiny_videoalign(tmp_path_factory.mktemp("tiny_videoalign"))


def test_video_patches_match_the_qwen2vl_image_processor(videoalign_dir):
    """Two identical frames patchify as the stock processor patchifies that image (it tiles an image
    over the temporal patch), resize included: 50x70 -> smart_resize -> 56x56 here."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from miles.rewards.videoalign import video_patches

    proc = json.loads((Path(videoalign_dir) / "preprocessor_config.json").read_text())
    torch.manual_seed(4)
    image = (torch.rand(50, 70, 3) * 255).round().to(torch.uint8).numpy()
    ours, grid = video_patches(np.stack([image, image]), proc, max_pixels=proc["max_pixels"])
    stock = Qwen2VLImageProcessorPil(
        min_pixels=proc["min_pixels"],
        max_pixels=proc["max_pixels"],
        image_mean=proc["image_mean"],
        image_std=proc["image_std"],
    )(images=[Image.fromarray(image)], return_tensors="pt")
    assert list(grid) == stock["image_grid_thw"][0].tolist()
    torch.testing.assert_close(ours, stock["pixel_values"].float(), rtol=1e-5, atol=1e-5)


def test_videoalign_matches_reference(videoalign_dir):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from miles.rewards.videoalign import CHAT, MEAN, QUESTION, STD, video_patches

    torch.manual_seed(5)
    videos, prompts = torch.rand(2, 9, 3, 40, 48), ["a red ball rolls left", "snow"]
    reward = build_rewards(
        {"videoalign": 1.0}, {"videoalign": {"model_path": videoalign_dir, "num_frames": 4}}
    )
    score = reward.rewards["videoalign"](videos, prompts)
    ta_options = {"model_path": videoalign_dir, "num_frames": 4, "dimension": "ta"}
    ta = build_rewards({"videoalign": 1.0}, {"videoalign": ta_options}).rewards["videoalign"](videos, prompts)

    # the reference: the stock Qwen2-VL (no rm_head) in float64, the head read from the file
    model = Qwen2VLForConditionalGeneration.from_pretrained(videoalign_dir).double().eval()
    head = load_file(str(Path(videoalign_dir) / "model.safetensors"))["rm_head.weight"].double()
    tokenizer = AutoTokenizer.from_pretrained(videoalign_dir)
    proc = json.loads((Path(videoalign_dir) / "preprocessor_config.json").read_text())
    reference = []
    for video, prompt in zip(videos, prompts):
        frames = (video[[0, 3, 5, 8]] * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        patches, grid = video_patches(frames, proc, max_pixels=448 * 448)
        n = grid[0] * grid[1] * grid[2] // 4
        text = CHAT.format(video="<|video_pad|>" * n, question=QUESTION.format(prompt=prompt))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hidden = model.model(
                input_ids=ids,
                pixel_values_videos=patches.double(),
                video_grid_thw=torch.tensor([grid]),
                mm_token_type_ids=(ids == model.config.video_token_id).long() * 2,
            ).last_hidden_state[0]
        rows = []
        for i, token in enumerate(["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]):
            pos = int((ids[0] == tokenizer.convert_tokens_to_ids(token)).nonzero()[0])
            rows.append((float(hidden[pos] @ head[i]) - MEAN[i]) / STD[i])
        reference.append(rows)
    reference = torch.tensor(reference, dtype=torch.float64)
    torch.testing.assert_close(score.double(), reference.sum(dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ta.double(), reference[:, 2], rtol=1e-4, atol=1e-4)
    assert (reference[0] - reference[1]).abs().max() > 1e-3  # the videos and prompts matter


def test_videoalign_refuses_a_folder_without_rm_head_or_weights(videoalign_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match=r"set reward\.videoalign\.model_path .*KwaiVGI/VideoReward"):
        build_rewards({"videoalign": 1.0})
    headless = tmp_path / "headless"
    shutil.copytree(videoalign_dir, headless)
    state = load_file(str(headless / "model.safetensors"))
    del state["rm_head.weight"]
    save_file(state, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds no rm_head.weight"):
        build_rewards({"videoalign": 1.0}, {"videoalign": {"model_path": headless}})


def test_reward_server_passes_any_reward_option(capsys):
    from miles.rewards import serve

    argv = ["--rewards", "clipscore", "--port", "0", "--reward-option", "clipscore.model_path=/x/clip"]
    assert serve.main(argv) == 2
    assert "reward.clipscore.model_path='/x/clip' is not a folder" in capsys.readouterr().err
    assert serve.main(["--rewards", "clipscore", "--reward-option", "no-equals-sign"]) == 2
    assert serve.main(["--rewards", "clipscore", "--reward-option", "clipscore.modle_path=/x"]) == 2
    assert "unknown option(s) ['modle_path'] of reward 'clipscore'" in capsys.readouterr().err
