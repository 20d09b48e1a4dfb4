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


def test_a_lock_file_that_cannot_be_used_is_a_refusal_naming_the_fix(tmp_path, monkeypatch):
    """A directory in the lock file's place, no permission, a full disk: ``ValueError`` naming the fix,
    from the early probe (every rank, the dry run) and from the acquisition alike, never a raw OSError.
    (Root passes permission bits, and a full disk cannot be made here: those two are simulated.)"""
    import errno
    import os

    from miles.train.run_dir import LOCK_NAME, RunDirLock, check_not_in_use

    run_dir = tmp_path / "run"
    (run_dir / LOCK_NAME).mkdir(parents=True)
    for attempt in (
        lambda: check_run_dir(run_dir, resume=True, overwrite=False),
        lambda: RunDirLock(run_dir),
    ):
        with pytest.raises(ValueError, match=rf"lock file {run_dir / LOCK_NAME} cannot be used .*rmdir"):
            attempt()
    (run_dir / LOCK_NAME).rmdir()

    real_open = os.open

    def no_permission(path, flags, *args):
        if Path(path).name == LOCK_NAME:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    (run_dir / LOCK_NAME).write_text("")
    monkeypatch.setattr(os, "open", no_permission)
    for attempt in (lambda: check_not_in_use(run_dir), lambda: RunDirLock(run_dir)):
        with pytest.raises(ValueError, match=r"\(Permission denied\): make it writable .*chmod u\+rw"):
            attempt()
    monkeypatch.setattr(os, "open", real_open)

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(ValueError, match=r"\(No space left on device\): free space on that disk"):
        RunDirLock(run_dir)
    monkeypatch.undo()
    RunDirLock(run_dir).release()  # nothing was left held by the failed attempts


def test_the_lock_file_records_the_command_without_secrets(tmp_path, monkeypatch):
    """The token given on the command line (either spelling) or in the environment is not recorded."""
    import sys

    from miles.train.redact import secret_values
    from miles.train.run_dir import LOCK_NAME, RunDirLock

    monkeypatch.setenv("MILES_REWARD_TOKEN", "env-token-5f3a")
    argv = [
        "train_grpo.py",
        "--reward.remote.token",
        "cli-token-9c1d",
        "--reward.remote.token=cli-token-9c1d",
    ]
    monkeypatch.setattr(sys, "argv", [*argv, "--note", "x-env-token-5f3a-y"])
    cfg = Config()
    cfg.reward.remote.token = "cli-token-9c1d"
    lock = RunDirLock(tmp_path, secret_values(cfg))
    text = (tmp_path / LOCK_NAME).read_text()
    lock.release()
    assert "cli-token-9c1d" not in text and "env-token-5f3a" not in text, text
    assert "train_grpo.py --reward.remote.token <redacted> --reward.remote.token=<redacted>" in text, text


def test_a_run_directory_reached_through_a_link_is_refused(tmp_path):
    """The run directory, a folder between run.output_dir and it, or what the run writes inside it, as a
    symbolic link would send the writes (and --train.overwrite's deletions) outside run.output_dir.
    run.output_dir itself may be a link (runs on another disk)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "runs"
    out.mkdir()
    (out / "r").symlink_to(elsewhere)
    with pytest.raises(
        ValueError, match=rf"{out / 'r'} is a symbolic link \(to {elsewhere}\).*Remove the link"
    ):
        check_run_dir(out / "r", resume=True, overwrite=False, output_dir=out)
    (out / "group").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=rf"{out / 'group'} is a symbolic link"):
        check_run_dir(out / "group" / "r", resume=True, overwrite=False, output_dir=out)
    (out / "ok").mkdir()
    (out / "ok" / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="checkpoints is a symbolic link"):
        check_run_dir(out / "ok", resume=True, overwrite=False, output_dir=out)
    (tmp_path / "linked_runs").symlink_to(out)  # run.output_dir itself a link: fine
    check_run_dir(
        tmp_path / "linked_runs" / "new", resume=True, overwrite=False, output_dir=tmp_path / "linked_runs"
    )


def test_a_launch_that_passed_its_probe_as_another_took_the_lock_is_refused_before_loading(
    tmp_path, monkeypatch, capsys
):
    """Two launches started within the same second: both probes find the directory free, one takes the
    lock. The other is refused when it takes the lock, right after its plan and before the model loads,
    with exit code 2 (the probe is skipped here to stand for the lost race)."""
    import os
    import socket
    import subprocess
    import sys

    import torch.distributed as dist

    import miles.train.run_dir as run_dir_module
    import train_grpo
    from miles.models.wan_family import WanFamily
    from tests.dist_utils import free_port

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "runs" / "r"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(run_dir_module, "check_not_in_use", lambda run_dir: None)  # the race lost

        def no_load(*args, **kwargs):
            raise AssertionError("the model was loaded")

        monkeypatch.setattr(WanFamily, "load", no_load)
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = [
            "--config",
            "configs/tiny_cpu.yaml",
            "--model.tiny-model-dir",
            str(repo / ".cache" / "tiny-wan"),
        ]
        argv += [
            "--run.output-dir",
            str(tmp_path / "runs"),
            "--run.name",
            "r",
            "--run.wandb-mode",
            "disabled",
        ]
        assert train_grpo.main([*argv, "--run.no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another launch (pid {holder.pid} on host {socket.gethostname()}" in err, err
        assert not dist.is_initialized()
    finally:
        holder.kill()
        holder.wait()


def test_wandb_run_files_hold_no_secret(tmp_path, monkeypatch):
    """wandb keeps sys.argv in its run metadata: it sees the redacted command, the real one is restored."""
    import sys

    from miles.train.logging import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MILES_REWARD_TOKEN", "env-token-77aa")
    argv = ["train_grpo.py", "--reward.remote.token", "cli-token-31bd", "--note=env-token-77aa"]
    monkeypatch.setattr(sys, "argv", argv)
    secrets = ["cli-token-31bd", "env-token-77aa"]
    import wandb

    seen = []
    real_init = wandb.init

    def init(*args, **kwargs):  # what wandb records is sys.argv at its init (its settings' _args)
        seen.append(list(sys.argv))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    logger = MetricsLogger(
        tmp_path, {}, mode="offline", project="miles", name="x", enabled=True, secrets=secrets
    )
    logger.log({"loss": 1.0}, step=1)
    logger.close()
    assert sys.argv == argv
    assert seen == [["train_grpo.py", "--reward.remote.token", "<redacted>", "--note=<redacted>"]]
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files), files
    for path in files:
        assert not any(s.encode() in path.read_bytes() for s in secrets), path
