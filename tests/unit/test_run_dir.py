"""The run-directory policy (``miles.train.run_dir``): what a launch may do with a previous run."""

from pathlib import Path

import pytest

from miles.config import Config, ConfigError, TrainConfig
from miles.train.run_dir import RUN_OUTPUTS, check_run_dir, clear_run_dir, previous_run


def _previous(run_dir):
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "export").mkdir()
    (run_dir / "notes.txt").write_text("the user's own file")


def test_fresh_or_empty_directories_are_fine(tmp_path):
    check_run_dir(tmp_path / "new", resume=False, overwrite=False)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    assert previous_run(tmp_path / "empty") == []
    check_run_dir(tmp_path / "empty", resume=False, overwrite=False)


def test_no_resume_refuses_a_previous_run_naming_the_ways_out(tmp_path):
    _previous(tmp_path)
    with pytest.raises(ValueError, match="holds a previous run") as e:
        check_run_dir(tmp_path, resume=False, overwrite=False)
    for part in (
        "checkpoints step_000004",
        "metrics.jsonl with 2 rows",
        "export/",
        "--run.name",
        "--train.overwrite",
    ):
        assert part in str(e.value)
    check_run_dir(tmp_path, resume=True, overwrite=False)  # resuming it is fine
    check_run_dir(tmp_path, resume=False, overwrite=True)


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    _previous(tmp_path)
    assert clear_run_dir(tmp_path) == ["checkpoints", "metrics.jsonl", "export"]
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert set(RUN_OUTPUTS) >= {"checkpoints", "metrics.jsonl", "export", "samples", "wandb"}


def test_a_file_as_run_directory_is_refused(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        check_run_dir(tmp_path / "run", resume=True, overwrite=False)


def test_overwrite_needs_no_resume():
    with pytest.raises(ConfigError, match="needs --train.no-resume"):
        Config(train=TrainConfig(overwrite=True))
    Config(train=TrainConfig(overwrite=True, resume=False))


def test_every_launch_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """The first launch writes its wandb run id into the run directory; a resume reads it back."""
    from miles.train.logging import WANDB_ID_FILE, MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for _ in range(2):
        logger = MetricsLogger(tmp_path, {}, mode="offline", project="miles", name="x", enabled=True)
        ids.append(logger._wandb.id)
        logger.close()
    assert ids[0] == ids[1] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert WANDB_ID_FILE in RUN_OUTPUTS  # --train.overwrite starts a new wandb run


def test_a_read_only_run_directory_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """os.access decides (root passes permission bits, so the read-only answer is simulated)."""
    import os

    run_dir = tmp_path / "runs" / "ro"
    check_run_dir(run_dir, resume=True, overwrite=False)  # writable: fine
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(
        ValueError, match=rf"{tmp_path} is not writable .* set --run.output-dir to a writable"
    ):
        check_run_dir(run_dir, resume=True, overwrite=False)  # not created yet: its nearest parent decides
    (run_dir / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "checkpoints")
    with pytest.raises(ValueError, match="checkpoints is not writable"):
        check_run_dir(run_dir, resume=True, overwrite=False)


_HOLD = """
import sys
from miles.train.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # hold until the test closes stdin (or kills this process)
"""


def test_one_launch_per_run_directory_and_a_dead_holder_frees_it(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys

    from miles.train.run_dir import LOCK_NAME, RunDirLock, lock_run_dir

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        named = rf"in use by another launch \(pid {holder.pid} on host {socket.gethostname()}, started "
        with pytest.raises(ValueError, match=named):
            check_run_dir(run_dir, resume=True, overwrite=False)  # the early probe (every rank, dry run)
        with pytest.raises(ValueError, match=named + r".*--run.name NEW_NAME"):
            lock_run_dir(run_dir)  # the real acquisition
    finally:
        holder.send_signal(signal.SIGKILL)  # a launch that dies without cleaning up
        holder.wait()
    assert (run_dir / LOCK_NAME).is_file()  # its file stays, naming a dead pid: not a lock
    check_run_dir(run_dir, resume=True, overwrite=False)
    lock = RunDirLock(run_dir)
    assert f'"pid": {os.getpid()}' in (run_dir / LOCK_NAME).read_text()
    assert lock_run_dir(run_dir) is lock  # this process's own lock is reused (a second Trainer in tests)
    lock.release()
