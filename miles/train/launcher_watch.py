"""A rank whose launcher died stops, instead of training on as an orphan.

torchrun starts its workers in sessions of their own (``start_new_session``), so a scheduler that
kills torchrun's process group (``kill -9 -PGID``) kills torchrun alone: its workers would train on to
the end, holding the run directory's lock, with no one to restart or stop them. Each rank launched by
torchrun therefore watches its parent (:func:`watch_launcher`, a daemon thread polling
``os.getppid()`` each second; ``prctl(PR_SET_PDEATHSIG)`` is not used: it fires when the *thread*
that started the worker ends, which need not be the launcher's end). When the parent changes (the
process was re-parented: the launcher is gone), the rank does what torchrun would have done on its
way out: it sends itself SIGTERM — the graceful stop (``miles/train/stop.py``: the ranks agree at the
next safe point, save a checkpoint and exit 0; while loading, SIGTERM ends the process) — and, if
it still runs ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (torchrun's own grace, 30 s by
default), SIGKILL. A process not launched by torchrun (``python train_grpo.py``) is not watched: its
parent is a shell, whose end (a closed terminal under ``nohup``) is not a reason to stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["watch_launcher"]

_THREAD: threading.Thread | None = None


def _grace_s() -> float:
    try:
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    except ValueError:
        return 30.0


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    grace = _grace_s()
    print(
        f"[miles] rank {os.environ.get('RANK', '?')}: its launcher (pid {parent}) is gone; stopping: SIGTERM "
        f"to itself (a checkpoint at the next safe point), SIGKILL after {grace:g} s",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_launcher(poll_s: float = 1.0) -> threading.Thread | None:
    """Under torchrun (``$TORCHELASTIC_RUN_ID``), start watching the launcher; returns the thread
    (None: not launched by torchrun, or already orphaned at the start)."""
    global _THREAD
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ or parent == 1:
        return None
    if _THREAD is None or not _THREAD.is_alive():  # one per process (a second Trainer reuses it)
        _THREAD = threading.Thread(
            target=_watch, args=(parent, poll_s), name="miles-launcher-watch", daemon=True
        )
        _THREAD.start()
    return _THREAD
