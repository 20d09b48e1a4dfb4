"""Nothing lost to a reward failure: a reward server that stays down ends the run with a checkpoint.

The remote rewards (``remote``, ``vlm_judge``) retry a failed request ``reward.*_retries`` times with
backoff (miles/rewards/remote.py). When the retries are spent the request raises
``RemoteRewardError`` on the rank that sent it, while its peers wait in the reward gather. The trained
reward mix is wrapped in :class:`GuardedRewards`: a failing call records the error and scores the
micro-batch NaN, so every rank reaches the gather and the trainer's NaN check as usual; the trainer then
asks :meth:`GuardedRewards.agreed_failure` (a MAX all-reduce) whether any rank's reward failed. If so
it puts the rollout back (the resumed run redoes it), saves the last finished step unless it is saved
already, and raises :class:`RewardFailed` naming the checkpoint and the command that resumes it; the
entry point prints it and exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles.rewards.remote import RemoteRewardError
from miles.train.outcome import resume_command


class RewardFailed(RuntimeError):
    """A reward could not be scored after its retries; raised on every rank after the save."""


class GuardedRewards:
    """The trained reward mix (``names``, ``weights``, ... pass through); a ``RemoteRewardError`` in a
    call is recorded and that micro-batch scores NaN instead of raising on one rank only."""

    def __init__(self, rewards):
        self.inner = rewards
        self.error: str | None = None

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, videos, *args):
        try:
            return self.inner(videos, *args)
        except RemoteRewardError as e:
            self.error = self.error or str(e)
            print(f"[miles] warning: a reward failed after its retries: {e}", file=sys.stderr, flush=True)
            nan = torch.full((len(videos),), float("nan"))
            return nan, {name: nan.clone() for name in self.inner.names}

    def agreed_failure(self, device: torch.device) -> str | None:
        """Collective: this rank's recorded error, or a note naming another rank's, when any rank's
        reward failed since the last call; None when none did. Clears the record."""
        failed = torch.tensor([0.0 if self.error is None else 1.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        error, self.error = self.error, None
        if failed.item() == 0.0:
            return None
        return error or "a reward failed on another rank after its retries (its log names the error)"


def reward_failed(error: str, step: int, checkpoint: Path | None) -> RewardFailed:
    """The error to raise: what failed, what was kept, and the command that resumes."""
    kept = (
        f"the last finished step {step} is saved in {checkpoint}"
        if checkpoint is not None
        else "no optimizer step had finished, so there is nothing to save"
    )
    return RewardFailed(
        f"the reward could not be scored ({error}); {kept}. Start the reward server again (or raise "
        f"reward.remote.retries / reward.remote.backoff_s to wait longer), then resume with the same "
        f"command: {resume_command(sys.argv[1:])}"
    )
