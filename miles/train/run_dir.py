"""What a launch may do with its run directory: resume it, refuse to overwrite it, or replace it.

A run directory that holds a previous run's results (checkpoints, ``metrics.jsonl`` rows, an
export) is resumed with ``train.resume`` (the default). With ``--train.no-resume`` the launch
refuses such a directory, naming it and the ways out — a fresh start would otherwise mix two runs:
its keep-last-K cleanup would delete the new checkpoints (the old run's steps are higher), its
metrics would follow the old ones, its export would overwrite the old one, and the next resume
would restart the old run. ``--train.overwrite`` (with ``--train.no-resume``) deletes what the
previous run wrote and starts afresh. Every rank runs :func:`check_run_dir` (it only reads), so
all of them refuse together before any weights load; rank 0 alone deletes.

One launch per run directory: two launches into one directory would interleave their metrics, share
one wandb run and delete each other's checkpoints. Rank 0 takes an exclusive ``flock`` on
``<run_dir>/.launch.lock`` (:class:`RunDirLock`) after every check has passed and before anything is
written, and holds it for the life of the process; the kernel drops it when the process ends (also by
SIGKILL), so a dead launch's lock is never stale. The file names the holder (pid, host, start time,
command) for the refusal of a second launch. :func:`check_run_dir` also probes the lock (rank 0; the
plan shares its answer with every rank), so a second launch is refused at once, before it loads a
model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from miles.files import check_writable

LOCK_NAME = ".launch.lock"
# Locks this process holds (a second Trainer in one process, as in tests, reuses its own lock).
_HELD: dict[Path, RunDirLock] = {}

# What a run writes into its directory (docs/reliability.md); overwrite removes these only.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "export",
    "samples",
    "eval",
    "wandb",
    "wandb_run_id",
    "config.yaml",
)


def previous_run(run_dir: Path) -> list[str]:
    """The results of a previous run in ``run_dir``, described for a message (empty: none)."""
    found = []
    ckpts = run_dir / "checkpoints"
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) if ckpts.is_dir() else []
    if steps:
        found.append(f"checkpoints {', '.join(steps)}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and (rows := sum(1 for line in metrics.open() if line.strip())):
        found.append(f"metrics.jsonl with {rows} rows")
    if (run_dir / "export").exists():
        found.append("export/")
    return found


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Raise ``ValueError`` unless this launch may use ``run_dir`` as configured."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"the run directory {run_dir} is a file; choose another --run.name or --run.output-dir"
        )
    for parent in run_dir.parents:  # run.output_dir (or a folder above it) is a file: mkdir would fail
        if parent.exists() and not parent.is_dir():
            raise ValueError(
                f"{parent} is a file, so the run directory {run_dir} cannot be created; set "
                "--run.output-dir to a folder (or a path that does not exist yet)"
            )
    check_writable(run_dir)
    check_not_in_use(run_dir)
    if resume or overwrite:
        return
    found = previous_run(run_dir)
    if found:
        raise ValueError(
            f"the run directory {run_dir} holds a previous run ({'; '.join(found)}) and "
            "--train.no-resume would mix a fresh run into it. Either resume it (drop --train.no-resume), "
            "start the new run in its own directory (--run.name NEW_NAME), or replace the previous run "
            "(--train.overwrite deletes its checkpoints, metrics, export, samples, eval and wandb files)"
        )


def _holder(lock: Path) -> str:
    """Who holds the lock file ``lock``, as its holder wrote it."""
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a launch that has not written its name yet"
    return (
        f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}: "
        f"{info.get('command', '?')}"
    )


def _in_use_error(run_dir: Path) -> ValueError:
    return ValueError(
        f"the run directory {run_dir} is in use by another launch ({_holder(run_dir / LOCK_NAME)}). Two "
        "launches into one directory would mix their metrics and checkpoints: wait for it to end (or stop "
        "it: Ctrl-C saves a checkpoint), or start this run in its own directory (--run.name NEW_NAME)"
    )


def check_not_in_use(run_dir: Path) -> None:
    """Raise ``ValueError`` naming the holder when a live launch holds ``run_dir``'s lock (reads only).
    Under torch.distributed rank 0 alone probes (it alone takes the lock; the plan shares its answer):
    another rank would see rank 0's own lock as another launch's once rank 0 has taken it."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    lock = Path(run_dir) / LOCK_NAME
    if _held(lock) is not None:
        return
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: no launch has held this directory
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use_error(Path(run_dir)) from None
    finally:
        os.close(fd)  # closing drops the probe's shared lock


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.launch.lock`` for this process's lifetime (or
    :meth:`release`); raises ``ValueError`` naming the holder when another live process has it."""

    def __init__(self, run_dir: Path):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise _in_use_error(run_dir) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        command = " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "command": command}
        os.ftruncate(self.fd, 0)  # the file stays (unlinking a lock file races with its next taker)
        os.pwrite(self.fd, json.dumps(info).encode(), 0)

        self.pid = os.getpid()
        _HELD[self.path.resolve()] = self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        _HELD.pop(self.path.resolve(), None)


def _held(lock: Path) -> RunDirLock | None:
    """This process's own lock on ``lock`` (not a forked parent's), if it holds one."""
    held = _HELD.get(lock.resolve())
    return held if held is not None and held.pid == os.getpid() and held.fd is not None else None


def lock_run_dir(run_dir: Path) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock; every rank raises the same ``ValueError`` when another
    launch holds it (collective under torch.distributed). Returns the lock on rank 0, else None."""
    distributed = dist.is_available() and dist.is_initialized()
    lock, error = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            lock = _held(Path(run_dir) / LOCK_NAME) or RunDirLock(run_dir)
        except ValueError as e:
            error = str(e)
    if distributed:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error is not None:
        raise ValueError(error)
    return lock


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete what a previous run wrote into ``run_dir`` (rank 0, with ``--train.overwrite``)."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
