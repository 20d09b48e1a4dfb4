"""The 81-frame world on a GPU (skipped without CUDA): ``world_adherence`` scores on the videos'
device as on the CPU, also in deterministic mode; an 81 x 480 x 832 render scores as the truth;
``miles.pretrain_world_81``'s GPU path (bf16 autocast, compiled blocks) runs at a reduced size."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_reward_on_cuda_matches_cpu_in_deterministic_mode():
    from miles.rewards.world import world_scores
    from miles.world.world import SHAPE_81, all_attributes, prompt_for, render

    attrs = all_attributes()[:4]
    videos = torch.stack([render(a, k, SHAPE_81, device="cuda") for k, a in enumerate(attrs)])
    prompts = [prompt_for(a) for a in attrs]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        gpu = world_scores(videos, prompts)
    finally:
        torch.use_deterministic_algorithms(was)
    cpu = world_scores(videos.cpu(), prompts)
    assert gpu["adherence"].device.type == "cuda"
    for k in cpu:
        torch.testing.assert_close(gpu[k].cpu(), cpu[k], atol=1e-4, rtol=0)
    assert cpu["adherence"].min() > 0.9  # the rendered truth at the real shape


def test_pretraining_gpu_path_runs_compiled_in_bf16(tmp_path):
    from miles.pretrain_world_81 import PRIOR, Pretrain81Config, pretrain

    cfg = Pretrain81Config(
        shape=(17, 96, 160), prior=dict(PRIOR, num_layers=1), vae_short_steps=4, vae_long_steps=2,
        videos_per_prompt=1, dit_steps=4, eval_seeds_heldout=1, eval_seeds_train=0, eval_steps=2,
    )  # fmt: skip
    report = pretrain(tmp_path / "pipeline", cfg)
    assert report["latent_shape"] == [16, 5, 12, 20] and report["device"] != "cpu"
    assert 0.0 <= report["heldout"]["adherence"] <= 1.0


def test_pretraining_paused_on_the_gpu_continues_to_the_same_prior(tmp_path):
    """The GPU path cut mid-VAE and mid-prior (``Budget(steps=...)``) ends with the weights of one
    uninterrupted run: the CUDA generators and the compiled blocks' state come back (to the
    nondeterminism of CUDA's kernels: close, not asserted bitwise)."""
    from safetensors.torch import load_file

    from miles.pretrain_resume import Budget, Paused
    from miles.pretrain_world_81 import PRIOR, Pretrain81Config, pretrain

    cfg = Pretrain81Config(
        shape=(17, 96, 160), prior=dict(PRIOR, num_layers=1), vae_short_steps=2, vae_long_steps=1,
        vae_pool_per_prompt=1, videos_per_prompt=1, dit_steps=4, eval_seeds_heldout=1, eval_seeds_train=0,
        eval_steps=2,
    )  # fmt: skip
    pretrain(tmp_path / "whole" / "p", cfg)
    for steps in (1, 3):
        with pytest.raises(Paused):
            pretrain(tmp_path / "cut" / "p", cfg, Budget(steps=steps))
    pretrain(tmp_path / "cut" / "p", cfg)
    name = "transformer/diffusion_pytorch_model.safetensors"
    whole, cut = load_file(tmp_path / "whole" / "p" / name), load_file(tmp_path / "cut" / "p" / name)
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], atol=1e-3, rtol=1e-3)
