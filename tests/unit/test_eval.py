"""Evaluation: the ``pipeline`` sampler reproduces ``WanPipeline``; samples are fixed by (prompt, seed).

``sample_with_scheduler`` against the stock ``WanPipeline.__call__`` (tiny models, CPU fp32, the
same prompt embeddings and initial latents, ``output_type="latent"``), with the scheduler the folder
ships (FlowMatchEuler) and with the UniPC flow scheduler real Wan folders ship: bitwise without
CFG; with CFG the pipeline runs two forwards where the sampler runs one batched [cond; uncond]
forward, so the latents agree to fp32 rounding (measured ≤ 1e-6 relative here).
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles.config import ModelConfig
from miles.eval.evaluate import (
    EvalSettings,
    eval_noise,
    evaluate,
    sample_with_scheduler,
    summarize,
    write_eval,
)
from miles.models.wan import load_wan
from miles.rewards import build_rewards

PROMPTS = ["a red ball", "a blue cube rolling"]


@pytest.fixture(scope="module", params=["single_expert", "two_expert"])
def model(request):
    torch.manual_seed(0)
    return load_wan(ModelConfig(tiny_variant=request.param), torch.device("cpu"))


def _settings(model, guidance: float, steps: int = 4) -> EvalSettings:
    return EvalSettings(
        latent_shape=model.latent_shape(5, 32, 32),
        num_steps=steps,
        shift=3.0,
        guidance_scales=[guidance] * len(model.transformers),
        routing=model.routing,
        micro_batch_size=2,
        seed=0,
        sampler="pipeline",
    )


@pytest.mark.parametrize("scheduler", ["folder", "unipc"])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_pipeline_sampler_reproduces_wan_pipeline(model, scheduler, guidance):
    from diffusers import UniPCMultistepScheduler

    pipe = copy.copy(model.pipeline)  # a shallow copy: the scheduler swap stays in this test
    if scheduler == "unipc":  # what the Wan2.1/2.2 -Diffusers folders ship
        pipe.scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
        )
    assert type(model.pipeline.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    settings = _settings(model, guidance)
    pos, neg = model.encode_prompts(PROMPTS, "", 16, "cpu")
    noise = torch.stack([eval_noise(settings.latent_shape, 0, i, 0) for i in range(len(PROMPTS))])
    got = sample_with_scheduler(model.transformers, pipe.scheduler, pos, neg, noise, settings)
    want = pipe(
        prompt_embeds=pos,
        negative_prompt_embeds=neg,
        latents=noise.clone(),
        num_inference_steps=settings.num_steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance if len(model.transformers) == 2 else None,
        height=32,
        width=32,
        num_frames=5,
        output_type="latent",
        return_dict=False,
    )[0]
    if guidance == 1.0:
        assert torch.equal(got, want.float())
    else:
        err = (got - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), err
    assert not torch.equal(got, noise)


def test_evaluate_is_a_function_of_prompt_and_seed(model, tmp_path):
    rewards = build_rewards({"jpeg_incompressibility": 1.0}, num_frames=2)
    settings = _settings(model, 4.0, steps=3)
    args = dict(negative_prompt="", max_sequence_length=16, device=torch.device("cpu"))
    a = evaluate(model, rewards, PROMPTS, 2, settings, **args)
    b = evaluate(model, rewards, PROMPTS, 2, settings, **args)
    assert a["prompts"] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2 and a["seeds"] == [0, 1, 0, 1]
    assert torch.equal(a["scores"], b["scores"])
    assert a["scores"][0].unique().numel() == 4  # every (prompt, seed) is its own sample
    rollout = evaluate(
        model, rewards, PROMPTS, 2, EvalSettings(**{**settings.__dict__, "sampler": "rollout"}), **args
    )
    assert not torch.equal(rollout["scores"], a["scores"])  # the two samplers differ (grids)
    paths = write_eval(a, tmp_path, "step_000000")
    assert paths["json"].is_file() and paths["video"].is_file() and paths["video"].suffix == ".mp4"
    assert summarize(a)["eval/reward/mean"] == pytest.approx(float(a["scores"][0].mean()))
    with pytest.raises(ValueError, match="eval.sampler"):
        evaluate(model, rewards, PROMPTS, 1, EvalSettings(**{**settings.__dict__, "sampler": "x"}), **args)


def test_rollout_sampler_gathers_one_expert_at_a_time_bitwise(model):
    """The trainer's evaluation: embeddings from its prompt cache, experts gathered one at a time
    over all micro-batches; the reference samples each micro-batch start to finish, encoded alone."""
    import contextlib

    from miles.eval.evaluate import _sample
    from miles.rollout.prompt_cache import PromptCache

    rewards = build_rewards({"jpeg_incompressibility": 1.0}, num_frames=2)
    settings = EvalSettings(**{**_settings(model, 4.0, steps=4).__dict__, "sampler": "rollout"})
    prompts = PROMPTS + ["a green ball"]  # 3 prompts x 2 seeds: micro-batches of 2 cut across prompts
    cache = PromptCache(
        model.pipeline, negative_prompt="", max_sequence_length=16, device="cpu", offload=True
    )
    gathered = []

    def gather(experts):
        gathered.append([model.transformers.index(e) for e in experts])
        return contextlib.nullcontext()

    args = dict(negative_prompt="", max_sequence_length=16, device=torch.device("cpu"))
    got = evaluate(
        model, rewards, prompts, 2, settings, **args,
        encode=lambda texts: (cache.embeds(texts), cache.negative()), gather=gather,
    )  # fmt: skip
    assert gathered == ([[0], [1]] if len(model.transformers) == 2 else [[0]])
    samples = [(i, s) for i in range(len(prompts)) for s in range(2)]
    for k in range(0, len(samples), 2):
        texts = [prompts[i] for i, _ in samples[k : k + 2]]
        pos, neg = model.encode_prompts(texts, "", 16, "cpu")
        noise = torch.stack([eval_noise(settings.latent_shape, 0, *s) for s in samples[k : k + 2]])
        video = model.decode(_sample(model, pos, neg, noise, settings))
        assert torch.equal(got["scores"][0, k : k + 2].float(), rewards(video, texts)[0])
        for j, v in zip(range(k, k + 2), video):
            assert torch.equal(got["videos"][j], v)
    gathered.clear()
    evaluate(model, rewards, PROMPTS, 1, _settings(model, 4.0, steps=2), **args, gather=gather)
    assert gathered == [list(range(len(model.transformers)))]  # the pipeline sampler: all at once


def test_heldout_noise_is_keyed_by_eval_seed_not_run_seed(model):
    """Runs of different ``run.seed`` score a checkpoint on the same held-out noise (bitwise the same
    scores); ``eval.seed`` moves it; ``run.seed`` still moves the training rollouts' noise."""
    from types import SimpleNamespace

    from miles.config import parse_args
    from miles.eval.evaluate import eval_settings
    from miles.train.collect import Collector

    if len(model.transformers) > 1:
        pytest.skip("the noise does not depend on the experts: one model is enough")

    def cfg(*flags):
        return parse_args(["--config", "configs/tiny_cpu.yaml", "--rollout.num-frames", "5",
                           "--rollout.height", "32", "--rollout.width", "32", "--rollout.num-steps", "3",
                           *flags])[0]  # fmt: skip

    run0, run7, other_eval = cfg(), cfg("--run.seed", "7"), cfg("--run.seed", "7", "--eval.seed", "3")
    rewards = build_rewards({"jpeg_incompressibility": 1.0}, num_frames=2)
    args = dict(negative_prompt="", max_sequence_length=16, device=torch.device("cpu"))
    scores = [
        evaluate(model, rewards, PROMPTS, 2, eval_settings(c, model), **args)["scores"]
        for c in (run0, run7, other_eval)
    ]
    assert torch.equal(scores[0], scores[1])  # paired: the same noise whatever the run seed
    assert not torch.equal(scores[1], scores[2])  # eval.seed is what keys it
    shape = model.latent_shape(5, 32, 32)
    noise = [
        Collector._rollout_noise(SimpleNamespace(cfg=c, rollout_index=0), [0], [0], shape)[0]
        for c in (run0, run7)
    ]
    assert not torch.equal(noise[0], noise[1])  # training noise still follows run.seed


@pytest.mark.parametrize("sampler", ["pipeline", "rollout"])
def test_evaluate_shows_progress_where_asked(model, capsys, sampler):
    """``progress`` (rank 0 on a terminal): bars for the sampling and the scoring; none otherwise."""
    rewards = build_rewards({"jpeg_incompressibility": 1.0}, num_frames=2)
    settings = EvalSettings(**{**_settings(model, 1.0, steps=2).__dict__, "sampler": sampler})
    args = dict(negative_prompt="", max_sequence_length=16, device=torch.device("cpu"))
    evaluate(model, rewards, PROMPTS, 1, settings, **args, progress=True)
    shown = capsys.readouterr().err
    assert "eval: sample" in shown and "eval: decode and score" in shown, shown
    evaluate(model, rewards, PROMPTS, 1, settings, **args)
    assert "eval:" not in capsys.readouterr().err


def test_eval_help_is_its_own(capsys):
    """``python -m miles.eval --help`` prints eval's options (--out, --checkpoint) and exits 0, with or
    without --out; not the trainer's 750-line help (issue 46)."""
    from miles.eval.__main__ import main

    for argv in (["--help"], ["--out", "/tmp/x", "--help"], ["-h"]):
        assert main(argv) == 0
        shown = capsys.readouterr().out
        assert "--out" in shown and "--checkpoint" in shown and "python -m miles.eval" in shown, shown
        assert "--train.num-rollouts" not in shown and len(shown.splitlines()) < 60
