"""``grpo.clip_range: auto``: the clip range measured from the ratios of the run's first updates.

On a rollout's first optimizer step the ratio is 1 (the weights that sampled it), so nothing can
be measured there. Before the second step of each of the first ``grpo.calibration_rollouts``
rollouts, a no-gradient pass recomputes the log-probs of that step's micro-batches and every SDE
step's ratio r (the algorithm's own: GRPO-Guard's normalised one); the clip range becomes the
(1 − ``grpo.target_clipfrac``) quantile of |r − 1| over every rank's ratios (gathered, so every
rank and every dp × sp layout sets the same value; sp peers hold the same samples, and duplicating
every value does not move a quantile), so that step clips about the target fraction. The last
measurement is kept for the rest of the run (the first update after the initial weights moves them
most: Adam's first steps; measured on the world, its ratio spread is ~3x the later ones'), logged
as ``train/clip_range`` and saved in the checkpoint's trainer state (a resume keeps it). Each pass costs one no-gradient recomputation of one step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def calibrated_clip(abs_dev: torch.Tensor, target_clipfrac: float) -> float:
    """The clip range that ``target_clipfrac`` of the deviations |r − 1| (of every rank) exceed."""
    values = abs_dev.detach().double().flatten().cpu()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)  # every rank holds as many: equal micro-batches
        values = torch.cat(gathered)
    clip = float(torch.quantile(values, 1.0 - target_clipfrac))
    if not clip > 0:
        raise ValueError(
            "grpo.clip_range auto: the ratios of the first update are all 1 (the weights did not move): "
            "give a fixed grpo.clip_range"
        )
    return clip
