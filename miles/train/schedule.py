"""The learning-rate schedule: linear warm-up, then constant or cosine, by torch's own schedulers.

With W = ``train.lr_warmup_steps``, T = ``train.num_rollouts`` · ``train.steps_per_rollout`` (the
run's optimizer steps), lr = ``train.learning_rate`` and k the optimizer steps already taken, the
(k+1)-th step uses

    k < W:   lr · (k + 1) / W                                         (``LinearLR``)
    k >= W:  lr                                                       (``constant``)
             lr_min + (lr − lr_min) · (1 + cos(π · (k − W) / (T − W))) / 2   (``cosine``: ``CosineAnnealingLR``,
                                                                       lr_min = ``train.lr_min_ratio`` · lr)

chained by ``SequentialLR`` at step W. The scheduler steps once after every optimizer step; its
state is saved in the checkpoint's ``trainer.json`` (and the optimizer's own state holds the
current lr), so a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def build_lr_scheduler(optimizer: Optimizer, train_cfg) -> LRScheduler | None:
    """The schedule of ``train_cfg`` (``miles.config.TrainConfig``) over ``optimizer``; None when the
    lr is constant with no warm-up."""
    total = train_cfg.num_rollouts * train_cfg.steps_per_rollout
    warmup = train_cfg.lr_warmup_steps
    if warmup >= 2:
        # factor 1/W + (1 − 1/W)·k/(W − 1) = (k + 1)/W for k < W, then 1
        warm = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)
    else:
        warmup, warm = 0, None  # one warm-up step at lr/1 is no warm-up
    if train_cfg.lr_schedule == "constant":
        return warm
    lr_min = train_cfg.learning_rate * train_cfg.lr_min_ratio
    cosine = CosineAnnealingLR(optimizer, T_max=max(total - warmup, 1), eta_min=lr_min)
    if warm is None:
        return cosine
    return SequentialLR(optimizer, [warm, cosine], milestones=[warmup])


def current_lr(optimizer: Optimizer) -> float:
    """The lr the next optimizer step uses (the first parameter group's)."""
    return float(optimizer.param_groups[0]["lr"])
