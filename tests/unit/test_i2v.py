"""Image-to-video: folders and tasks, the image condition, and parity with ``WanImageToVideoPipeline``.

The tiny I2V models (``miles.models.tiny_i2v``: Wan2.1-I2V, Wan2.2-I2V-A14B and TI2V-5B layouts)
on CPU in fp32. The pipeline sampler with the image condition against the stock pipeline's
``__call__`` (same prompt embeddings, image, initial latents and scheduler, ``output_type="latent"``):
bitwise without CFG; with CFG the pipeline runs two forwards where the sampler runs one batched
[cond; uncond] forward, so they agree to fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config import ModelConfig
from miles.data.prompts import check_prompt_images, load_image, load_prompts
from miles.eval.evaluate import EvalSettings, sample_with_scheduler
from miles.models.i2v import condition_mode
from miles.models.wan import WanRouting, check_wan_folder, load_wan, run_condition_mode
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
        routing=model.routing,
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


@pytest.mark.parametrize("scheduler", ["folder", "unipc"])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_i2v_sampler_reproduces_the_i2v_pipeline(model, guidance, scheduler):
    import copy

    from diffusers import UniPCMultistepScheduler

    pipe = copy.copy(model.image_pipeline)  # a shallow copy: the scheduler swap stays in this test
    if scheduler == "unipc":  # what the Wan I2V -Diffusers folders ship
        pipe.scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
        )
    settings = _settings(model, guidance)
    image = _image(0)
    pos, neg = model.encode_prompts(PROMPTS, "", TEXT_TOKENS, "cpu")
    condition = model.encode_images([image, image], FRAMES, SIZE, SIZE, "cpu")
    noise = torch.randn(2, *settings.latent_shape, generator=torch.Generator().manual_seed(0))
    got = sample_with_scheduler(
        model.transformers, pipe.scheduler, pos, neg, noise, settings, condition=condition
    )
    two = len(model.transformers) == 2
    want = pipe(
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
        print(
            f"[i2v parity] {model.path.name} {scheduler} CFG {guidance}: max abs {err:.2e} of {want.abs().max():.2f}"
        )
        assert err <= 1e-6 * want.abs().max().item(), err
    if guidance == 1.0 or scheduler == "unipc":
        return
    # The condition matters: another image gives another video.
    other = model.encode_images([_image(1)] * 2, FRAMES, SIZE, SIZE, "cpu")
    moved = sample_with_scheduler(
        model.transformers, pipe.scheduler, pos, neg, noise, settings, condition=other
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
    common = dict(guidance_scales=[4.0] * n, routing=model.routing, noise_level=0.7)
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


# ---------------------------------------------------------------------------------------------
# Prompt files with images, checked before any weights load


def _jsonl(tmp_path, rows: list[dict]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_images_resolve_against_the_file(tmp_path):
    (tmp_path / "images").mkdir()
    _image(0).save(tmp_path / "images" / "a.png")
    absolute = tmp_path / "b.png"
    _image(1).save(absolute)
    path = _jsonl(
        tmp_path,
        [
            {"prompt": "a cat", "image": "images/a.png", "tag": 1},
            {"prompt": "a dog", "image": str(absolute)},
        ],
    )
    prompts = load_prompts(path)
    assert [p.image for p in prompts] == [tmp_path / "images" / "a.png", absolute]
    assert prompts[0].metadata == {"tag": 1}
    check_prompt_images(prompts, path, image_to_video=True)
    loaded = load_image(prompts[0].image)
    assert loaded.mode == "RGB" and np.array_equal(np.asarray(loaded), np.asarray(_image(0)))


def test_bad_prompt_images_are_named(tmp_path):
    (tmp_path / "broken.png").write_text("not an image")
    _image(0).save(tmp_path / "ok.png")
    rows = [
        {"prompt": "a cat", "image": "missing.png"},
        {"prompt": "a dog", "image": "broken.png"},
        {"prompt": "a cow"},
        {"prompt": "a pig", "image": "ok.png"},
    ]
    path = _jsonl(tmp_path, rows)
    with pytest.raises(ValueError) as e:
        check_prompt_images(load_prompts(path), path, image_to_video=True)
    message = str(e.value)
    assert f"{tmp_path / 'missing.png'}: no such file" in message
    assert f"{tmp_path / 'broken.png'}: not a readable image" in message
    assert "'a cow' has no 'image'" in message and "ok.png" not in message
    with pytest.raises(ValueError, match="but the model is text-to-video"):
        check_prompt_images(load_prompts(path), path, image_to_video=False)
    bad = _jsonl(tmp_path, [{"prompt": "a cat", "image": 3}])
    with pytest.raises(ValueError, match=f"{bad}:1: 'image' must be a non-empty string"):
        load_prompts(bad)


def test_wan21_i2v_needs_512_text_tokens():
    cfg = ModelConfig(tiny_variant="i2v", task="i2v")
    assert run_condition_mode(cfg, 512) == "concat"
    with pytest.raises(ValueError, match="set data.max_sequence_length 512"):
        run_condition_mode(cfg, 64)
    assert run_condition_mode(ModelConfig(tiny_variant="i2v_two_expert"), 64) == "concat"


# ---------------------------------------------------------------------------------------------
# Dry run

ROOT = Path(__file__).resolve().parents[2]
TINY_I2V = ["--config", "configs/tiny_i2v_cpu.yaml"]
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, transformer/config.json
WAN21_I2V_14B = {
    "added_kv_proj_dim": 5120,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 13824,
    "freq_dim": 256,
    "image_dim": 1280,
    "in_channels": 36,
    "num_attention_heads": 40,
    "num_layers": 40,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}


def _plan(argv: list[str]) -> dict:
    from miles.config import parse_args
    from miles.train.dry_run import dry_run

    cfg, opts = parse_args(argv)
    return dry_run(cfg, world_size=opts.world_size, verbose=False)


@pytest.mark.parametrize(
    "variant, mode", [("i2v", "concat"), ("i2v_two_expert", "concat"), ("ti2v", "first_frame")]
)
def test_dry_run_of_the_tiny_i2v_recipe(monkeypatch, variant, mode):
    monkeypatch.chdir(ROOT)
    argv = [*TINY_I2V, "--model.tiny-variant", variant, "--world-size", "4", "--sequence-parallel-size", "2"]
    rep = _plan(argv)
    assert rep["model"]["image_condition"] == mode
    assert rep["sequence"]["latent_shape"] == [16, 2, 8, 8]  # the denoised channels, not in_channels
    assert rep["sequence"]["tokens_per_sample"] == 32


def test_dry_run_refuses_a_missing_image(monkeypatch, tmp_path):
    from miles.train.dry_run import DryRunError

    monkeypatch.chdir(ROOT)
    rows = [{"prompt": f"p{i}", "image": f"{i}.png"} for i in range(8)]
    for i in range(7):
        _image(i).save(tmp_path / f"{i}.png")
    path = _jsonl(tmp_path, rows)
    with pytest.raises(DryRunError, match=f"{tmp_path / '7.png'}: no such file"):
        _plan([*TINY_I2V, "--data.prompt-file", str(path), "--world-size", "4"])


WAN22_I2V_A14B = {**WAN21_I2V_14B, "image_dim": None, "added_kv_proj_dim": None}
TI2V_5B = {
    **WAN21_I2V_14B,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "in_channels": 48,
    "out_channels": 48,
}
TI2V_5B.update(num_attention_heads=24, num_layers=30, ffn_dim=14336)
WAN21_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": []}
WAN21_VAE["temperal_downsample"] = [False, True, True]
WAN22_VAE = {**WAN21_VAE, "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True}
WAN22_VAE.update(
    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4
)
REAL_I2V = {  # configs of the -Diffusers folders: (index, transformer, vae, frames x size, latent shape, condition)
    "Wan2.1-I2V-14B-480P": (
        {"_class_name": "WanImageToVideoPipeline", "image_encoder": ["transformers", "CLIPVisionModel"]},
        WAN21_I2V_14B, WAN21_VAE, (81, 480, 832), [16, 21, 60, 104], "concat",
    ),
    "Wan2.2-I2V-A14B": (
        {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": 0.9, "transformer_2": ["diffusers", "WanTransformer3DModel"]},
        WAN22_I2V_A14B, WAN21_VAE, (81, 480, 832), [16, 21, 60, 104], "concat",
    ),
    "Wan2.2-TI2V-5B": (
        {"_class_name": "WanPipeline", "expand_timesteps": True},
        TI2V_5B, WAN22_VAE, (81, 704, 1280), [48, 21, 44, 80], "first_frame",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REAL_I2V))
def test_dry_run_of_real_i2v_shapes(monkeypatch, tmp_path, name):
    """Configs-only folders of the three I2V models: the denoised channels, real token counts, exact
    parameter counts (the 36-channel patch embedding and Wan2.1-I2V's image branch included)."""
    from diffusers import WanTransformer3DModel

    index, transformer, vae, (frames, height, width), latent, mode = REAL_I2V[name]
    monkeypatch.chdir(ROOT)
    experts = ["transformer", "transformer_2"] if "transformer_2" in index else ["transformer"]
    for sub in [*experts, "vae", "image_encoder"]:  # no tokenizer: the dry run would load it
        (tmp_path / sub).mkdir()
    for sub in experts:
        (tmp_path / sub / "config.json").write_text(json.dumps(transformer))
    (tmp_path / "vae/config.json").write_text(json.dumps(vae))
    full_index = {
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (tmp_path / "model_index.json").write_text(json.dumps({**full_index, **index}))
    size = [
        "--rollout.num-frames",
        str(frames),
        "--rollout.height",
        str(height),
        "--rollout.width",
        str(width),
    ]
    argv = [
        *TINY_I2V,
        "--model.path",
        str(tmp_path),
        *size,
        "--world-size",
        "8",
        "--sequence-parallel-size",
        "8",
    ]
    rep = _plan([*argv, "--model.dtype", "bfloat16", "--model.activation-checkpointing", "full"])
    assert rep["model"]["image_condition"] == mode and rep["model"]["num_experts"] == len(experts)
    assert rep["sequence"]["latent_shape"] == latent
    assert rep["sequence"]["tokens_per_sample"] == latent[1] * latent[2] * latent[3] // 4
    with torch.device("meta"):
        meta = WanTransformer3DModel(**transformer)
    assert rep["params"]["per_expert"] == [sum(p.numel() for p in meta.parameters())] * len(experts)


# ---------------------------------------------------------------------------------------------
# DiffusionNFT: no loss on TI2V's clean first frame


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((0, *parts)) & 0x7FFF_FFFF_FFFF_FFFF)


def test_diffusion_nft_loss_skips_the_clean_first_frame():
    import copy
    from types import SimpleNamespace

    from miles.algorithms import Policy, build_algorithm
    from miles.algorithms.diffusion_nft import nft_loss
    from miles.config import AlgorithmConfig, Config, NFTConfig, RolloutConfig
    from miles.rollout.batch import MicroBatch, RolloutBatch
    from miles.rollout.sampler import predict_velocity
    from miles.train.old_policy import OldPolicy

    model = load_wan(ModelConfig(tiny_variant="ti2v", task="i2v"), torch.device("cpu"))
    cfg = Config(
        algorithm=AlgorithmConfig(name="diffusion_nft"),
        rollout=RolloutConfig(num_steps=4),
        nft=NFTConfig(timestep_fraction=0.5),  # 2 noise levels
    )
    algorithm = build_algorithm(cfg)
    old = [copy.deepcopy(t) for t in model.transformers]
    with torch.no_grad():
        for p in old[0].parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy = Policy(
        transformers=model.transformers,
        guidance_scales=[4.0],
        routing=WanRouting(None, expand_timesteps=True),
        reference=None,
        generator=_generator,
        old=OldPolicy(old, model.transformers),
    )
    shape = model.latent_shape(FRAMES, SIZE, SIZE)
    condition = model.encode_images([_image(0), _image(1)], FRAMES, SIZE, SIZE, "cpu")
    pos, _ = model.encode_prompts(PROMPTS, "", TEXT_TOKENS, "cpu")
    x0 = condition.clean(torch.randn(2, *shape, generator=torch.Generator().manual_seed(3)))
    chunk = MicroBatch(slice(0, 2), pos, pos, SimpleNamespace(final_latents=x0), condition)
    ids = torch.tensor([0, 1])
    batch = RolloutBatch(PROMPTS, [None] * 2, ids, ids, 0, [chunk], [], advantages=torch.tensor([1.0, -1.0]))
    loss = algorithm.accumulate(policy, batch, [chunk], step_in_rollout=0)["loss"]

    sigmas, noises = algorithm._draws(policy, batch, chunk, x0)
    r = torch.tensor([0.6, 0.4])  # optimality of advantages ±1 with A_max 5
    per_level, whole = [], []
    with torch.no_grad():
        for sigma, noise in zip(sigmas, noises):
            x_t = (1 - sigma) * x0 + sigma * noise
            args = (x_t, sigma * 1000, pos, None, [4.0], WanRouting(None, expand_timesteps=True), condition)
            v, v_old = predict_velocity(model.transformers, *args), predict_velocity(old, *args)
            frames = [t[:, :, 1:] for t in (v, v_old, x_t, x0)]
            per_level.append(5.0 * nft_loss(*frames, sigma, r, 1.0)[0].mean())
            whole.append(5.0 * nft_loss(v, v_old, x_t, x0, sigma, r, 1.0)[0].mean())
    assert loss == pytest.approx(float(torch.stack(per_level).mean()), rel=1e-5)
    assert abs(loss - float(torch.stack(whole).mean())) > 1e-3 * abs(loss)  # the first frame would count
