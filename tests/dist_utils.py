"""Run a function on several CPU processes over gloo, for multi-rank tests.

Usage in a test:

    def _body(rank, world_size, arg):
        ...  # torch.distributed is initialised (gloo); raise AssertionError to fail

    def test_x():
        run_distributed(_body, 4, arg)

The body must be a module-level function (it is pickled for spawn). Failures on any
rank are re-raised in the parent with that rank's traceback.

Also the launch helpers' rule for torchrun launches (tests/e2e): a failed launch is retried only
when every rank wrote its "finished" marker (``train_grpo.py`` writes ``rank<R>`` into
``$MILES_FINISHED_DIR`` after its work returned 0), that is, when the failure came after every rank
was done; a launch that died by a signal or an error mid-run fails the test at once. Every retry is
reported as a warning. Random inputs use ``FIXED_SEEDS`` so that a failure reproduces.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seeds of the tests' random inputs: fixed, so a failing case fails again (one per call site).
FIXED_SEEDS = (271828, 314159, 161803, 141421, 173205, 223606, 577215, 662607, 299792)

FINISHED_ENV = "MILES_FINISHED_DIR"


def finished_ranks(marker_dir: str | Path) -> set[int]:
    """The ranks that wrote their "finished" marker into ``marker_dir``."""
    folder = Path(marker_dir)
    return {int(p.name[4:]) for p in folder.glob("rank*")} if folder.is_dir() else set()


def may_retry(returncode: int, marker_dir: str | Path, world_size: int, what: str, output: str) -> bool:
    """Whether a failed launch may be retried: only when every rank had finished (a teardown
    failure). Reports the retry as a warning with the output's tail."""
    if returncode == 0 or finished_ranks(marker_dir) != set(range(world_size)):
        return False
    warnings.warn(
        f"retrying {what}: it exited {returncode} after all {world_size} ranks had finished:\n{output[-1500:]}",
        stacklevel=2,
    )
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, err_dir, fn, args, kwargs):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args, **kwargs)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Every check of the body passed on this rank.
    open(os.path.join(err_dir, f"done{rank}"), "w").close()
    dist.destroy_process_group()
    # As train_grpo.py does: skip interpreter finalization, where gloo's worker threads can abort
    # the process (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, **kwargs) -> None:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args, **kwargs)``."""
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), err_dir, fn, args, kwargs),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as e:
            msgs = [
                open(os.path.join(err_dir, p)).read()
                for p in sorted(os.listdir(err_dir))
                if p.startswith("rank")
            ]
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs)) from e
        except mp.ProcessExitedException as e:
            done = {p for p in os.listdir(err_dir) if p.startswith("done")}
            if len(done) == world_size:
                # Every rank finished the body and its checks; a rank then aborted while tearing
                # down gloo ("terminate called without an active exception", seen rarely on CPU).
                warnings.warn(f"ignored a crash after every rank had passed its checks: {e}", stacklevel=2)
                return
            raise AssertionError(f"a rank died: {e}") from e
