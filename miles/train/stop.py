"""Graceful stop: SIGINT / SIGTERM become a stop request that every rank agrees on at safe points.

A Ctrl-C (SIGINT to the whole foreground process group: torchrun and every worker) or a Slurm
preemption (SIGTERM, ``#SBATCH --signal``) does not kill a rank where it stands. The handler only
records the signal; the trainer asks :meth:`GracefulStop.requested` at safe points — before each
rollout micro-batch, before scoring, after each rollout — and that question is a collective (a MAX
all-reduce of the signal number), so the ranks stop together even when only one of them was
signalled. Before the first optimizer step of a rollout nothing has changed but the prompt
sampler's position, so the rollout is abandoned; once it trains, it finishes. Either way the
trainer then saves a checkpoint, prints how to resume, and every rank exits with status 0 — so that
torchrun, when it was not signalled itself (one rank signalled, or a launcher that forwards the
signal to the workers only), ends quietly instead of listing every rank as failed.

Repeated signals (torchrun forwards the Ctrl-C its workers already got) are noted, not acted on;
torchrun kills workers that outlast its shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by
default; the launch scripts raise it). Testing hook: ``MILES_FAULT_SIGNAL=RANK:ROLLOUT`` makes that
rank send itself SIGTERM in the middle of that rollout (at its second micro-batch).
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(Exception):
    """Raised at a safe point inside a rollout: every rank abandons it together."""


class GracefulStop:
    """Install with ``with GracefulStop() as stop:``; the previous handlers come back on exit."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self.signum = 0  # the first signal this rank received (0: none)
        self.agreed = 0  # the signal the ranks agreed to stop for (0: none yet)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        # os.write, not print: a handler may interrupt a print on the same stream.
        if self.signum == 0:
            self.signum = signum
            if _rank() == 0:
                os.write(
                    2,
                    f"[miles] {signal.Signals(signum).name} received: stopping at the next safe point "
                    "and saving a checkpoint (this can take a while; SIGKILL aborts without saving)\n".encode(),
                )

    def requested(self) -> bool:
        """Collective over the default group: whether any rank was signalled (then all stop)."""
        if self.agreed:
            return True
        flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed = int(flag.item())
        return bool(self.agreed)

    @property
    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else ""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def maybe_inject_signal(rank: int, rollout_index: int, micro_batch: int) -> None:
    """Testing hook ``MILES_FAULT_SIGNAL=RANK:ROLLOUT``: SIGTERM this rank at micro-batch 1 of that rollout."""
    spec = os.environ.get("MILES_FAULT_SIGNAL")
    if spec and micro_batch == 1 and spec == f"{rank}:{rollout_index}":
        os.kill(os.getpid(), signal.SIGTERM)
