"""The launcher (issue 46): a refusal under torchrun is the worker's one line and exit code 2.

- ``python -m miles.launch`` (torchrun's arguments): a worker's exit code 2 comes back as the
  launcher's, with nothing after the worker's own message (plain torchrun adds a ``ChildFailedError``
  traceback and exits 1); a real failure (exit code 3 here) is still reported as torchrun reports it.
- The resume command starts as the user typed the launch: the launcher's command, or torchrun's read
  from the parent's command line; ``python train_grpo.py`` for one process.
- One process without torchrun binds a free port, not the fixed 29511 (EADDRINUSE when taken).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles import launch

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

WORKER = """
import os, sys
print("error: refused, change X" if os.environ["RANK"] == "0" else "", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [2, 3])
def test_the_launcher_passes_a_refusal_through_quietly(tmp_path, code):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "miles.launch",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(worker),
        str(code),
    ]
    got = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert got.returncode == code, got.stderr
    if code == 2:  # a refusal: the worker's line, and nothing of torchrun's
        assert got.stderr.strip().splitlines() == ["error: refused, change X"], got.stderr
    else:  # a failure: torchrun's report, without its traceback through the launcher's frames
        assert "Root Cause" in got.stderr and "exitcode  : 3" in got.stderr, got.stderr
        assert "Traceback" not in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("parent", "want"),
    [
        (["/usr/bin/python3", "/x/.venv/bin/torchrun", "--nproc-per-node", "4", "train_grpo.py", "--a", "b"],
         ["/x/.venv/bin/torchrun", "--nproc-per-node", "4", "train_grpo.py"]),
        (["/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "/r/train_grpo.py", "--a"],
         ["python", "-m", "torch.distributed.run", "--standalone", "/r/train_grpo.py"]),
        (["/bin/bash", "run.sh"], ["python", "train_grpo.py"]),
    ],
)  # fmt: skip
def test_the_resume_prefix_is_the_parent_torchrun_as_typed(tmp_path, monkeypatch, parent, want):
    proc = tmp_path / "cmdline"
    proc.write_bytes(b"\0".join(w.encode() for w in parent) + b"\0")
    monkeypatch.delenv(launch.LAUNCH_COMMAND_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    read = launch._parent_command
    monkeypatch.setattr(launch, "_parent_command", lambda: read(proc))
    assert launch.launch_prefix(["train_grpo.py"]) == want


def test_the_resume_command_is_the_launch_as_typed(monkeypatch):
    from miles.train.outcome import resume_command

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(launch.LAUNCH_COMMAND_ENV, raising=False)
    assert (
        resume_command(["--config", "c.yaml", "--train.overwrite"]) == "python train_grpo.py --config c.yaml"
    )
    monkeypatch.setenv(
        launch.LAUNCH_COMMAND_ENV, "python -m miles.launch --nproc-per-node 4 train_grpo.py --x"
    )
    assert resume_command(["--config", "c y.yaml", "--train.no-resume"]) == (
        "python -m miles.launch --nproc-per-node 4 train_grpo.py --config 'c y.yaml'"
    )


CHECK_PORT = """
import socket, torch, torch.distributed as dist
from miles.train.runtime import init_distributed
held = socket.socket()
held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    held.bind(("127.0.0.1", 29511)); held.listen()
except OSError:
    pass  # taken by someone else already: the case itself
init_distributed(60.0)
t = torch.ones(2); dist.all_reduce(t); print("ok", t.tolist())
"""


def test_one_process_takes_a_free_port(tmp_path):
    env = {k: v for k, v in ENV.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK")}
    got = subprocess.run(
        [sys.executable, "-c", CHECK_PORT], env=env, capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0 and "ok [1.0, 1.0]" in got.stdout, got.stderr[-2000:]


@pytest.mark.parametrize(
    "typed",
    [["--reward.remote.token", "s3cr3t-tok"], ["--reward.remote.token=s3cr3t-tok"]],
)
def test_the_resume_command_never_shows_the_reward_token(monkeypatch, tmp_path, typed):
    """Issue 46: the console's resume hint printed the reward server's token typed on the command
    line. The flag is left out, the hint says how to give the token again, and the rest is as typed."""
    from miles.rewards.remote import TOKEN_ENV
    from miles.train.outcome import resume_command, stopped_line
    from miles.train.reward_failure import reward_failed

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(launch.LAUNCH_COMMAND_ENV, "python -m miles.launch --nproc-per-node 2 train_grpo.py")
    argv = ["--config", "c.yaml", *typed, "--reward.weights.sharpness", "1"]
    hint = resume_command(argv)
    assert "s3cr3t" not in hint
    assert hint.startswith(
        "python -m miles.launch --nproc-per-node 2 train_grpo.py --config c.yaml --reward.weights.sharpness 1 "
    )
    assert f"export {TOKEN_ENV}=<token>" in hint and "--reward.remote.token <token>" in hint
    monkeypatch.setattr("sys.argv", ["train_grpo.py", *argv])
    for line in (
        stopped_line(tmp_path, "SIGTERM", 3, 1, 5, argv),
        str(reward_failed("connection refused", 3, None)),
    ):
        assert "s3cr3t" not in line and f"export {TOKEN_ENV}=<token>" in line
    # a token from the environment, typed into another flag by the shell, is hidden too
    monkeypatch.setenv(TOKEN_ENV, "envtok-123")
    assert "envtok-123" not in resume_command(["--config", "c.yaml", "--run.name", "x-envtok-123"])
    # without a secret the hint is the command alone
    assert resume_command(["--config", "c.yaml"]).endswith("train_grpo.py --config c.yaml")
