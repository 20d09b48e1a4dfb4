"""Expert-at-a-time rollout with cached prompt embeddings is bitwise today's rollout.

The trainer's rollout (``Trainer.rollout``) gathers one expert at a time: every micro-batch's
high-noise steps with only ``transformer`` unsharded, then every micro-batch's low-noise steps with
only ``transformer_2``; prompts come from the ``PromptCache`` (each unique prompt encoded once,
the negative prompt once per run, rows on the CPU). The reference is the previous ordering,
written out below: both experts gathered at once, each micro-batch encoded (prompts and a
negative row per sample) and sampled start to finish by ``sample_with_logprob``.

On the tiny two-expert model (6 steps, shift 3: the experts switch at step 2; SDE steps 0-3 span
both), GRPO-Guard (records the SDE means), micro-batches of 2 that cut across groups of 4, one
process and dp2 x sp2 over gloo: every micro-batch's latents, next latents, log-probs, means,
final latents and text embeddings are equal bit for bit. A forward hook checks that, in the new
rollout, whenever one expert runs the other is sharded (its parameters are DTensors) — and that
the old ordering fails that check (both gathered), so the check can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _old_rollout(trainer, sampler_state: dict) -> list[dict]:
    """The rollout as ``Trainer.rollout`` ran it before the lean rollout (same prompts and noise)."""
    import torch

    from miles.models.wan import DTYPES
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.sampler import sample_with_logprob
    from miles.train.collect import guidance_scales, micro_slices, step_major_order

    trainer.sampler.load_state_dict(sampler_state)
    cfg, r = trainer.cfg, trainer.cfg.rollout
    groups = next(trainer.sampler)
    G = cfg.data.group_size
    sample_ids = [g * G + i % G for i, g in enumerate(groups.group_ids)]
    order = step_major_order(cfg, len(sample_ids))
    prompts = [trainer.prompts[groups.prompt_indices[i]].text for i in order]
    group_list = [groups.group_ids[i] for i in order]
    sample_ids = [sample_ids[i] for i in order]
    sde_steps = trainer.algorithm.sde_steps(r.num_steps, trainer._generator(1, trainer.rollout_index))
    latent_shape = trainer.model.latent_shape(r.num_frames, r.height, r.width)
    init_keys = group_list if r.same_noise_per_group else sample_ids
    init_noise = torch.stack(
        [
            torch.randn(latent_shape, generator=trainer._generator(2, trainer.rollout_index, k))
            for k in init_keys
        ]
    )
    sde_gens = [trainer._generator(3, trainer.rollout_index, k) for k in sample_ids]
    dtype = DTYPES[cfg.model.dtype]
    chunks = []
    experts = trainer.algorithm.rollout_transformers(trainer.policy)
    with (
        unsharded_for_rollout(experts, reshard_after_forward=cfg.parallel.reshard_after_forward),
        torch.no_grad(),
    ):
        for sl in micro_slices(cfg, len(prompts)):
            pos, neg = trainer.model.encode_prompts(
                prompts[sl], cfg.data.negative_prompt, cfg.data.max_sequence_length, trainer.device
            )
            ro = sample_with_logprob(
                experts,
                pos.to(dtype),
                neg.to(dtype),
                latent_shape,
                num_steps=r.num_steps,
                shift=r.shift,
                guidance_scales=guidance_scales(r, 2),
                routing=trainer.model.routing,
                noise_level=r.noise_level,
                generator=sde_gens[sl],
                latents=init_noise[sl].to(trainer.device),
                sde_steps=sde_steps,
                sde_type=r.sde_type,
                record_means=trainer.algorithm.records_means,
            )
            chunks.append({"slice": sl, "pos": pos.to(dtype), "neg": neg.to(dtype), "rollout": ro})
    return chunks


def _watch_sharding(experts) -> list[tuple[int, bool]]:
    """(expert, the other expert is sharded) at every forward of an expert."""
    from torch.distributed.tensor import DTensor

    seen = []
    for e, expert in enumerate(experts):
        other = experts[1 - e]

        def hook(module, args, e=e, other=other):
            seen.append((e, all(isinstance(p, DTensor) for p in other.blocks.parameters())))

        expert.register_forward_pre_hook(hook)
    return seen


def _body(rank, world_size, out_dir):
    import torch

    from miles.config import parse_args
    from miles.rollout.sampler import expert_phases
    from miles.train.trainer import Trainer

    sp = 2 if world_size == 4 else 1
    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", f"lean{world_size}", "--run.wandb-mode", "disabled", "--run.no-progress"]
        + ["--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan"), "--train.no-export"]
        + ["--algorithm.name", "grpo_guard", "--train.micro-batch-size", "2", "--data.prompts-per-rank", "2"]
        + ["--sequence-parallel-size", str(sp), "--deterministic-mode"]
    )
    trainer = Trainer(cfg)
    r = cfg.rollout
    assert expert_phases(r.num_steps, r.shift, trainer.model.routing, 2) == [(0, 0, 2), (1, 2, 6)]
    experts = trainer.algorithm.rollout_transformers(trainer.policy)
    seen = _watch_sharding(experts)
    state = trainer.sampler.state_dict()
    new = trainer.rollout().chunks
    assert {e for e, _ in seen} == {0, 1} and all(other_sharded for _, other_sharded in seen), seen
    seen.clear()
    old = _old_rollout(trainer, state)
    assert seen and not any(other_sharded for _, other_sharded in seen)  # the check can fail
    assert len(new) == len(old) == 4
    for n, o in zip(new, old):
        assert n.slice == o["slice"]
        a, b = n.rollout, o["rollout"]
        assert a.step_indices == b.step_indices == [0, 1, 2, 3]
        for name in ("latents", "next_latents", "log_probs", "means", "final_latents", "timesteps", "sigmas"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape and torch.equal(x, y), (name, (x - y).abs().max().item())
        assert n.pos.device.type == "cpu" and torch.equal(n.pos, o["pos"].cpu())
        assert torch.equal(n.neg.expand_as(o["neg"]), o["neg"].cpu())
    trainer.close()


@pytest.mark.parametrize("world_size", [1, 4], ids=["one_process", "dp2xsp2"])
def test_lean_rollout_is_bitwise_the_old_rollout(tmp_path, world_size):
    run_pooled(_body, world_size, str(tmp_path))
