"""Damaged checkpoints and failing disks, on the real Trainer (one gloo rank, the tiny recipe).

- A truncated shard in the newest checkpoint is named (``checkpoint_problem``) and the next launch
  resumes from the previous complete checkpoint; a missing shard and unreadable metadata are named too.
- A save that fails with "No space left on device" while the shards are written raises
  ``CheckpointWriteError`` naming the reason and the last complete checkpoint, and leaves no
  ``.partial`` folder.

About 25 s on 2 cores.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _config(out_dir: str):
    from miles.config import parse_args

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", "faults", "--run.wandb-mode", "disabled", "--run.no-progress"]
        + ["--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan"), "--train.num-rollouts", "2"]
        + ["--train.steps-per-rollout", "1", "--train.checkpoint-every", "1", "--train.no-export"]
        + ["--train.keep-checkpoints", "3"]
    )
    return cfg


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _body(rank, world_size, out_dir):
    import torch.distributed.checkpoint as dcp

    import miles.train.trainer as T
    from miles.train.checkpoint import CheckpointWriteError, checkpoint_problem

    cfg = _config(out_dir)
    trainer = T.Trainer(cfg)
    trainer.train()
    trainer.close()
    ckpts = Path(out_dir) / "faults" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]
    assert checkpoint_problem(ckpts / "step_000002") is None

    _truncate(ckpts / "step_000002" / "__0_0.distcp")
    problem = checkpoint_problem(ckpts / "step_000002")
    assert problem.startswith("its shard __0_0.distcp is truncated (") and "the metadata needs" in problem
    resumed = T.Trainer(cfg)  # the newest is cut short: the previous one is taken
    assert resumed.resume_from == ckpts / "step_000001" and resumed.step == 1, resumed.resume_from

    # Disk full while the shards are written: one shard half-written, then ENOSPC.
    real_save = dcp.save

    def full_disk(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(checkpoint_id) / "__0_0.distcp"))

    dcp.save = full_disk
    try:
        resumed.step = 5
        try:
            resumed.save()
        except CheckpointWriteError as e:
            message = str(e)
        else:
            raise AssertionError("a full disk did not stop the save")
    finally:
        dcp.save = real_save
    assert "could not write the checkpoint" in message and "No space left on device" in message, message
    # The last complete checkpoint that verifies: step 2 was cut short above, so step 1.
    assert "--run.output-dir" in message and str(ckpts / "step_000001") in message, message
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"], "a .partial was left"
    resumed.close()

    (ckpts / "step_000002" / "__0_0.distcp").unlink()
    assert checkpoint_problem(ckpts / "step_000002") == "its shard __0_0.distcp is missing"
    (ckpts / "step_000001" / ".metadata").write_bytes(b"garbage")
    assert checkpoint_problem(ckpts / "step_000001").startswith("its .metadata is not a DCP checkpoint index")


def test_corrupt_checkpoint_falls_back_and_a_full_disk_leaves_nothing(tmp_path):
    run_pooled(_body, 1, str(tmp_path))
