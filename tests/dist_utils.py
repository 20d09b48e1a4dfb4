"""Run a function on several CPU processes over gloo, for multi-rank tests.

Usage in a test:

    def _body(rank, world_size, arg):
        ...  # torch.distributed is initialised (gloo); raise AssertionError to fail

    def test_x():
        run_distributed(_body, 4, arg)

The body must be a module-level function (it is pickled for spawn). Failures on any
rank are re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
                print(f"ignored a crash after every rank had passed: {e}")
                return
            raise AssertionError(f"a rank died: {e}") from e
