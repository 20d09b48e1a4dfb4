"""The LTX-Video family behind the seam, on the embedded tiny LTX (CPU, fp32): the registry, the
text condition (embeddings + mask) and the prompt cache, the VAE's latent normalisation against
``LTXPipeline``'s own code. (The expert's call and SP: tests/distributed/test_stock_parity.py,
test_usp_model.py, test_usp_uneven.py; the noise schedule: tests/unit/test_ltx_schedule.py; the
trainer: tests/e2e/test_ltx_e2e.py.)"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.models import TINY_DIR, load_tiny_ltx


@pytest.fixture(scope="module")
def ltx():
    return load_tiny_ltx()


def test_the_seam_holds_both_families_and_names_neither():
    import miles.models.family as family
    from miles.models.families import FAMILIES
    from miles.models.tiny import tiny_model_path

    assert sorted(FAMILIES) == ["ltx", "wan"] and family.FAMILIES is FAMILIES
    assert family.family_of(tiny_model_path(TINY_DIR, "ltx")).name == "ltx"
    assert family.family_of(tiny_model_path(TINY_DIR, "single_expert")).name == "wan"
    source = inspect.getsource(family).lower()
    assert "wan" not in source and "ltx" not in source


def test_text_condition_carries_the_mask_and_the_cache_encodes_alike(ltx):
    from miles.models.ltx import unpack_text
    from miles.rollout.prompt_cache import PromptCache

    prompts = ["a red ball", "a much longer prompt about a blue cube"]
    pos, neg = ltx.encode_prompts(prompts, "", 24, "cpu")
    embeds, mask = unpack_text(pos)
    tokens = ltx.pipeline.tokenizer(prompts, padding="max_length", max_length=24, truncation=True)
    assert torch.equal(mask, torch.tensor(tokens.attention_mask, dtype=torch.bool))
    want, want_mask, _, _ = ltx.pipeline.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=24
    )
    assert torch.equal(embeds, want) and torch.equal(mask, want_mask)
    assert unpack_text(neg)[1].sum(dim=1).tolist() == [1, 1]  # "" is its end-of-text token only
    cache = PromptCache(
        ltx.pipeline, negative_prompt="", max_sequence_length=24, device="cpu", offload=False,
        encode_texts=ltx.encode_texts,
    )  # fmt: skip
    cache.start_rollout(prompts)
    assert torch.equal(cache.embeds(prompts), pos) and torch.equal(cache.negative()[0], neg[0])


def test_latent_normalisation_and_decode_are_the_pipelines(ltx):
    """``decode`` = LTXPipeline's denormalisation then the VAE; ``encode_video`` its inverse
    normalisation (the tiny VAE has non-trivial latents_mean/std, so both are exercised)."""
    from diffusers import LTXPipeline

    vae = ltx.pipeline.vae
    assert not torch.equal(vae.latents_std, torch.ones_like(vae.latents_std))
    z = torch.randn(2, *ltx.latent_shape(9, 64, 96), generator=torch.Generator().manual_seed(0))
    got = ltx.decode(z)
    raw = LTXPipeline._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    want = vae.decode(raw, None, return_dict=False)[0]
    want = (want / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    assert got.shape == (2, 9, 3, 64, 96) and torch.equal(got, want)
    clip = torch.rand(9, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    latent = ltx.encode_video(clip, "cpu")
    mode = vae.encode(clip.permute(1, 0, 2, 3)[None] * 2 - 1).latent_dist.mode()
    norm = LTXPipeline._normalize_latents(mode, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    assert torch.equal(latent, norm[0])


def test_the_dry_run_refuses_the_pipeline_eval_sampler():
    """LTX's scheduler needs the token-count shift (mu) the pipeline eval sampler does not pass: refused
    at planning with the fix, not at the first evaluation."""
    from miles.config import parse_args
    from miles.train.plan import PlanError, plan_run

    repo = TINY_DIR.parents[1]
    flags = ["--config", str(repo / "configs" / "tiny_ltx_cpu.yaml"), "--model.tiny-model-dir", str(TINY_DIR)]
    flags += [
        "--eval.prompt-file",
        str(repo / "miles" / "data" / "tiny_prompts.txt"),
        "--eval.sampler",
        "pipeline",
    ]
    cfg, _ = parse_args(flags)
    with pytest.raises(PlanError, match="use eval.sampler rollout"):
        plan_run(cfg, 1, device_type="cpu")


def test_the_block_calibration_runs_a_copy_of_block_0_on_the_inputs_it_shapes(monkeypatch):
    """``calibrate_ltx_block_memory`` (through ``measure_first_block_memory``) hands the measurement a
    detached copy of block 0 and inputs the block takes, forward and backward, in the asked dtype
    (the CUDA measurement itself: tests/gpu)."""
    from diffusers import LTXVideoTransformer3DModel

    import miles.parallel.checkpointing as checkpointing
    from miles.models.ltx_sp import calibrate_ltx_block_memory
    from tests.models import TINY_LTX

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(**TINY_LTX)
    seen = {}

    def measure(block, make_inputs, device, compiled=False):
        out = block(*make_inputs())
        out.sum().backward()
        seen.update(shape=tuple(out.shape), dtype=out.dtype, copy=block is not model.transformer_blocks[0])
        return {mode: float(i) for i, mode in enumerate(checkpointing.MODES)}

    monkeypatch.setattr(checkpointing, "measure_block_memory", measure)
    got = calibrate_ltx_block_memory(model, 12, torch.device("cpu"), batch=2, dtype=torch.float32)
    assert got == {mode: float(i) for i, mode in enumerate(checkpointing.MODES)}
    assert seen == dict(shape=(2, 12, 64), dtype=torch.float32, copy=True)
    assert model.transformer_blocks[0].attn1.to_q.weight.grad is None  # the model's own block untouched


def test_a_configs_only_folder_warns_in_the_dry_run_and_is_refused_by_the_real_run(tmp_path):
    """``load_meta`` of an LTX folder without its tokenizer and with an unreadable text-encoder config:
    the dry run warns about both (the text encoder is then not counted), the real run refuses."""
    import shutil

    from miles.models.ltx_family import LTX
    from miles.models.tiny import tiny_model_path

    folder = tmp_path / "ltx"
    shutil.copytree(tiny_model_path(TINY_DIR, "ltx"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.rmtree(folder / "tokenizer")
    (folder / "text_encoder" / "config.json").write_text("{not json")
    cfg = SimpleNamespace(model=SimpleNamespace(path=str(folder), task="auto"))
    model, _, warnings = LTX.load_meta(cfg)
    assert model.pipeline.text_encoder is None and model.transformers[0].device.type == "meta"
    assert len(warnings) == 2, warnings
    assert "the real run will refuse this folder" in warnings[0] and "'tokenizer'" in warnings[0]
    assert warnings[1].startswith("text encoder config unreadable")
    with pytest.raises(ValueError, match="lacks the 'tokenizer' folder"):
        LTX.load_meta(cfg, strict=True)
