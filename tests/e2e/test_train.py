"""The main job through torchrun: a few GRPO steps of the tiny model at dp2 x sp2 and at dp4.

Checks that every metric the README documents is logged, that the first optimizer step of
each rollout (weights identical to the ones that sampled it) has ratio exactly 1 and a
train-vs-rollout canary of exactly 0 — on CPU fp32 the recompute repeats the rollout's
arithmetic bit for bit (same micro-batches, same kernels); the seed measured ~1e-5 in bf16 on
GPUs — and that sample videos, the wandb offline run, a checkpoint and the export are written.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.dist_utils import FINISHED_ENV, may_retry

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

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


def _launch(tmp_path: Path, name: str, *flags: str, nproc: int = 4) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "train_grpo.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "--run.output-dir",
        str(tmp_path),
        "--run.name",
        name,
        "--train.num-rollouts",
        "2",
        *flags,
    ]
    for attempt in range(2):
        env[FINISHED_ENV] = tempfile.mkdtemp(prefix="finished_", dir=tmp_path)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        # One retry, from a clean directory, only for a failure after every rank had finished its
        # work (a rare gloo teardown abort on CPU); a rank killed mid-run or an error fails at once.
        output = proc.stdout + proc.stderr
        if attempt or not may_retry(proc.returncode, env[FINISHED_ENV], nproc, f"the launch {name}", output):
            break
        shutil.rmtree(tmp_path / name, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rollout 1]" in proc.stdout
    # Quiet logs: progress is on by default, but stdout/stderr are pipes here, not a terminal.
    output = proc.stdout + proc.stderr
    for noise in ("\r", "\x1b[", "Loading pipeline components", "it/s]", "should be kept in float32"):
        assert noise not in output, f"{noise!r} in the log:\n{output[-3000:]}"
    assert "[miles] loaded 16 prompts from the built-in list" in proc.stdout
    return tmp_path / name


@pytest.mark.parametrize(
    "name,flags",
    [
        ("dp2sp2", ["--sequence-parallel-size", "2", "--ulysses-degree", "2", "--run.log-video-every", "1"]),
        # a full fine-tune with the KL to a frozen sharded copy of the initial weights
        ("dp4", ["--data.prompts-per-rank", "1", "--train.no-export", "--grpo.kl-beta", "0.01"]),
        # torch.compile per block in bf16: the rollout's no-grad graph and training's graph agree bit
        # for bit only where Inductor rounds intermediates as eager mode does (emulate_precision_casts)
        (
            "dp2sp2-compiled-bf16",
            [
                "--sequence-parallel-size",
                "2",
                "--model.compile",
                "on",
                "--model.dtype",
                "bfloat16",
                "--train.no-export",
            ],
        ),
        # HSDP: parameters sharded inside each sp group (2 ranks), replicated over the 2 dp groups
        (
            "dp2sp2-hsdp2",
            ["--sequence-parallel-size", "2", "--parallel.replicate-size", "2", "--train.no-export"],
        ),
    ],
)
def test_training_logs_every_metric(tmp_path, name, flags):
    run = _launch(tmp_path, name, *flags)
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
