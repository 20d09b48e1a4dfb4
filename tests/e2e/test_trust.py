"""Trust through the real launcher (torchrun, one process, the tiny recipe cut to its smallest):

0. The first launch (wandb offline) warns that prompts exceed ``data.max_sequence_length`` (as the
   dry run does) and ends with the one-line result, after wandb's own lines.

0b. A relaunch of the finished run prints that it is finished and exits 0 before anything is built
   (no "resumed from" line, no new wandb run).

1. A launch saves ``step_000001`` and ``step_000002``; 16 bytes of ``step_000002``'s shard are then
   changed in place (same length: the old size check passes it). The relaunch names the file, says it
   tries the previous one and resumes from ``step_000001`` — it never trains on the changed bytes.
2. While that relaunch runs (it holds the run directory), a third launch into the same directory is
   refused with exit code != 0, naming the holder's pid and host, before it loads a model.

Three launches, about 60 s on 2 cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--data.prompts-per-rank", "1", "--data.group-size", "2", "--train.micro-batch-size", "2",
    "--train.steps-per-rollout", "1", "--rollout.num-steps", "2", "--train.checkpoint-every", "1",
    "--train.no-export", "--run.wandb-mode", "disabled", "--run.no-progress", "--model.tiny-variant", "single_expert",
    "--data.max-sequence-length", "8",
]  # fmt: skip


def _cmd(root: Path, *flags: str, launcher: str = "torch.distributed.run") -> list[str]:
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "0", "train_grpo.py", "--config", "configs/tiny_cpu.yaml"]
    return cmd + ["--run.output-dir", str(root), "--run.name", "trust", *SMALL, *flags]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_changed_bytes_fall_back_and_a_second_launch_is_refused(tmp_path):
    # wandb offline (the make targets' mode): its closing lines come before the result line
    first = subprocess.run(
        _cmd(tmp_path, "--train.num-rollouts", "2", "--run.wandb-mode", "offline"),
        cwd=REPO,
        env={**ENV, "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert first.returncode == 0, first.stdout
    log = first.stdout
    # Prompts longer than max_sequence_length are warned about by the real run, as by the dry run.
    assert "prompts in " in log and "are longer than data.max_sequence_length = 8 text tokens" in log, log
    # The last line states the result: last of everything printed, wandb's lines included (issue 46).
    run_dir = tmp_path / "trust"
    closing = f"[miles] finished {run_dir}: 2 rollouts, 2 steps; reward mean "
    assert first.stdout.strip().splitlines()[-1].startswith(closing), first.stdout[-3000:]
    assert "Run summary" not in log and "Run history" not in log, log[-3000:]
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_000002'}" in log
    # A relaunch of the finished run says so before building anything: no model, no wandb run.
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    again = subprocess.run(
        _cmd(tmp_path, "--train.num-rollouts", "2", "--run.wandb-mode", "offline"),
        cwd=REPO, env={**ENV, "WANDB_MODE": "offline"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout
    assert again.stdout.strip().splitlines()[-1].startswith(f"[miles] {run_dir} is finished (2 of 2 rollouts")
    assert "[miles] resumed from" not in again.stdout and "wandb" not in again.stdout, again.stdout
    assert sorted((run_dir / "wandb").glob("offline-run-*")) == wandb_runs and wandb_runs
    ckpts = tmp_path / "trust" / "checkpoints"
    shard = ckpts / "step_000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[256:272] = data[256:272][::-1]
    shard.write_bytes(bytes(data))

    second = subprocess.Popen(
        _cmd(tmp_path, "--train.num-rollouts", "1000"),
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    timer = threading.Timer(400, os.killpg, (second.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        for line in second.stdout:
            lines.append(line)
            if "[miles] resumed from" in line:
                break
        third = subprocess.run(  # through miles.launch: one line and exit code 2 (issue 46)
            _cmd(tmp_path, "--train.num-rollouts", "3", launcher="miles.launch"),
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
        timer.cancel()
    out = "".join(lines)
    assert (
        f"the checkpoint {ckpts / 'step_000002'} is corrupt: its file __0_0.distcp does not match" in out
    ), out
    assert f"[miles] resumed from {ckpts / 'step_000001'} (step 1," in out, out
    refused = " ".join((third.stdout + third.stderr).split())
    assert third.returncode == 2, refused
    assert "Traceback" not in third.stderr and "ChildFailedError" not in third.stderr, third.stderr
    assert [line for line in third.stderr.splitlines() if line.startswith("error")] == [
        third.stderr.strip().splitlines()[-1]
    ], third.stderr  # the refusal is the one error line, and the last
    assert (
        f"is in use by another launch (pid {second.pid}" not in refused
    )  # torchrun's pid is not the worker's
    assert f"the run directory {tmp_path / 'trust'} is in use by another launch (pid " in refused, refused
    assert f"on host {socket.gethostname()}" in refused and "--run.name NEW_NAME" in refused
    print(refused)
    assert "[rollout" not in refused and "[miles] loaded" not in refused  # refused before any work
