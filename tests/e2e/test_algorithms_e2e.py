"""DiffusionNFT, GRPO-Guard and CPS end to end through torchrun (4 CPU processes, tiny model; NFT on
the bands' recipe, whose sharpness reward is continuous).

- DiffusionNFT at dp2 (2 processes) and at dp2 x sp2 (Ulysses, 4 processes) in deterministic
  mode: sequence parallelism changes neither the rollouts (sampled by the old policy) nor any
  optimizer step's loss and gradient norm; the old policy's decay follows its schedule and the
  checkpoint holds the old policy.
- DiffusionNFT at dp4 against dp2 x sp2 on the same global batch: every rank draws the same
  noise levels per optimizer step, so with two experts every rank runs the same expert at each
  pass. Measured within 2e-6 over 4 steps (fp32
  reduction order); levels drawn per micro-batch made ranks all-gather different experts'
  shards into each other, and the loss differed by ~0.5% at step 1.
- GRPO-Guard, and Flow-GRPO with CPS sampling, at dp2 x sp2: the first step runs with the
  sampling weights, so the (normalised) ratio is exactly 1 and the log-prob canary 0 — the
  training recompute under SP reproduces the rollout's log-probs bit for bit; the second step's
  ratio moves.
- AWM, DGPO and online DPO at dp2 and at dp2 x sp2 (Ulysses) in deterministic mode: the same
  losses and gradient norms step by step, and at the first step (initial weights) the values
  that an untrained lagging copy and reference imply.

The runs share the session's torchrun launches with the other modules' (``tests/e2e/conftest.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.e2e.test_train import TINY_RECIPE, check_log

pytestmark = pytest.mark.e2e

NFT = ["--algorithm.name", "diffusion_nft", "--rollout.guidance-scale", "1.0", "--deterministic-mode"]
SP2 = ["--sequence-parallel-size", "2", "--ulysses-degree", "2"]
# The bands' recipe: its sharpness reward is continuous. JPEG sizes jump with last-bit pixel
# changes, so the layouts' fp32 rounding after the first update would move tiny_cpu's rewards.
BANDS = ["--config", "configs/tiny_bands.yaml", "--train.num-rollouts", "2", "--train.no-export"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _agree(first: list[dict], second: list[dict]) -> None:
    assert [r["step"] for r in first] == [r["step"] for r in second] == [1, 2, 3, 4]
    for a, b in zip(first, second):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train/positive_loss"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-3), (
                    key,
                    a[key],
                    b[key],
                )  # the GRPO bands tolerance


SDE_VARIANTS = {"guard": ["--algorithm.name", "grpo_guard"], "cps": ["--rollout.sde-type", "cps"]}


# AWM, DGPO and online DPO: CFG-free ODE rollouts on the bands' recipe (4 denoising steps, so 2
# trained levels), one optimizer step per rollout so that a step holds whole groups (pairs and
# group weights need a group's samples together).
MATCHING = {
    "awm": ["--awm.num-levels", "2"],
    "dgpo": ["--dgpo.num-levels", "2"],
    "online_dpo": ["--dpo.num-levels", "2"],
}


def _matching(algorithm: str) -> list[str]:
    flags = ["--algorithm.name", algorithm, *MATCHING[algorithm], "--rollout.guidance-scale", "1.0"]
    return [*TINY_RECIPE, *flags, "--deterministic-mode", "--train.steps-per-rollout", "1", *BANDS]


SHARED_RUNS = {  # tests/e2e/conftest.py
    2: {
        "nft_dp2": [*TINY_RECIPE, *NFT, *BANDS],
        **{f"{a}_dp2": _matching(a) for a in MATCHING},
    },
    4: {
        "nft_dp2sp2": [*TINY_RECIPE, *NFT, *SP2, *BANDS],
        "nft_dp4": [*TINY_RECIPE, *NFT, *BANDS],
        "nft_dp2sp2_ppr4": [*TINY_RECIPE, *NFT, *SP2, *BANDS, "--data.prompts-per-rank", "4"],
        **{name: [*TINY_RECIPE, *flags, *SP2, "--train.no-export"] for name, flags in SDE_VARIANTS.items()},
        **{f"{a}_dp2sp2": [*_matching(a), *SP2] for a in MATCHING},
    },
}


@pytest.fixture(scope="module")
def runs(shared_runs) -> dict[str, Path]:
    return {name: check_log(shared_runs[name]) for named in SHARED_RUNS.values() for name in named}


def test_nft_sequence_parallel_parity(runs):
    dp2 = _rows(runs["nft_dp2"])
    run = runs["nft_dp2sp2"]
    sp = _rows(run)
    _agree(dp2, sp)
    firsts = [r for r in sp if "reward/mean" in r]
    assert [r["train/old_decay"] for r in firsts] == pytest.approx([0.002, 0.004])  # 0.001 * step
    assert firsts[0]["train/old_deviation"] == 0.0  # the first step: old and trained weights equal
    assert firsts[1]["train/old_deviation"] > 0.0  # the old policy lags after the soft update
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step_000004")).read_metadata()
    assert any(k.startswith("old_policy.") for k in meta.state_dict_metadata)


def test_nft_dp_layouts_agree(runs):
    _agree(_rows(runs["nft_dp4"]), _rows(runs["nft_dp2sp2_ppr4"]))


@pytest.mark.parametrize("name", list(SDE_VARIANTS))
def test_sde_variants_train(runs, name):
    rows = _rows(runs[name])
    firsts = [r for r in rows if "reward/mean" in r]
    assert [r["train/ratio"] for r in firsts] == [1.0, 1.0]
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in firsts)
    assert any(r["train/ratio"] != 1.0 for r in rows if "reward/mean" not in r)


@pytest.mark.parametrize("algorithm", list(MATCHING))
def test_matching_algorithms_sequence_parallel_parity(runs, algorithm):
    """dp2 and dp2 x sp2 (Ulysses) agree step by step; the first step runs with the initial weights,
    so the lagging copy and the reference equal the trained policy there: AWM's EMA term is 0,
    DGPO's group weights are sigmoid(0) = 0.5 with nothing clipped, DPO's loss is log 2."""
    dp2 = _rows(runs[f"{algorithm}_dp2"])
    sp = _rows(runs[f"{algorithm}_dp2sp2"])
    assert [r["step"] for r in dp2] == [r["step"] for r in sp] == [1, 2]
    for a, b in zip(dp2, sp):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train/matching_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-3), (key, a[key], b[key])
    first = sp[0]
    if algorithm == "awm":
        assert first["train/ema_kl"] == 0.0 and first["train/kl"] == 0.0
        assert sp[1]["train/kl"] > 0.0
    elif algorithm == "dgpo":
        assert first["train/group_weight"] == pytest.approx(0.5, abs=1e-7)
        assert first["train/clipfrac"] == 0.0
    else:
        assert first["train/loss"] == pytest.approx(math.log(2.0), rel=1e-6)
        assert first["train/pairs_per_group"] == 1.0
        assert sp[1]["train/loss"] != pytest.approx(math.log(2.0), rel=1e-6)
