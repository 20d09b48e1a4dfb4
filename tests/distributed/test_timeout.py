"""A collective that cannot complete ends the job within ``run.collective_timeout_s``, with a message.

Two gloo ranks initialised by the trainer's own ``init_distributed(timeout_s=3)``: rank 1 sleeps
past the timeout while rank 0 all-reduces. Rank 0 must raise within ~3-15 s, and
``train_grpo.main`` must turn that error into a message that names the setting and the way to
resume. (A rank that dies outright is the launcher's business: torchrun with ``--max-restarts 0``
tears the others down; ``tests/e2e/test_resume.py`` asserts that the killed launch exits promptly.)
About 15 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import free_port, run_distributed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0
SLEEP_S = 8.0  # rank 1's stall: well past the timeout, short enough for the test


def _reinit(port: int, timeout_s: float) -> None:
    """Replace run_distributed's process group by one from the trainer's init_distributed."""
    from miles.train.trainer import init_distributed

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(timeout_s=timeout_s)


def _stalled_all_reduce(rank: int) -> tuple[float, str]:
    """Rank 1 stalls; rank 0 all-reduces: (seconds until rank 0's error, its message)."""
    if rank == 1:
        time.sleep(SLEEP_S)
        return 0.0, ""
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except (RuntimeError, dist.DistBackendError) as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("the all-reduce completed although rank 1 never joined it")


def _timeout_body(rank, world_size, port):
    _reinit(port, TIMEOUT_S)
    elapsed, message = _stalled_all_reduce(rank)
    if rank == 0:
        assert TIMEOUT_S * 0.9 <= elapsed <= 15.0, f"rank 0 raised after {elapsed:.1f} s"
        assert "timed out" in message.lower() or "timeout" in message.lower(), message


def test_stalled_collective_raises_within_the_timeout():
    run_distributed(_timeout_body, 2, free_port())


class _StalledTrainer:
    """Stands in for Trainer in ``train_grpo.main``: init as the trainer does, then one collective."""

    def __init__(self, cfg):
        from miles.train.trainer import init_distributed

        init_distributed(cfg.run.collective_timeout_s)
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name  # nothing there: not a finished run
        self.rollout_index = self.step = 0

    def train(self):
        elapsed, message = _stalled_all_reduce(dist.get_rank())
        if message:
            raise RuntimeError(message)

    def close(self):
        pass


def _main_body(rank, world_size, port, port_after):
    import miles.train.trainer
    import train_grpo

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    miles.train.trainer.Trainer = _StalledTrainer
    argv = ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.collective-timeout-s", str(TIMEOUT_S)]
    argv += ["--run.output-dir", "/nonexistent/runs", "--run.name", "stalled"]
    stderr = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(stderr):
        try:
            train_grpo.main(argv)
        except RuntimeError:
            raised = True
        else:
            raised = False
    elapsed = time.monotonic() - t0
    if rank == 0:
        assert raised, "the timeout did not end train_grpo.main with an error"
        assert elapsed <= 15.0, f"train_grpo.main ended after {elapsed:.1f} s"
        text = stderr.getvalue()
        assert "run.collective_timeout_s = 3 s" in text and "a rank died or hung" in text, text
        assert "/nonexistent/runs/stalled/checkpoints" in text, text
    # main destroyed its group; run_distributed's worker destroys one on exit.
    os.environ["MASTER_PORT"] = str(port_after)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def test_main_reports_the_timeout_and_how_to_resume():
    run_distributed(_main_body, 2, free_port(), free_port())
