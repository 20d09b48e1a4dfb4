"""The process's runtime: torch.distributed from torchrun's environment, crash traces, deterministic
kernels, peak memory."""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from miles.parallel.gloo import one_worker_per_gloo_group
from miles.train.launcher_watch import watch_launcher

__all__ = ["deterministic_kernels", "enable_crash_traces", "init_distributed", "peak_memory_gib"]


def init_distributed(timeout_s: float) -> torch.device:
    """Initialise torch.distributed from torchrun's environment (a single process works too). Under
    torchrun, the rank stops if its launcher dies (:mod:`miles.train.launcher_watch`)."""
    enable_crash_traces()
    watch_launcher()
    # Before CUDA starts: the rollout's gathered expert and training's activations take turns with
    # the memory, and fixed-size segments fragmented it (A14B rehearsal: 60.5 GiB allocated, 83.6
    # reserved). A user's own PYTORCH_CUDA_ALLOC_CONF wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    one_worker_per_gloo_group()  # before the first gloo group: torch's two workers race (issue 46)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_PORT" in os.environ or os.environ["WORLD_SIZE"] != "1":
            # a port given alone means this host (torchrun sets both)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend, timeout=timeout)  # torchrun's rendezvous
        else:
            # One process without torchrun: a store on a port the OS picks (bound, not guessed), so
            # that runs side by side do not collide on a fixed port (EADDRINUSE).
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def enable_crash_traces() -> None:
    """Every thread's Python stack on stderr when this rank dies by a fatal signal (SIGSEGV, SIGABRT,
    SIGBUS, SIGFPE, SIGILL), before the signal's default action: a native abort (glibc's heap checks,
    a C++ ``terminate``) in one rank of a torchrun launch then names where each thread was, where
    torchrun alone reports only the exit code. A no-op when already enabled (``PYTHONFAULTHANDLER``)."""
    if faulthandler.is_enabled():
        return
    try:  # the process's own stderr (fd 2), also where a test has replaced sys.stderr
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no stderr with a file descriptor: nothing to write to
        pass


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def deterministic_kernels() -> None:
    """``parallel.deterministic_mode``: deterministic cuBLAS and torch kernels, and compiled blocks
    without kernel choice by on-device timing (which can differ run to run)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True


def maybe_inject_fault(rank: int, step: int) -> None:
    """Testing hook: ``MILES_FAULT_KILL=RANK:STEP`` SIGKILLs that rank in the middle of that
    optimizer step (after its backward, before the update), as a dying machine would."""
    spec = os.environ.get("MILES_FAULT_KILL")
    if spec and spec == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
