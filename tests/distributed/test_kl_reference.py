"""The KL to the reference policy through the real Trainer: LoRA on 2 gloo ranks (dp2, FSDP).

Two rollouts of two optimizer steps each with ``grpo.kl_beta`` 0.01 and LoRA rank 4:

- ``train/kl`` is exactly 0 at step 1 (the adapters start at B = 0: the policy is the reference)
  and > 0 at steps 2-4 (the adapters moved); ``train/approx_kl`` (the policy vs the one that
  sampled the rollout) is exactly 0 on each rollout's first step and > 0 on its second.
- With the adapters disabled (the reference the KL is taken to), the sharded, trained experts'
  forward equals the base model's, loaded fresh from the model folder, bit for bit.

The full fine-tune's KL (a frozen sharded copy as reference) runs through torchrun in
tests/e2e/test_train.py (the dp4 case). About 20 s on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import FIXED_SEEDS, run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _body(rank, world_size, out_dir):
    import torch
    from diffusers import WanTransformer3DModel

    from miles.config import parse_args
    from miles.train.trainer import Trainer

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", "kl", "--run.wandb-mode", "disabled", "--run.no-progress", "--train.no-export"]
        + ["--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan"), "--train.num-rollouts", "2"]
        + ["--model.lora-rank", "4", "--grpo.kl-beta", "0.01", "--train.learning-rate", "1e-3"]
        + ["--data.prompts-per-rank", "1"]
    )
    trainer = Trainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in (Path(out_dir) / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    kl = [r["train/kl"] for r in rows]
    assert kl[0] == 0.0 and all(v > 0 for v in kl[1:]), kl
    approx = [r["train/approx_kl"] for r in rows]
    assert approx[0] == approx[2] == 0.0 and approx[1] > 0 and approx[3] > 0, approx

    g = torch.Generator().manual_seed(FIXED_SEEDS[0])
    for expert, sub in zip(trainer.model.transformers, ("transformer", "transformer_2")):
        base = WanTransformer3DModel.from_pretrained(trainer.model.path / sub, torch_dtype=torch.float32)
        c = base.config
        latents = torch.randn(1, c.in_channels, 2, 8, 8, generator=g)
        text = torch.randn(1, 16, c.text_dim, generator=g)
        t = torch.tensor([937.7])
        with torch.no_grad():
            want = base(latents, t, text, return_dict=False)[0]
            with trainer._reference_experts() as reference:
                got = reference[trainer.model.transformers.index(expert)](
                    latents, t, text, return_dict=False
                )[0]
            trained = expert(latents, t, text, return_dict=False)[0]
        assert torch.equal(got, want), (sub, (got - want).abs().max().item())
        assert not torch.equal(trained, want), f"{sub}: the adapters did not train"
    trainer.close()


def test_kl_with_lora_through_the_trainer(tmp_path):
    run_pooled(_body, 2, str(tmp_path))
