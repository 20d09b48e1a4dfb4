"""Learning-rate schedules (``train.lr_schedule``, ``train.lr_warmup_steps``) against their formula,
continued across a save and resume; TensorBoard event files holding the metrics under their names."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.train.schedule import build_lr_scheduler, current_lr

LR = 1e-3


def _cfg(schedule: str, warmup: int, min_ratio: float = 0.1, rollouts: int = 10, per: int = 2):
    return SimpleNamespace(
        num_rollouts=rollouts, steps_per_rollout=per, learning_rate=LR,
        lr_schedule=schedule, lr_warmup_steps=warmup, lr_min_ratio=min_ratio,
    )  # fmt: skip


def _expected(k: int, schedule: str, warmup: int, min_ratio: float, total: int) -> float:
    """The lr of the (k+1)-th optimizer step, written out (miles/train/schedule.py's docstring)."""
    if warmup >= 2 and k < warmup:
        return LR * (k + 1) / warmup
    if schedule == "constant":
        return LR
    w = warmup if warmup >= 2 else 0
    lr_min = LR * min_ratio
    return lr_min + (LR - lr_min) * (1 + math.cos(math.pi * (k - w) / (total - w))) / 2


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=LR)


def _lrs(opt, sched, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(current_lr(opt))
        opt.step()
        if sched is not None:
            sched.step()
    return out


@pytest.mark.parametrize("schedule,warmup", [("cosine", 5), ("cosine", 0), ("constant", 4), ("constant", 0)])
def test_the_lr_at_each_step_follows_the_formula(schedule, warmup):
    cfg = _cfg(schedule, warmup)
    opt = _optimizer()
    got = _lrs(opt, build_lr_scheduler(opt, cfg), 20)
    want = [_expected(k, schedule, warmup, 0.1, 20) for k in range(20)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    if schedule == "cosine":
        assert (
            got[warmup] == pytest.approx(LR) and got[-1] > LR * 0.1
        )  # the last step is one short of the floor


def test_a_resumed_run_continues_the_schedule():
    cfg = _cfg("cosine", 4)
    opt = _optimizer()
    sched = build_lr_scheduler(opt, cfg)
    first = _lrs(opt, sched, 7)
    saved_opt, saved_sched = opt.state_dict(), json.loads(json.dumps(sched.state_dict()))  # trainer.json
    rest = _lrs(opt, sched, 13)
    opt2 = _optimizer()
    sched2 = build_lr_scheduler(opt2, cfg)  # the relaunch builds it afresh, then loads the checkpoint
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert _lrs(opt2, sched2, 13) == pytest.approx(rest, rel=1e-12)
    assert first + rest == pytest.approx([_expected(k, "cosine", 4, 0.1, 20) for k in range(20)], rel=1e-9)


def test_a_cosine_schedule_with_no_steps_left_after_the_warm_up_is_refused():
    with pytest.raises(ConfigError, match="lr_warmup_steps must be below"):
        parse_args(
            ["--train.lr-schedule", "cosine", "--train.lr-warmup-steps", "6", "--train.num-rollouts", "3"]
        )


def test_tensorboard_event_files_hold_the_metric_names_and_the_eval_video(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from miles.eval.videos import write_gif
    from miles.train.logging import MetricsLogger

    logger = MetricsLogger(
        tmp_path, {}, mode="disabled", project="p", name="n", enabled=True, tensorboard=True
    )
    logger.log({"reward/mean": 0.5, "train/lr": 1e-4, "train/loss": torch.tensor(2.0)}, step=1)
    logger.log({"train/loss": 1.5}, step=2)
    frames = np.zeros((3, 8, 10, 3), np.uint8)
    frames[1, :, :, 0] = 255
    write_gif(frames, tmp_path / "grid.gif")
    logger.log_eval({"eval/reward/mean": 0.3}, step=2, grid=tmp_path / "grid.gif", caption="held-out")
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0}).Reload()
    jsonl = {k for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert set(acc.Tags()["scalars"]) == (jsonl - {"step", "time"}) | {"eval/reward/mean"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5)]
    (image,) = acc.Images("eval/grid")
    assert (image.step, image.width, image.height) == (2, 10, 8)
    assert image.encoded_image_string[:6] == b"GIF89a"


def test_a_resume_is_refused_when_the_schedule_would_not_continue(tmp_path):
    from miles.config import to_dict
    from miles.train.resume import check_resume_config

    cosine = ["--train.lr-schedule", "cosine", "--train.lr-warmup-steps", "2", "--train.num-rollouts", "5"]
    saved = to_dict(parse_args(cosine)[0])
    check_resume_config(tmp_path, saved, parse_args(cosine)[0])  # the same run: resumes
    with pytest.raises(ValueError, match="cosine schedule's length.*10 optimizer steps, this launch 16"):
        check_resume_config(tmp_path, saved, parse_args([*cosine, "--train.num-rollouts", "8"])[0])
    with pytest.raises(
        ValueError, match=r"train.lr_warmup_steps \(the lr schedule\).*--train.lr-warmup-steps 2"
    ):
        check_resume_config(tmp_path, saved, parse_args([*cosine, "--train.lr-warmup-steps", "3"])[0])
    old = to_dict(parse_args([])[0])
    del old["train"]["lr_schedule"]  # a checkpoint from before schedules: it ran a constant lr
    check_resume_config(
        tmp_path, old, parse_args(["--train.num-rollouts", "9"])[0]
    )  # constant: longer is fine
