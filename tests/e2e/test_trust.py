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
3. Secrets: the first launch gets the reward service token on the command line and in the environment
   (``$MILES_REWARD_TOKEN``) and logs to wandb offline; no file under the run directory holds either
   (``.launch.lock``, ``config.yaml``, metrics, checkpoints, wandb's run files).
4. Orphans: torchrun's process group of the second launch is then SIGKILLed, as a scheduler may. The
   worker (its own session) notices its launcher is gone, stops at the next safe point with a
   checkpoint and exits, within torchrun's shutdown grace, instead of training on.
5. The prompt file's sha256 is saved in ``trainer.json``; edited after the runs, the dry run refuses to
   resume (exit 2, naming the file).

Three launches and a dry run, about 70 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
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
    cmd += ["--run.output-dir", str(root), "--run.name", "trust", *SMALL]
    return cmd + ["--data.prompt-file", str(root / "prompts.txt"), *flags]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CLI_TOKEN, ENV_TOKEN = "cli-secret-7d41e9", "env-secret-0b86c2"


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.killpg(pid, signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for a non-reaping init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _no_secrets_under(run_dir: Path) -> None:
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files) and (run_dir / ".launch.lock").is_file(), files
    for path in files:
        data = path.read_bytes()
        for secret in (CLI_TOKEN, ENV_TOKEN):
            assert secret.encode() not in data, f"{secret} is written in {path}"


def test_changed_bytes_fall_back_and_a_second_launch_is_refused(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text((REPO / "miles" / "data" / "tiny_prompts.txt").read_text())
    # wandb offline (the make targets' mode): its closing lines come before the result line; the
    # reward service token given on the command line and in the environment (no file may hold it)
    first = subprocess.run(
        _cmd(
            tmp_path,
            "--train.num-rollouts",
            "2",
            "--run.wandb-mode",
            "offline",
            "--reward.remote.token",
            CLI_TOKEN,
        ),
        cwd=REPO,
        env={**ENV, "WANDB_MODE": "offline", "MILES_REWARD_TOKEN": ENV_TOKEN},
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
    _no_secrets_under(run_dir)
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
    saved = json.loads((ckpts / "step_000002" / "trainer.json").read_text())["prompt_fingerprint"]
    assert saved == {"file": str(prompts), "sha256": hashlib.sha256(prompts.read_bytes()).hexdigest()}
    shard = ckpts / "step_000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[256:272] = data[256:272][::-1]
    shard.write_bytes(bytes(data))

    second = subprocess.Popen(
        _cmd(tmp_path, "--train.num-rollouts", "1000"),
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    timer = threading.Timer(400, _kill_group, (second.pid,))
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
        # A scheduler kills torchrun's process group: the worker (in its own session) must stop.
        worker = json.loads((run_dir / ".launch.lock").read_text())["pid"]
        assert worker != second.pid and _pid_alive(worker)
        _kill_group(second.pid)
        second.wait()
        killed_at = time.monotonic()
        reaper = threading.Timer(90, _kill_group, (worker,))  # an orphan that trains on
        reaper.start()
        rest = second.stdout.read()  # until the worker, the pipe's last writer, has exited
        reaper.cancel()
        while _pid_alive(worker) and time.monotonic() < killed_at + 5:
            time.sleep(0.2)
        stopped_after = time.monotonic() - killed_at
    finally:
        _kill_group(second.pid)
        second.wait()
        timer.cancel()
        if "worker" in locals() and _pid_alive(worker):
            _kill_group(worker)  # its own session: the orphan and anything it started
    assert stopped_after < 60 and not _pid_alive(worker), (stopped_after, rest)
    assert "its launcher (pid" in rest and "is gone; stopping" in rest, rest
    assert "[miles] SIGTERM received" in rest, rest
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

    # The prompt file edited after the checkpoints: the dry run refuses to resume, naming it.
    prompts.write_text(prompts.read_text().replace("a", "o", 1))
    dry = subprocess.run(
        [sys.executable, "train_grpo.py", "--config", "configs/tiny_cpu.yaml", "--run.output-dir", str(tmp_path)]
        + ["--run.name", "trust", *SMALL, "--data.prompt-file", str(prompts), "--dry-run"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert f"the prompt file {prompts} changed since the checkpoint was saved" in dry.stderr, dry.stderr
