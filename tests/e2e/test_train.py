"""The main job through torchrun: a few GRPO steps of the tiny model at dp2 x sp2 and at dp4.

Checks that every metric the README documents is logged, that the first optimizer step of
each rollout (weights identical to the ones that sampled it) has ratio exactly 1 and a
train-vs-rollout canary of exactly 0 — on CPU fp32 the recompute repeats the rollout's
arithmetic bit for bit (same micro-batches, same kernels); the seed measured ~1e-5 in bf16 on
GPUs — and that sample videos, the wandb offline run, a checkpoint and the export are written.
The runs share one torchrun launch with the other modules' (``tests/e2e/conftest.py``).
"""

import json
from pathlib import Path

import pytest

from tests.e2e.multi_run import Run

pytestmark = pytest.mark.e2e


REQUIRED = [
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "reward/jpeg_incompressibility/mean",
    "advantage/mean",
    "advantage/std",
    "time/rollout_s",
    "time/reward_s",
    "time/train_s",
    "time/step_s",
    "perf/train_tokens_per_s",
    "memory/peak_gib",
    "train/loss",
    "train/policy_loss",
    "train/clipfrac",
    "train/approx_kl",
    "train/grad_norm",
    "train/ratio",
    "train/log_prob_mean_abs_diff",
]


TINY_RECIPE = ["--config", "configs/tiny_cpu.yaml", "--train.num-rollouts", "2"]


def check_log(run: Run) -> Path:
    """The run's own part of the launch's log: it trained, quietly; returns its directory."""
    assert "[rollout 1]" in run.stdout, run.stdout[-3000:]
    # Quiet logs: progress is on by default, but stdout/stderr are pipes here, not a terminal.
    for noise in ("\r", "\x1b[", "Loading pipeline components", "it/s]", "should be kept in float32"):
        assert noise not in run.output, f"{noise!r} in the log of {run.name}:\n{run.output[-3000:]}"
    assert "[miles] loaded 16 prompts from the built-in list" in run.stdout
    return run.run_dir


RUNS = {
    "dp2sp2": ["--sequence-parallel-size", "2", "--ulysses-degree", "2", "--run.log-video-every", "1"],
    # a full fine-tune with the KL to a frozen sharded copy of the initial weights
    "dp4": ["--data.prompts-per-rank", "1", "--train.no-export", "--grpo.kl-beta", "0.01"],
    # torch.compile per block in bf16: the rollout's no-grad graph and training's graph agree bit
    # for bit only where Inductor rounds intermediates as eager mode does (emulate_precision_casts)
    "dp2sp2-compiled-bf16": [
        "--sequence-parallel-size",
        "2",
        "--model.compile",
        "on",
        "--model.dtype",
        "bfloat16",
        "--train.no-export",
    ],
    # HSDP: parameters sharded inside each sp group (2 ranks), replicated over the 2 dp groups
    "dp2sp2-hsdp2": ["--sequence-parallel-size", "2", "--parallel.replicate-size", "2", "--train.no-export"],
    # dp2sp2 with each micro-batch decoded as soon as it is sampled (rollout.overlap_decode)
    "dp2sp2-overlap-decode": [
        "--sequence-parallel-size",
        "2",
        "--ulysses-degree",
        "2",
        "--run.log-video-every",
        "1",
        "--rollout.overlap-decode",
        "--train.no-export",
    ],
}


SHARED_RUNS = {4: {name: [*TINY_RECIPE, *flags] for name, flags in RUNS.items()}}  # tests/e2e/conftest.py


@pytest.fixture(scope="module")
def runs(shared_runs) -> dict[str, Path]:
    return {name: check_log(shared_runs[name]) for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_training_logs_every_metric(runs, name):
    run = runs[name]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 2 rollouts x 2 optimizer steps
    firsts = [r for r in rows if "reward/mean" in r]
    assert len(firsts) == 2
    for r in firsts:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["train/ratio"] == 1.0 and r["train/clipfrac"] == 0.0
        assert r["train/log_prob_mean_abs_diff"] == 0.0
        assert r["reward/min"] <= r["reward/mean"] <= r["reward/max"] and r["reward/std"] > 0
        assert r["train/grad_norm"] > 0
    # the second step of a rollout runs with updated weights: its ratio moved off 1
    assert any(r["train/ratio"] != 1.0 for r in rows if "reward/mean" not in r)
    assert (run / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    if name == "dp4":  # the reference is the initial policy: KL 0 before the first update only
        kl = [r["train/kl"] for r in rows]
        assert kl[0] == 0.0 and all(v > 0 for v in kl[1:]), kl
        approx = [r["train/approx_kl"] for r in rows]  # vs the rollout's policy: 0 on each first step
        assert approx[0] == approx[2] == 0.0 and approx[1] > 0 and approx[3] > 0, approx
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run"
    if name == "dp2sp2":
        videos = sorted((run / "samples").rglob("*.mp4"))
        # rank 0 decodes every sp-th (2nd) micro-batch of its 8 samples: 2 of 4 micro-batches of 2
        assert len(videos) == 2 * 4
        captions = json.loads((videos[0].parent / "captions.json").read_text())
        assert captions[0]["prompt"] and isinstance(captions[0]["reward"], float)
        assert (run / "export" / "pipeline" / "transformer_2" / "config.json").is_file()


def test_decoding_during_the_rollout_changes_no_number(runs):
    """``rollout.overlap_decode`` hands scoring the frames each sp rank decoded while the rollout
    went on (on CPU: right after each micro-batch): every logged number but the timings, and the
    logged samples' rewards, are those of the same run decoding after the rollout."""

    def numbers(row: dict) -> dict:
        return {
            k: v for k, v in row.items() if k != "time" and not k.startswith(("time/", "perf/", "memory/"))
        }

    def rows(name):
        return [numbers(json.loads(line)) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]

    plain, ahead = rows("dp2sp2"), rows("dp2sp2-overlap-decode")
    assert len(plain) == 4 and plain == ahead

    def captions(name):
        files = sorted((runs[name] / "samples").rglob("captions.json"))
        return [json.loads(f.read_text()) for f in files]

    assert captions("dp2sp2-overlap-decode") == captions("dp2sp2") != []
