"""torchrun, with a refusal ending in one line and its own exit code:

    python -m miles.launch --nproc-per-node 4 train_grpo.py --config configs/tiny_cpu.yaml ...

takes torchrun's arguments unchanged and runs torchrun's own launcher (``torch.distributed.run``).
Plain ``torchrun`` turns any nonzero worker exit into a ``ChildFailedError`` traceback of ~50 lines
and exit code 1: a busy run directory, a resume the checkpoint does not fit, bad input (the workers'
exit code 2, their one-line message already printed) and a Ctrl-C (torchrun's ``SignalException``)
all read like a crash. Here a worker's exit code 2 (a refusal) or 130 (interrupted) becomes the
launcher's exit code with nothing added, and a signal to the launcher itself (Ctrl-C, a scheduler's
SIGTERM) ends it with 128 + the signal once the workers have stopped (they save a checkpoint and
print how to resume first: miles/train/stop.py). Anything else — a rank killed, out of memory, a
crash — is reported as torchrun reports it (its log lines and the failure table), with the worker's
exit code.

The launcher also puts the command as typed in ``MILES_LAUNCH_COMMAND``, so that the resume command
a run prints starts as the user's did (:func:`launch_prefix`; under plain torchrun it is read from
the parent process's command line). A launch script that runs the launcher for the user
(``launch/single_node.sh``, ``launch/multi_node.sh``, ``launch/slurm.sbatch``) puts its own command
in ``MILES_LAUNCH_WRAPPER`` (the words before the training script's flags, shell-quoted): the resume
command then starts with it, since that is what the user typed (and, on a multi-node run, what every
node runs).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from pathlib import Path

# Worker exit codes that are an answer, not a failure: 2, a refusal (bad input, a busy run
# directory, a checkpoint that does not fit) whose message the worker printed; 130, interrupted.
QUIET_EXIT_CODES = (2, 130)
LAUNCH_COMMAND_ENV = "MILES_LAUNCH_COMMAND"
WRAPPER_ENV = "MILES_LAUNCH_WRAPPER"


class _Held(logging.Handler):
    """Keeps torchrun's elastic-agent log records; they are shown only for a real failure."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def replay(self) -> None:
        out = logging.StreamHandler(sys.stderr)
        out.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
        for record in self.records:
            out.handle(record)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = sys.argv[1:] if argv is None else argv
    os.environ[LAUNCH_COMMAND_ENV] = shlex.join(["python", "-m", "miles.launch", *argv])
    held = _Held()
    agent_log = logging.getLogger("torch.distributed.elastic")
    agent_log.addHandler(held)
    agent_log.propagate = False
    try:
        run(parse_args(argv))
        held.replay()  # a success: what the agent said (restarts under --max-restarts) is shown
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode in QUIET_EXIT_CODES:
            return failure.exitcode
        held.replay()
        print(e.format_msg(), file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as e:
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        agent_log.removeHandler(held)
        agent_log.propagate = True
    return 0


def _parent_command(cmdline: Path | None = None) -> list[str] | None:
    """The torchrun command line of this process's parent (``cmdline``: its /proc file), or None
    when the parent is not torchrun."""
    try:
        raw = (cmdline or Path(f"/proc/{os.getppid()}/cmdline")).read_bytes()
    except OSError:
        return None
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    # ``python /path/to/torchrun ...`` (a console script runs through its interpreter)
    if len(words) > 1 and Path(words[0]).name.startswith("python") and Path(words[1]).name == "torchrun":
        words = words[1:]
    if not words:
        return None
    head = Path(words[0])
    if head.name == "torchrun" and len(words) > 1:
        words[0] = _as_typed(head)
    elif words[1:3] == ["-m", "torch.distributed.run"]:
        words[0] = "python"
    else:
        return None
    return words


def _as_typed(path: Path) -> str:
    """``torchrun`` when that is the one on PATH; else the path, relative to here if under here."""
    import shutil

    found = shutil.which("torchrun")
    if found and Path(found).resolve() == path.resolve():
        return "torchrun"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def launch_prefix(script_argv: list[str]) -> list[str]:
    """The words of the command as typed, up to and including the training script: a launch script's
    (``MILES_LAUNCH_WRAPPER``: ``launch/multi_node.sh``, which takes the script's flags), the
    launcher's (``MILES_LAUNCH_COMMAND``, set by :func:`main`), or torchrun's as read from the parent
    process when this is a torchrun worker, or ``script_argv[0]`` alone (a single-process run)."""
    script = script_argv[0] if script_argv else "train_grpo.py"
    if wrapper := shlex.split(os.environ.get(WRAPPER_ENV, "")):
        return wrapper
    typed = os.environ.get(LAUNCH_COMMAND_ENV)
    words = shlex.split(typed) if typed else None
    if words is None and os.environ.get("TORCHELASTIC_RUN_ID"):
        words = _parent_command()
    if not words:
        return ["python", script]
    name = Path(script).name
    for i, word in enumerate(words):
        if Path(word).name == name:
            return words[: i + 1]
    return ["python", script]


if __name__ == "__main__":
    sys.exit(main())
