"""``bench/peer_learning.py`` without a flow_grpo checkout: the training-reward windows count the
same rollouts on both sides, and ``--recipe own``'s pieces — flow_grpo's LoRA (r 32, its targets),
its reference forward (the adapter disabled is the base model), its KL, and the merged export."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peer_learning as peer  # noqa: E402


def test_training_reward_windows_count_the_same_rollouts_on_both_sides():
    per_rollout = [0.1 * k for k in range(12)]
    # the peer: a row per optimizer step, two a rollout, each the rollout's mean; ours: one a rollout
    theirs = [
        {"step": 2 * r + s + 1, "rollout": r, "reward": v} for r, v in enumerate(per_rollout) for s in (0, 1)
    ]
    ours = [{"step": 2 * r + 1, "reward": v} for r, v in enumerate(per_rollout)]
    assert peer.rollout_rewards(theirs, 2) == peer.rollout_rewards(ours, 1) == per_rollout
    legacy = [{k: v for k, v in t.items() if k != "rollout"} for t in theirs]  # peer.json before issue 42
    assert peer.rollout_rewards(legacy, 2) == per_rollout
    first, last = peer.reward_window(per_rollout)
    assert first == pytest.approx(sum(per_rollout[: peer.WINDOW]) / peer.WINDOW)
    assert last == pytest.approx(sum(per_rollout[-peer.WINDOW :]) / peer.WINDOW)


def test_own_recipe_lora_reference_kl_and_merged_export(tmp_path):
    from diffusers import WanTransformer3DModel

    args = argparse.Namespace(ema=False)
    peer.apply_own_recipe(args)
    assert (args.clip_range, args.beta, args.lora_rank, args.lr) == (1e-3, 0.004, 32, 1e-4)
    assert (args.num_steps, int(args.num_steps * args.timestep_fraction), args.ema) == (20, 19, True)

    torch.manual_seed(0)
    base = WanTransformer3DModel.from_pretrained(ROOT / "miles/world/pipeline/transformer").eval()
    x = torch.randn(1, 8, 3, 8, 8)
    t = torch.tensor([500.0])
    text = torch.randn(1, 64, 32)

    def run(model):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with torch.no_grad():
        reference = run(base)
    lora = peer.with_lora(base, 32)
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} <= {"to_q", "to_k", "to_v", "0"}
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a trained adapter (B starts at zero)
        adapted = run(lora)
        with lora.disable_adapter():  # flow_grpo's reference forward
            torch.testing.assert_close(run(lora), reference)
    assert (adapted - reference).abs().max() > 1e-4
    pipe = argparse.Namespace(transformer=lora)
    model_dir = tmp_path / "model"
    (model_dir / "vae").mkdir(parents=True)
    peer.export(pipe, model_dir, tmp_path / "export")
    merged = WanTransformer3DModel.from_pretrained(tmp_path / "export" / "transformer").eval()
    with torch.no_grad():
        torch.testing.assert_close(run(merged), adapted, atol=1e-5, rtol=1e-4)
    assert (tmp_path / "export" / "vae").is_symlink()
    # its KL: mean over the latent of (mean - mean_ref)^2 / (2 (std_dev_t dt_ref)^2)
    m, m_ref = torch.randn(2, 4, 3, 5, 5), torch.randn(2, 4, 3, 5, 5)
    std, dt = torch.full((2, 1, 1, 1, 1), 0.3), torch.full((2, 1, 1, 1, 1), 0.1)
    want = ((m - m_ref) ** 2).mean() / (2 * (0.3 * 0.1) ** 2)
    torch.testing.assert_close(peer.kl_loss(m, m_ref, std, dt), want)
