"""Multi-node launch on one machine: 2 "nodes" x 2 processes through launch/multi_node.sh over gloo.

Each "node" is a separate ``launch/multi_node.sh`` (its default launcher, ``python -m miles.launch``:
torchrun with a c10d rendezvous on a free localhost port), as on a cluster; the run is the real
trainer on the tiny recipe for one rollout, sp 2 = Ulysses 2 inside each node, dp 2 across the
nodes, and a refusal on both nodes ends in one line and exit code 2. The plumbing of the launch
scripts (the command line they build, that miles.launch parses it as torchrun would, Slurm's node
ranks) is checked without torchrun, through stand-ins that print their arguments.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _two_nodes(tmp_path: Path, args: list[str], timeout: float = 240) -> tuple[list[int], list[str]]:
    """Start launch/multi_node.sh twice (node ranks 0 and 1) on localhost through its default
    launcher (miles.launch, this interpreter); their exit codes and logs."""
    port = _free_port()
    common = dict(
        NNODES="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NPROC_PER_NODE="2",
        RDZV_ID=f"test-{uuid.uuid4().hex[:8]}",
        PYTHON=sys.executable,
        # Workers reach rank 0 at this address (not this machine's hostname, which may not resolve).
        TORCHRUN_ARGS="--local-addr 127.0.0.1 --max-restarts 0",
    )
    env = _env(**common)
    env.pop("TORCHRUN", None)
    nodes = []
    for node_rank in (0, 1):
        log = open(tmp_path / f"node{node_rank}.log", "w")
        nodes.append(
            (
                subprocess.Popen(
                    ["bash", str(LAUNCH / "multi_node.sh"), *args],
                    cwd=ROOT,
                    env={**env, "NODE_RANK": str(node_rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    try:
        codes = [proc.wait(timeout=timeout) for proc, _ in nodes]
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return codes, [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]


@pytest.mark.e2e
def test_two_nodes_two_processes_each(tmp_path):
    from miles.models.tiny import tiny_model_path

    tiny_model_path(ROOT / ".cache/tiny-wan", "two_expert")  # build once, before 4 processes look for it
    out_dir = tmp_path / "runs"
    args = [
        "--config",
        "configs/tiny_cpu.yaml",
        "--sequence-parallel-size",
        "2",
        "--ulysses-degree",
        "2",
        "--train.num-rollouts",
        "1",
        "--train.steps-per-rollout",
        "1",
        "--data.prompts-per-rank",
        "1",
        "--data.group-size",
        "2",
        "--run.wandb-mode",
        "disabled",
        "--run.no-progress",
        "--run.output-dir",
        str(out_dir),
    ]
    start = time.perf_counter()
    codes, logs = _two_nodes(tmp_path, args)
    assert codes == [0, 0], "\n\n".join(
        f"--- node {i} (exit {c})\n{t[-4000:]}" for i, (c, t) in enumerate(zip(codes, logs))
    )
    elapsed = time.perf_counter() - start
    both = "\n".join(logs)
    assert "world 4 = dp 2 x sp 2 (ulysses 2 x ring 1)" in both
    rows = [json.loads(line) for line in (out_dir / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/mean" in row for row in rows), rows
    print(f"2 nodes x 2 processes: {elapsed:.1f} s")


@pytest.mark.e2e
def test_two_nodes_refusal_is_one_line_and_exit_2(tmp_path):
    """Through multi_node.sh's launcher (miles.launch) a refusal by every worker ends each node with
    exit code 2 and the worker's one line; plain torchrun gives exit code 1 and its
    ChildFailedError traceback."""
    args = ["--config", "configs/tiny_cpu.yaml", "--train.learning-rate", "1e30"]
    codes, logs = _two_nodes(tmp_path, args, timeout=120)
    both = "\n".join(logs)
    assert codes == [2, 2], both[-4000:]
    assert "train.learning_rate" in both or "learning-rate" in both, both[-4000:]
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-4000:]


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


FAKE_TORCHRUN = (
    '#!/usr/bin/env bash\necho "torchrun NODE_RANK=${NODE_RANK:-} WRAPPER=${MILES_LAUNCH_WRAPPER:-} $*"\n'
)


def test_launch_scripts_build_the_torchrun_command(tmp_path):
    fake = _write_exe(tmp_path / "torchrun", FAKE_TORCHRUN)
    script = str(ROOT / "train_grpo.py")

    out = subprocess.run(
        ["bash", str(LAUNCH / "single_node.sh"), "3", "--config", "c.yaml"],
        env=_env(TORCHRUN=str(fake)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"--standalone --nnodes 1 --nproc-per-node 3 {script} --config c.yaml" in out
    assert f"WRAPPER={LAUNCH / 'single_node.sh'} 3 " in out  # the resume command's start, as typed

    env = _env(TORCHRUN=str(fake), NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.7", NPROC_PER_NODE="8")
    out = subprocess.run(
        ["bash", str(LAUNCH / "multi_node.sh"), "--config", "c.yaml"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "--nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.7:29500 "
        f"--rdzv-id miles {script} --config c.yaml"
    ) in out

    missing = subprocess.run(
        ["bash", str(LAUNCH / "multi_node.sh")],
        env=_env(TORCHRUN=str(fake), NNODES="2", MASTER_ADDR="x"),
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0 and "set NODE_RANK" in missing.stderr


def test_multi_node_default_launcher_is_miles_launch_and_parses(tmp_path, monkeypatch):
    """Without TORCHRUN the script runs ``$PYTHON -m miles.launch`` with torchrun's flags, which
    torch's own parser (the one miles.launch calls) reads as the node's settings; the resume command
    a run prints then starts with the script, as typed (MILES_LAUNCH_WRAPPER)."""
    from torch.distributed.run import parse_args

    from miles import launch

    fake_python = _write_exe(
        tmp_path / "python",
        '#!/usr/bin/env bash\necho "WRAPPER=$MILES_LAUNCH_WRAPPER"\nprintf "%s\\n" "$@"\n',
    )
    env = _env(
        PYTHON=str(fake_python), NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.7", NPROC_PER_NODE="3",
        TORCHRUN_ARGS="--max-restarts 0",
    )  # fmt: skip
    env.pop("TORCHRUN", None)
    env.pop(launch.WRAPPER_ENV, None)
    out = subprocess.run(
        ["bash", "launch/multi_node.sh", "--config", "c.yaml", "--sequence-parallel-size", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "WRAPPER=launch/multi_node.sh"
    assert out[1:3] == ["-m", "miles.launch"]
    ns = parse_args(out[3:])
    assert (ns.nnodes, ns.node_rank, ns.nproc_per_node) == ("2", 1, "3")
    assert (ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id, ns.max_restarts) == (
        "c10d",
        "10.0.0.7:29500",
        "miles",
        0,
    )
    assert ns.training_script == str(ROOT / "train_grpo.py")
    assert ns.training_script_args == ["--config", "c.yaml", "--sequence-parallel-size", "2"]

    from miles.train.outcome import resume_command

    monkeypatch.setenv(launch.WRAPPER_ENV, out[0].removeprefix("WRAPPER="))  # as the workers inherit it
    monkeypatch.setenv(
        launch.LAUNCH_COMMAND_ENV, "python -m miles.launch --nnodes 2 --node-rank 1 train_grpo.py"
    )
    assert resume_command(["--config", "c.yaml"]) == "launch/multi_node.sh --config c.yaml"


def test_slurm_script_starts_one_multi_node_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = _write_exe(bin_dir / "torchrun", FAKE_TORCHRUN)
    _write_exe(bin_dir / "scontrol", "#!/usr/bin/env bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun: run the task command once per node, with that node's SLURM_NODEID.
    _write_exe(
        bin_dir / "srun",
        '#!/usr/bin/env bash\nwhile [[ "$1" != bash ]]; do shift; done\n'
        'for id in 0 1; do SLURM_NODEID=$id "$@"; done\n',
    )
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        TORCHRUN=str(fake),
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-[a-b]",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="4",
    )
    out = subprocess.run(
        ["bash", str(LAUNCH / "slurm.sbatch"), "--config", "c.yaml", "--sequence-parallel-size", "8"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("torchrun")]
    assert len(lines) == 2, out
    for node_rank, line in enumerate(lines):
        assert f"NODE_RANK={node_rank} " in line
        assert f"--nnodes 2 --node-rank {node_rank} --nproc-per-node 4" in line
        assert "--rdzv-endpoint gpu-a:29500 --rdzv-id 4242" in line
        assert "WRAPPER=sbatch launch/slurm.sbatch " in line
        assert line.endswith("--config c.yaml --sequence-parallel-size 8")


def test_slurm_script_forwards_sigterm_and_requeues(tmp_path):
    """Slurm's ``--signal=B:TERM@120`` reaches the batch script: it forwards SIGTERM to srun (which
    passes it to the trainers), waits for srun to end, then requeues the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _write_exe(
        bin_dir / "scontrol",
        f'#!/usr/bin/env bash\nif [[ "$1" == show ]]; then echo gpu-a; else echo "scontrol $*" >> {log}; fi\n',
    )
    # srun: stands for a running job until SIGTERM, then takes a moment to "save" and exits 0.
    _write_exe(
        bin_dir / "srun",
        f"#!/usr/bin/env bash\ntrap 'kill $!; sleep 0.5; echo \"srun got TERM\" >> {log}; exit 0' TERM\n"
        f"echo started >> {log}\nsleep 30 &\nwait\n",
    )
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="gpu-a",
        SLURM_JOB_ID="4242",
    )
    job = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), "--config", "c.yaml"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=20)
    assert job.returncode == 0, out
    assert log.read_text().splitlines() == ["started", "srun got TERM", "scontrol requeue 4242"], out
    assert "requeueing job 4242" in out
