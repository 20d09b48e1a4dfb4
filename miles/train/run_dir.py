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
command, with secrets redacted: :mod:`miles.train.redact`) for the refusal of a second launch.
:func:`check_run_dir` also probes the lock (rank 0; the plan shares its answer with every rank), so
a second launch is refused at once, before it loads a model; the trainer takes the lock right after
the plan, before the model loads, so two launches that passed their probes at the same moment are
refused there (exit 2). A lock file that cannot be used (a directory in its place, no permission, a
full disk) is a refusal naming the fix, never a raw ``OSError``.

A run writes only inside ``run.output_dir``: the run directory and what the run writes into it (its
outputs and the lock) must not be symbolic links (:func:`check_no_links`), which would send the writes
(and ``--train.overwrite``'s deletions) elsewhere. ``run.output_dir`` itself may be a link (a folder
on another disk): it is the user's choice of where runs go.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from miles.files import check_writable
from miles.train.redact import redact_argv

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


# What the run writes into its directory, links of which are refused (they lead outside run.output_dir).
WRITTEN = (*RUN_OUTPUTS, "eval.jsonl", LOCK_NAME)


def check_no_links(run_dir: Path, output_dir: Path | None = None) -> None:
    """Raise ``ValueError`` when the run directory (or a folder between ``output_dir`` and it), or
    anything the run writes into it, is a symbolic link: the run's writes, and ``--train.overwrite``'s
    deletions, would land outside ``run.output_dir``."""
    run_dir = Path(run_dir)
    steps = [run_dir]
    if output_dir is not None and run_dir.is_relative_to(output_dir):
        parts = run_dir.relative_to(output_dir).parts
        steps = [Path(output_dir, *parts[: i + 1]) for i in range(len(parts))]
    steps += [run_dir / name for name in WRITTEN]
    for path in steps:
        if path.is_symlink():
            where = os.path.realpath(path)
            raise ValueError(
                f"{path} is a symbolic link (to {where}): the run would write outside run.output_dir "
                f"{output_dir or run_dir.parent} through it. Remove the link, or set --run.output-dir to "
                "the folder you mean the run to write into"
            )


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool, output_dir: Path | None = None) -> None:
    """Raise ``ValueError`` unless this launch may use ``run_dir`` as configured (``output_dir``: the
    folder that holds it, ``run.output_dir``: no link between it and the run directory)."""
    check_no_links(run_dir, output_dir)
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
    if lock.is_dir():
        raise _lock_error(lock, IsADirectoryError(21, "Is a directory", str(lock)))
    try:
        fd = os.open(lock, os.O_RDWR)  # as the lock opens it: a file this launch cannot write is refused now
    except FileNotFoundError:
        return  # no lock file: no launch has held this directory
    except OSError as e:
        raise _lock_error(lock, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use_error(Path(run_dir)) from None
    finally:
        os.close(fd)  # closing drops the probe's shared lock


def _lock_error(lock: Path, error: OSError) -> ValueError:
    """A lock file that cannot be used, as a refusal naming the fix."""
    reason = error.strerror or type(error).__name__
    if isinstance(error, IsADirectoryError) or lock.is_dir():
        fix = f"it is a directory, not the run's lock file: remove it (rmdir {lock})"
    elif error.errno == errno.ENOSPC:
        fix = "free space on that disk, or set --run.output-dir to a folder on a disk with room"
    elif isinstance(error, PermissionError) or error.errno == errno.EROFS:
        fix = f"make it writable for this user (chmod u+rw {lock}) or remove it"
    else:
        fix = "fix or remove it"
    return ValueError(
        f"the run directory's lock file {lock} cannot be used ({reason}): {fix}; or start this run in its "
        "own directory (--run.name NEW_NAME)"
    )


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.launch.lock`` for this process's lifetime (or
    :meth:`release`); raises ``ValueError`` naming the holder when another live process has it, or
    naming the fix when the file cannot be used. ``secrets``: values hidden in the recorded command."""

    def __init__(self, run_dir: Path, secrets: Sequence[str] = ()):
        run_dir = Path(run_dir)
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = None
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise _in_use_error(run_dir) from None
        except OSError as e:
            self.release()
            raise _lock_error(self.path, e) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        argv = redact_argv([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]], secrets)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": started,
            "command": " ".join(argv),
        }
        try:
            os.ftruncate(self.fd, 0)  # the file stays (unlinking a lock file races with its next taker)
            os.pwrite(self.fd, json.dumps(info).encode(), 0)
        except OSError as e:
            self.release()
            raise _lock_error(self.path, e) from None
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


def lock_run_dir(run_dir: Path, secrets: Sequence[str] = ()) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock; every rank raises the same ``ValueError`` when another
    launch holds it or it cannot be taken (collective under torch.distributed). Returns the lock on
    rank 0, else None. ``secrets``: values kept out of the command the lock file records."""
    distributed = dist.is_available() and dist.is_initialized()
    lock, error = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            lock = _held(Path(run_dir) / LOCK_NAME) or RunDirLock(run_dir, secrets)
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
