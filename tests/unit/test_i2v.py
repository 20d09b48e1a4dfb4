"""Image-to-video: folders and tasks, the image condition, and parity with ``WanImageToVideoPipeline``.

The tiny I2V models (``miles.models.tiny_i2v``: Wan2.1-I2V, Wan2.2-I2V-A14B and TI2V-5B layouts)
on CPU in fp32. The pipeline sampler with the image condition against the stock pipeline's
``__call__`` (same prompt embeddings, image, initial latents and scheduler, ``output_type="latent"``):
bitwise without CFG; with CFG the pipeline runs two forwards where the sampler runs one batched
[cond; uncond] forward, so they agree to fp32 rounding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config import ModelConfig
from miles.eval.evaluate import EvalSettings, sample_with_scheduler
from miles.models.i2v import condition_mode
from miles.models.wan import check_wan_folder, load_wan
from miles.rollout.sampler import compute_log_prob, sample_with_logprob

PROMPTS = ["a red ball", "a blue cube rolling"]
TEXT_TOKENS = 512  # Wan's add_k_proj branch splits the context at 512 text tokens
FRAMES, SIZE = 5, 32


def _image(seed: int, size=(48, 40)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _folder(tmp_path, class_name: str, in_channels: int, expand: bool = False):
    tmp_path.mkdir(exist_ok=True)
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        (tmp_path / sub).mkdir()
    index = {"_class_name": class_name, "expand_timesteps": expand}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    config = {"in_channels": in_channels, "out_channels": 16}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "class_name, in_channels, expand, task, mode",
    [
        ("WanImageToVideoPipeline", 36, False, "auto", "concat"),
        ("WanImageToVideoPipeline", 36, False, "i2v", "concat"),
        ("WanPipeline", 16, True, "i2v", "first_frame"),
        ("WanPipeline", 16, True, "auto", None),
        ("WanPipeline", 16, False, "auto", None),
    ],
)
def test_condition_mode_of_a_folder(tmp_path, class_name, in_channels, expand, task, mode):
    folder = _folder(tmp_path, class_name, in_channels, expand)
    assert condition_mode(folder, check_wan_folder(folder), task) == mode


def test_tasks_a_folder_cannot_run_are_refused(tmp_path):
    i2v = _folder(tmp_path / "a", "WanImageToVideoPipeline", 36)
    with pytest.raises(ValueError, match="it needs an image per prompt"):
        condition_mode(i2v, check_wan_folder(i2v), "t2v")
    t2v = _folder(tmp_path / "b", "WanPipeline", 16)
    with pytest.raises(ValueError, match="it cannot take an image"):
        condition_mode(t2v, check_wan_folder(t2v), "i2v")


@pytest.fixture(scope="module", params=["i2v", "i2v_two_expert", "ti2v"])
def model(request):
    torch.manual_seed(0)
    return load_wan(ModelConfig(tiny_variant=request.param, task="i2v"), torch.device("cpu"))


def _settings(model, guidance: float, steps: int = 3) -> EvalSettings:
    return EvalSettings(
        latent_shape=model.latent_shape(FRAMES, SIZE, SIZE),
        num_steps=steps,
        shift=3.0,
        guidance_scales=[guidance] * len(model.transformers),
        boundary_ratio=model.boundary_ratio,
        expand_timesteps=model.expand_timesteps,
        micro_batch_size=2,
        seed=0,
        sampler="pipeline",
    )


def test_tiny_i2v_layouts(model):
    t = model.transformers[0].config
    has_clip = model.image_pipeline.image_encoder is not None
    variant = model.path.name
    assert model.latent_shape(FRAMES, SIZE, SIZE) == (16, 2, 4, 4)
    assert (model.condition_mode, t.in_channels, len(model.transformers), has_clip) == {
        "i2v": ("concat", 36, 1, True),
        "i2v_two_expert": ("concat", 36, 2, False),
        "ti2v": ("first_frame", 16, 1, False),
    }[variant]
    assert (t.image_dim is not None) == has_clip and (t.added_kv_proj_dim is not None) == has_clip


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_i2v_sampler_reproduces_the_i2v_pipeline(model, guidance):
    settings = _settings(model, guidance)
    image = _image(0)
    pos, neg = model.encode_prompts(PROMPTS, "", TEXT_TOKENS, "cpu")
    condition = model.encode_images([image, image], FRAMES, SIZE, SIZE, "cpu")
    noise = torch.randn(2, *settings.latent_shape, generator=torch.Generator().manual_seed(0))
    got = sample_with_scheduler(
        model.transformers, model.pipeline.scheduler, pos, neg, noise, settings, condition=condition
    )
    two = len(model.transformers) == 2
    want = model.image_pipeline(
        image=image,
        prompt_embeds=pos,
        negative_prompt_embeds=neg,
        latents=noise.clone(),
        num_inference_steps=settings.num_steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance if two else None,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        output_type="latent",
        return_dict=False,
    )[0]
    if guidance == 1.0:
        assert torch.equal(got, want.float())
    else:
        err = (got - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), err
    # The condition matters: another image gives another video.
    other = model.encode_images([_image(1)] * 2, FRAMES, SIZE, SIZE, "cpu")
    moved = sample_with_scheduler(
        model.transformers, model.pipeline.scheduler, pos, neg, noise, settings, condition=other
    )
    assert (moved - got).abs().max() > 1e-3
    if model.condition_mode == "first_frame":  # the first latent frame is the encoded image
        assert torch.equal(got[:, :, :1], condition.latents.expand(2, -1, -1, -1, -1))


def test_rollout_log_probs_recompute_exactly_and_skip_the_clean_frame(model):
    """SDE rollout with the condition: training's recompute gives the rollout's log-probs bit for
    bit; a first-frame condition's frame stays clean and its log-prob covers the other frames."""
    n = len(model.transformers)
    shape = model.latent_shape(FRAMES, SIZE, SIZE)
    condition = model.encode_images([_image(0), _image(1)], FRAMES, SIZE, SIZE, "cpu")
    pos, neg = model.encode_prompts(PROMPTS, "", TEXT_TOKENS, "cpu")
    noise = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    common = dict(guidance_scales=[4.0] * n, boundary_ratio=model.boundary_ratio, noise_level=0.7)
    ro = sample_with_logprob(
        model.transformers,
        pos,
        neg,
        shape,
        num_steps=4,
        shift=3.0,
        generator=[torch.Generator().manual_seed(s) for s in (1, 2)],
        latents=noise,
        sde_steps=[0, 1, 2],
        expand_timesteps=model.expand_timesteps,
        record_means=True,
        condition=condition,
        **common,
    )
    first = model.condition_mode == "first_frame"
    frames = shape[1] - 1 if first else shape[1]
    assert ro.means.shape == (2, 3, shape[0], frames, *shape[2:])
    for k in range(3):
        log_prob, mean, std = compute_log_prob(
            model.transformers,
            ro,
            k,
            pos,
            neg,
            expand_timesteps=model.expand_timesteps,
            condition=condition,
            **common,
        )
        assert torch.equal(log_prob, ro.log_probs[:, k]) and torch.equal(mean, ro.means[:, k])
        # the Gaussian log-density of the generated frames, written out in float64
        x = ro.next_latents[:, k, :, -frames:].double()
        m, s = mean.double(), std.double()
        want = (-((x - m) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * np.log(2 * np.pi)).mean(dim=(1, 2, 3, 4))
        torch.testing.assert_close(log_prob.double(), want, rtol=1e-6, atol=1e-6)
    if first:  # every state the rollout records holds the encoded image as its first frame
        image = condition.latents.unsqueeze(1)
        assert torch.equal(ro.latents[:, :, :, :1], image.expand(-1, 3, -1, -1, -1, -1))
        assert torch.equal(ro.next_latents[:, :, :, :1], image.expand(-1, 3, -1, -1, -1, -1))
        assert torch.equal(ro.final_latents[:, :, :1], condition.latents)
