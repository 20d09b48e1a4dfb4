"""A reward server that stays down after its retries loses no training (the real Trainer, one gloo rank).

Rollout 0 scores and trains (step 1); every reward call of rollout 1 raises ``RemoteRewardError`` as
the remote client does once its retries are spent. The run must stop with ``RewardFailed`` (exit 1
through the entry point) naming the saved checkpoint and the resume command, save exactly
``step_000001`` (``checkpoint_every`` 0 would otherwise save nothing before the end), whose bytes
verify, whose weights equal the trainer's after step 1 (sha256 of the full state) and whose prompt
sampler stands before the failed rollout. About 20 s on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _body(rank, world_size, out_dir):
    import miles.train.trainer as T
    from miles.config import parse_args
    from miles.rewards.remote import RemoteRewardError
    from miles.train.checkpoint import verify_checkpoint, weights_digest
    from miles.train.reward_failure import RewardFailed

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", "down", "--run.wandb-mode", "disabled", "--run.no-progress"]
        + [
            "--model.tiny-model-dir",
            str(REPO / ".cache" / "tiny-wan"),
            "--model.tiny-variant",
            "single_expert",
        ]
        + ["--train.num-rollouts", "3", "--train.steps-per-rollout", "1", "--train.no-export"]
        + ["--data.prompts-per-rank", "1", "--data.group-size", "2", "--rollout.num-steps", "2"]
    )
    trainer = T.Trainer(cfg)
    inner = trainer.rewards.inner
    digests = {}

    def flaky(videos, *args):
        if trainer.rollout_index >= 1:
            raise RemoteRewardError(
                "POST http://127.0.0.1:1/score failed after 4 attempt(s); last error: refused"
            )
        return inner(videos, *args)

    sampler_during = {}
    original_score = trainer.score

    def score(batch):
        if trainer.rollout_index == 1:
            digests["step1"] = weights_digest(trainer.experts)
            sampler_during.update(trainer.sampler.state_dict())
        return original_score(batch)

    trainer.rewards.inner = flaky
    flaky.names = inner.names
    trainer.score = score
    try:
        with pytest.raises(RewardFailed) as info:
            trainer.train()
    finally:
        trainer.close()
    message = str(info.value)
    ckpt = Path(out_dir) / "down" / "checkpoints" / "step_000001"
    assert "the reward could not be scored (POST http://127.0.0.1:1/score failed" in message
    assert f"the last finished step 1 is saved in {ckpt}" in message
    assert "resume with the same command: python train_grpo.py" in message  # one process: no launcher
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step_000001"]
    verify_checkpoint(ckpt)
    assert weights_digest(trainer.experts) == digests["step1"]  # nothing of rollout 1 trained
    state = json.loads((ckpt / "trainer.json").read_text())
    assert state["step"] == 1 and state["rollout_index"] == 1
    assert state["sampler"] != sampler_during  # the sampler moved during rollout 1 ...
    assert state["sampler"] == trainer.sampler.state_dict()  # ... and was put back before the save


def test_reward_server_down_saves_the_last_step_and_says_how_to_resume(tmp_path):
    run_distributed(_body, 1, str(tmp_path))
