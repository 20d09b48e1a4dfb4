"""The second model family end to end: Flow-GRPO and DiffusionNFT on the tiny LTX-Video
(``configs/tiny_ltx_cpu.yaml``, random weights) through torchrun, in dp and dp x sp.

- Flow-GRPO at dp2 (2 processes) and dp2 x sp2 (Ulysses, 4 processes) in deterministic mode: the
  same global batch, so the same rollouts and rewards, and the same losses and gradient norms
  step by step (sequence parallelism changes no number beyond fp32 rounding); the training
  recompute of the first step's log-probs equals the rollout's bit for bit in both layouts.
- DiffusionNFT at dp2 x sp2: it trains (the old policy lags after its soft update).
- The dp2 run's export loads in diffusers' ``LTXPipeline``, with the trained transformer.

The runs share the session's torchrun launches with the other modules' (``tests/e2e/conftest.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_train import check_log

pytestmark = pytest.mark.e2e

LTX = ["--config", "configs/tiny_ltx_cpu.yaml", "--deterministic-mode"]
SP2 = ["--sequence-parallel-size", "2", "--ulysses-degree", "2"]
NFT = ["--algorithm.name", "diffusion_nft", "--rollout.guidance-scale", "1.0", "--train.no-export"]

SHARED_RUNS = {  # tests/e2e/conftest.py
    2: {"ltx_grpo_dp2": LTX},
    4: {"ltx_grpo_dp2sp2": [*LTX, *SP2, "--train.no-export"], "ltx_nft_dp2sp2": [*LTX, *NFT, *SP2]},
}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(shared_runs) -> dict[str, Path]:
    return {name: check_log(shared_runs[name]) for named in SHARED_RUNS.values() for name in named}


def test_ltx_grpo_sequence_parallel_parity(runs):
    dp2, sp = _rows(runs["ltx_grpo_dp2"]), _rows(runs["ltx_grpo_dp2sp2"])
    assert [r["step"] for r in dp2] == [r["step"] for r in sp] == [1, 2, 3, 4]
    for a, b in zip(dp2, sp):
        for key in ("reward/mean", "train/loss", "train/grad_norm"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-3), (key, a[key], b[key])
    firsts = [r for r in dp2 + sp if "reward/mean" in r]
    assert firsts[0]["reward/mean"] == firsts[2]["reward/mean"]  # the same rollout, bit for bit
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in firsts)
    assert dp2[-1]["train/loss"] != dp2[0]["train/loss"]


def test_ltx_nft_trains_under_sequence_parallelism(runs):
    rows = _rows(runs["ltx_nft_dp2sp2"])
    firsts = [r for r in rows if "reward/mean" in r]
    assert firsts[0]["train/old_deviation"] == 0.0 and firsts[1]["train/old_deviation"] > 0.0
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)


def test_ltx_export_loads_in_diffusers(runs):
    import torch
    from diffusers import LTXPipeline

    from miles.models.tiny import tiny_model_path

    pipe = LTXPipeline.from_pretrained(runs["ltx_grpo_dp2"] / "export" / "pipeline", local_files_only=True)
    tiny = tiny_model_path(Path(__file__).resolve().parents[2] / ".cache" / "tiny-wan", "ltx")
    base = LTXPipeline.from_pretrained(tiny, local_files_only=True)
    trained, initial = pipe.transformer.state_dict(), base.transformer.state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # the trained weights
    assert all(
        torch.equal(a, b) for a, b in zip(pipe.vae.state_dict().values(), base.vae.state_dict().values())
    )
