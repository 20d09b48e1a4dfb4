"""Flow-GRPO's old log-probs when the rollout ran in another precision (``rollout.precision: fp8``).

The rollout's recorded log-probs are the FP8 policy's. The loss instead takes as old log-probs
those of the bf16 policy at the weights that sampled the rollout (a forward on the trained SDE
steps), and weights each sample-step by the truncated importance weight of the two
(``miles.grpo.tis``). The bf16 old log-probs cost nothing for the micro-batches of a rollout's
first optimizer step: its forward, with gradient, runs at exactly those weights, so its detached
log-prob is the old one. The micro-batches of later steps get a no-gradient forward during the
first step, before the optimizer moves the weights, and are kept until their step (K floats a sample).
Every rank runs the same micro-batch count, so FSDP's collectives pair up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from miles.grpo.tis import DriftStats
from miles.rollout.batch import MicroBatch, RolloutBatch

__all__ = ["RolloutCorrection"]


class RolloutCorrection:
    """The bf16 old log-probs of one rollout's micro-batches and the step's drift metrics.

    ``cap`` (``rollout.tis_cap``): the importance weights' truncation; 0 keeps the rollout's own
    log-probs as old ones and no weights (the drift is still measured, on the recomputed log-probs)."""

    def __init__(self, cap: float):
        self.cap = cap
        self.stats = DriftStats()
        self._rollout_index: int | None = None
        self._old: dict[int, Tensor] = {}  # micro-batch start -> (B, K) bf16 old log-probs

    def begin(
        self,
        log_prob: Callable[[MicroBatch, int], Tensor],
        batch: RolloutBatch,
        chunks: list[MicroBatch],
        step_in_rollout: int,
    ) -> None:
        """Start an optimizer step over ``chunks``; at a rollout's first step, recompute (no gradient,
        ``log_prob(chunk, k)``) the old log-probs of the micro-batches later steps train on."""
        self.stats = DriftStats()
        if step_in_rollout == 0:
            self._rollout_index, self._old = batch.rollout_index, {}
            mine = {id(c) for c in chunks}
            with torch.no_grad():
                for chunk in batch.chunks:
                    if id(chunk) not in mine:
                        num_k = chunk.rollout.log_probs.shape[1]
                        self._old[chunk.slice.start] = torch.stack(
                            [log_prob(chunk, k).float() for k in range(num_k)], dim=1
                        )
        elif self._rollout_index != batch.rollout_index:
            raise RuntimeError(
                f"optimizer step {step_in_rollout} of rollout {batch.rollout_index} before its step 0: "
                "the bf16 old log-probs are recomputed at a rollout's first step"
            )

    def old_and_weight(
        self,
        chunk: MicroBatch,
        k: int,
        log_prob: Tensor,
        rollout_log_prob: Tensor,
        share: float,
        step_in_rollout: int,
    ) -> tuple[Tensor, Tensor | None]:
        """The old log-probs (B,) for the ratio of SDE step ``k`` and the TIS weights (None: no
        correction); records the drift with ``share``, the micro-batch-step's weight in the mean."""
        if step_in_rollout == 0:
            old = log_prob.detach().float()
        else:
            old = self._old[chunk.slice.start][:, k].to(log_prob.device)
        w = self.stats.add(old, rollout_log_prob, self.cap, share)
        if self.cap == 0:
            return rollout_log_prob, None
        return old, w

    def metrics(self) -> dict[str, float]:
        return self.stats.metrics()
