"""Resume through the real launcher: a SIGKILLed rank, auto-resume, bitwise equality; resume across layouts.

Every run is ``torchrun --standalone --nproc-per-node 4 --max-restarts 0 train_grpo.py`` on the tiny
recipe (``configs/tiny_cpu.yaml``) in deterministic mode, checkpointing after every rollout
(``train.steps_per_rollout`` 2: checkpoints at steps 2, 4, 6). The module shares one uninterrupted
dp4 run of 3 rollouts (6 optimizer steps) as the reference (a run of the session's shared launch,
``tests/e2e/conftest.py``).

- ``test_kill_mid_step_then_resume_is_bitwise_exact``: ``MILES_FAULT_KILL=1:5`` SIGKILLs rank 1 in
  the middle of optimizer step 5 (rollout 2). The launch must fail promptly (torchrun tears the
  other ranks down; no hang until the collective timeout), leave only complete checkpoints
  (step 2, step 4), and the same flags without the variable must resume from step 4 —
  ignoring a stale ``.partial`` and a newer ``step_*`` folder without ``COMPLETE`` planted next
  to them — and reach the reference's weights sha256 at step 6 and its metrics.jsonl rows
  (last row per step; wall-clock, throughput and memory keys left out) bitwise.
- ``test_resume_across_topologies``, for each model family (parametrized): Wan: the reference's
  dp4 step-6 checkpoint, copied, loads at dp2 x sp2 (ulysses 2) and at dp1 x sp4 (ulysses 2 x
  ring 2) with the weights sha256 printed at load equal to the one printed at save, and each
  continues one more rollout; the sp4 run's step-8 checkpoint then loads back at dp4 (same digest)
  and continues. The global batch stays 8 prompt groups (prompts-per-rank 2 at dp4, 4 at dp2, 8 at
  dp1). LTX-Video (``configs/tiny_ltx_cpu.yaml``): a dp2 x sp2 reference of 2 rollouts (in the
  shared launch), its step-2 checkpoint resumed at dp4 (same digest), whose rollout 1 continues the
  reference's trajectory (reward, loss and grad norm of steps 3 and 4 within 1e-3 relative: the
  layout changes only fp32 rounding).
- ``test_ltx_double_run_is_bitwise``: the LTX reference's flags run again (in the relaunch, another
  process): every metrics.jsonl and eval.jsonl value (wall-clock, throughput and memory aside),
  every checkpoint's weights sha256 and every exported file, bitwise equal (Wan's double run:
  tests/e2e/test_bands.py).

The launches that must crash, stop or refuse (the kill, SIGTERM, Ctrl-C, the refused rerun) run one
per launch; every relaunch after them (the two resumes, the overwriting rerun, both layouts' resumes
and, last, the resume back at dp4 from the sp4 run's step-8 checkpoint) then shares ONE launch
(``tests/e2e/multi_run.py``: ``train_grpo.main`` run after run in one process group): 5 launches
and the shared reference run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dist_utils import FINISHED_ENV, finished_ranks, may_retry
from tests.e2e.multi_run import launch_runs

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
VOLATILE_PREFIXES = ("time/", "perf/", "memory/")
SAVED = re.compile(r"\[miles\] checkpoint saved: (\S+) \(weights sha256 ([0-9a-f]{64})\)")
RESUMED = re.compile(
    r"\[miles\] resumed from (\S+) \(step (\d+), rollout (\d+); saved at dp (\d+) x sp (\d+), "
    r"now dp (\d+) x sp (\d+)\) \(weights sha256 ([0-9a-f]{64})\)"
)


COMMON = "--run.wandb-mode disabled --run.no-progress --deterministic-mode --train.weight-digest".split()
COMMON += ["--train.checkpoint-every", "1", "--train.steps-per-rollout", "2"]
RECIPE = ["--config", "configs/tiny_cpu.yaml", *COMMON, "--train.no-export"]
# LTX-Video's reference (dp2 x sp2) also evaluates and exports: its double run compares them. One
# sample per micro-batch: at dp4 each rank holds one sample per optimizer step.
LTX_RECIPE = ["--config", "configs/tiny_ltx_cpu.yaml", *COMMON, "--train.keep-checkpoints", "3"]
LTX_RECIPE += "--train.micro-batch-size 1 --eval.num-seeds 1".split()  # evaluated first and last
LTX_RECIPE += ["--eval.prompt-file", "miles/world/prompts_heldout.txt"]
LTX_REFERENCE = [*LTX_RECIPE, *"--sequence-parallel-size 2 --ulysses-degree 2 --train.num-rollouts 2".split()]


@dataclass
class Launch:
    returncode: int
    output: str  # stdout + stderr
    seconds: float
    run_dir: Path
    finished_dir: Path  # each rank that finished its work wrote rank<R> here

    def saved(self) -> dict[int, str]:
        """Step -> weights sha256 of every checkpoint this launch saved."""
        return {int(Path(p).name.split("_")[1]): h for p, h in SAVED.findall(self.output)}

    def resumed(self) -> re.Match | None:
        return RESUMED.search(self.output)


def launch(
    root: Path,
    name: str,
    *flags: str,
    env: dict | None = None,
    timeout: float = 400,
    interrupt_after: str | None = None,
    launcher: str = "torch.distributed.run",
) -> Launch:
    """One 4-process torchrun launch of train_grpo.py on the tiny recipe into ``root/name``.
    ``interrupt_after``: SIGINT the launch's whole process group (torchrun and every worker, as a
    Ctrl-C in a terminal does) as soon as an output line starts with this text. ``launcher``: the
    module that launches (``miles.launch``: torchrun with quiet refusals and interrupts)."""
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", "0", "train_grpo.py", *RECIPE]
    cmd += ["--run.output-dir", str(root), "--run.name", name, *flags]
    finished_dir = Path(tempfile.mkdtemp(prefix="finished_", dir=root))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env[FINISHED_ENV] = str(finished_dir)
    for hook in ("MILES_FAULT_KILL", "MILES_FAULT_SIGNAL"):
        if env is None or hook not in env:
            full_env.pop(hook, None)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if interrupt_after and line.startswith(interrupt_after):
                os.killpg(proc.pid, signal.SIGINT)
                interrupt_after = None
        proc.wait()
    finally:
        timer.cancel()
    return Launch(proc.returncode, "".join(lines), time.monotonic() - t0, root / name, finished_dir)


def _ok(run: Launch) -> None:
    if run.returncode != 0:
        # torchrun's summary fills the tail; the failing rank's traceback sits earlier.
        lines = run.output.splitlines()
        starts = [i for i, line in enumerate(lines) if "Traceback" in line and "[rank" in line]
        excerpts = ["\n".join(lines[i : i + 60]) for i in starts[:2]]
        errors = [line for line in lines if "Error" in line and "error_file" not in line]
        root = [i for i, line in enumerate(lines) if "Root Cause" in line]
        cause = ["\n".join(lines[root[0] : root[0] + 10])] if root else []
        detail = "\n...\n".join(excerpts + errors[-20:] + cause) or run.output[-6000:]
        raise AssertionError(f"launch failed (rc {run.returncode}):\n{detail}")


def last_rows(run_dir: Path) -> dict[int, dict]:
    """The last metrics.jsonl row logged for each step, without wall-clock/throughput/memory keys."""
    rows: dict[int, dict] = {}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == sorted(set(steps)), f"a resume must not leave duplicate rows: {steps}"
    for line in lines:
        row = json.loads(line)
        rows[row["step"]] = {
            k: v for k, v in row.items() if k != "time" and not k.startswith(VOLATILE_PREFIXES)
        }
    return rows


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


# The uninterrupted dp4 run: 3 rollouts, checkpoints at steps 2, 4, 6 (keeps all three); in the
# session's shared launch (tests/e2e/conftest.py). Its time excludes the launch's start-up.
SHARED_RUNS = {
    4: {
        "resume_reference": [*RECIPE, "--train.num-rollouts", "3", "--train.keep-checkpoints", "3"],
        "ltx_resume_reference": LTX_REFERENCE,
    }
}


@pytest.fixture(scope="module")
def reference(shared_runs) -> Launch:
    shared = shared_runs["resume_reference"]
    run = Launch(0, shared.output, shared.seconds, shared.run_dir, shared.run_dir.parent)
    assert sorted(run.saved()) == [2, 4, 6], run.output[-3000:]
    assert sorted(last_rows(run.run_dir)) == [1, 2, 3, 4, 5, 6]
    return run


KILL_FLAGS = ["--train.num-rollouts", "3", "--train.keep-checkpoints", "3"]
SIGNAL_FLAGS = ["--train.num-rollouts", "3", "--train.checkpoint-every", "0"]
RERUN_FLAGS = ["--train.no-resume", "--train.num-rollouts", "1"]


def _files(run_dir: Path) -> dict[Path, bytes]:
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _plant_decoys(run_dir: Path) -> None:
    """Decoys newer than step 4: a stale .partial (even with a marker) and a step folder without one."""
    if not (run_dir / "checkpoints").is_dir():
        return  # the crash left no checkpoint: the test says so
    for decoy in ("step_000005", "step_000006.partial"):
        (run_dir / "checkpoints" / decoy).mkdir()
        (run_dir / "checkpoints" / decoy / ".metadata").write_bytes(b"not a DCP checkpoint")
    (run_dir / "checkpoints" / "step_000006.partial" / "COMPLETE").write_text("6\n")


@pytest.fixture(scope="module")
def ltx_reference(shared_runs) -> Launch:
    shared = shared_runs["ltx_resume_reference"]
    run = Launch(0, shared.output, shared.seconds, shared.run_dir, shared.run_dir.parent)
    assert sorted(run.saved()) == [2, 4], run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def launches(reference, ltx_reference) -> dict:
    """The module's launches. Those that must crash, stop or refuse run one per launch, and what
    they leave is recorded; then ONE launch (tests/e2e/multi_run.py) relaunches them all — the
    killed run and the stopped run resume, the refused one restarts with --train.overwrite — and
    resumes the reference's step-6 checkpoint in both other layouts."""
    root = reference.run_dir.parent
    got = {"killed": launch(root, "killed", *KILL_FLAGS, env={"MILES_FAULT_KILL": "1:5"})}
    run_dir = got["killed"].run_dir
    names = checkpoint_names(run_dir) if (run_dir / "checkpoints").is_dir() else []
    got["killed_left"] = (
        names,
        all((run_dir / "checkpoints" / n / "COMPLETE").is_file() for n in names),
        sorted(last_rows(run_dir)) if (run_dir / "metrics.jsonl").is_file() else [],
    )
    _plant_decoys(run_dir)

    got["sigterm"] = launch(root, "sigterm", *SIGNAL_FLAGS, env={"MILES_FAULT_SIGNAL": "2:1"})
    run_dir = got["sigterm"].run_dir
    got["sigterm_left"] = (
        checkpoint_names(run_dir) if (run_dir / "checkpoints").is_dir() else [],
        sorted(last_rows(run_dir)) if (run_dir / "metrics.jsonl").is_file() else [],
    )
    got["ctrl_c"] = launch(
        root, "ctrl_c", *SIGNAL_FLAGS, interrupt_after="[rollout 0]", launcher="miles.launch"
    )

    run_dir = root / "rerun"
    shutil.copytree(reference.run_dir, run_dir)
    (run_dir / "export" / "pipeline").mkdir(parents=True)  # as a run with train.export leaves it
    got["rerun_before"] = _files(run_dir)
    got["refused"] = launch(root, "rerun", *RERUN_FLAGS)
    got["rerun_after"] = _files(run_dir)

    again = {
        "killed": [*RECIPE, *KILL_FLAGS],
        "sigterm": [*RECIPE, *SIGNAL_FLAGS],
        "rerun": [*RECIPE, *RERUN_FLAGS, "--train.overwrite"],
    }
    for family, ref in (("wan", reference), ("ltx", ltx_reference)):
        f = FAMILIES[family]
        for name, sp, u, ppr, _ in f.layouts:
            _copy_run(ref.run_dir, root / name, f.step)
            again[name] = [*f.recipe, *_layout_flags(sp, u, ppr, f.step // 2 + 1)]
    again["back_to_dp4"] = [*RECIPE, *_layout_flags(1, 0, 2, 5)]  # after dp1_sp4_u2r2: its step 8
    again["ltx_double"] = LTX_REFERENCE  # a second run of the LTX reference, in another process
    step8 = "checkpoints/step_000008"
    copies = {"back_to_dp4": [(root / "dp1_sp4_u2r2" / step8, root / "back_to_dp4" / step8)]}
    relaunched = launch_runs(
        root, again, nproc=4, env={"WANDB_MODE": "disabled"}, timeout_s=900, copies=copies
    )
    for name, r in relaunched.items():
        got[f"{name}_again"] = Launch(0, r.output, r.seconds, r.run_dir, root)
    return got


def test_kill_mid_step_then_resume_is_bitwise_exact(reference, launches):
    crashed = launches["killed"]
    assert crashed.returncode != 0, crashed.output[-3000:]
    assert "SIGKILL" in crashed.output or "exitcode  : -9" in crashed.output, crashed.output[-3000:]
    assert not may_retry(crashed.returncode, crashed.finished_dir, 4, "killed", crashed.output)
    # The crash run does 5/6 of the reference's work; a hang would last collective_timeout_s (600 s).
    assert crashed.seconds < reference.seconds + 90, (crashed.seconds, reference.seconds)
    run_dir = crashed.run_dir
    assert crashed.saved() == {2: reference.saved()[2], 4: reference.saved()[4]}
    # Only complete checkpoints: no step_* without COMPLETE, no .partial left by the crash.
    names, complete, rows = launches["killed_left"]
    assert names == ["step_000002", "step_000004"] and complete, names
    assert rows == [1, 2, 3, 4]  # step 5 died before it was logged

    # Relaunched with the decoys (_plant_decoys) next to the complete checkpoints.
    resumed = launches["killed_again"]
    match = resumed.resumed()
    assert match is not None, resumed.output[-3000:]
    assert Path(match[1]).name == "step_000004" and (match[2], match[3]) == ("4", "2")
    assert match[8] == reference.saved()[4]  # the digest at load is the digest at save
    assert resumed.saved() == {6: reference.saved()[6]}, "final weights differ from the uninterrupted run"

    got, want = last_rows(run_dir), last_rows(reference.run_dir)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == want[step], f"metrics of step {step} differ:\n{got[step]}\n{want[step]}"
    # The next save removed both leftovers; the unmarked folder was never taken as good.
    names = checkpoint_names(run_dir)
    assert "step_000006.partial" not in names and names[-1] == "step_000006", names
    assert "step_000005" not in names, "the unmarked folder is a leftover: the next save removes it"
    print(
        f"reference {reference.seconds:.0f} s, killed launch {crashed.seconds:.0f} s, "
        f"resumed run {resumed.seconds:.0f} s; step-6 sha256 {reference.saved()[6][:16]}"
    )


def _copy_run(src: Path, dst: Path, step: int) -> None:
    """A fresh run directory holding only ``src``'s step-``step`` checkpoint."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)


@dataclass(frozen=True)
class FamilyResume:
    """A family's cross-layout resume: its reference run (shared launch), the checkpoint's step and
    layout, and the layouts it is resumed at: (name, sequence_parallel_size, ulysses_degree,
    prompts_per_rank, expected (dp, sp)) at 4 processes, the global batch unchanged."""

    reference: str
    recipe: list[str]
    step: int
    saved_at: tuple[int, int]
    layouts: list[tuple[str, int, int, int, tuple[int, int]]]


FAMILIES = {
    "wan": FamilyResume(
        "reference", RECIPE, 6, (4, 1), [("dp2_sp2_u2", 2, 2, 4, (2, 2)), ("dp1_sp4_u2r2", 4, 2, 8, (1, 4))]
    ),
    "ltx": FamilyResume("ltx_reference", LTX_RECIPE, 2, (2, 2), [("ltx_dp4", 1, 1, 1, (4, 1))]),
}


def _layout_flags(sp: int, ulysses: int, prompts_per_rank: int, num_rollouts: int) -> list[str]:
    return [
        "--sequence-parallel-size",
        str(sp),
        "--ulysses-degree",
        str(ulysses),
        "--data.prompts-per-rank",
        str(prompts_per_rank),
        "--train.num-rollouts",
        str(num_rollouts),
    ]


def _check_resumed(run: Launch, step: int, saved_at: tuple[int, int], now: tuple[int, int], digest: str):
    _ok(run)
    match = run.resumed()
    assert match is not None, run.output[-3000:]
    assert int(match[2]) == step and (int(match[4]), int(match[5])) == saved_at, match[0]
    assert (int(match[6]), int(match[7])) == now, match[0]
    assert match[8] == digest, f"weights changed on load: {match[8]} != {digest}"
    # Training continued: one more rollout (two optimizer steps) logged and checkpointed.
    rows = last_rows(run.run_dir)
    assert sorted(rows) == [step + 1, step + 2], sorted(rows)
    assert all(r["train/loss"] == r["train/loss"] for r in rows.values())  # not NaN
    assert sorted(run.saved()) == [step + 2]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_across_topologies(family, launches, request):
    f = FAMILIES[family]
    ref = request.getfixturevalue(f.reference)
    digest = ref.saved()[f.step]
    runs = {name: launches[f"{name}_again"] for name, *_ in f.layouts}  # each resumed its own copy
    for name, *_, now in f.layouts:
        _check_resumed(runs[name], f.step, f.saved_at, now, digest)
        # Where the reference ran on, the resumed run continues its trajectory (layouts differ by
        # fp32 rounding only: every sample's noise is keyed by its global index).
        want, got = last_rows(ref.run_dir), last_rows(runs[name].run_dir)
        for step in set(want) & set(got):
            for key in ("reward/mean", "train/loss", "train/grad_norm"):
                if key in want[step]:
                    assert got[step][key] == pytest.approx(want[step][key], rel=1e-3), (name, step, key)
    if family != "wan":
        return

    # ... and back: the sp4 run's step-8 checkpoint (copied alone into a fresh folder) at dp4.
    sp4 = runs["dp1_sp4_u2r2"]
    back = launches["back_to_dp4_again"]
    _check_resumed(back, 8, (1, 4), (4, 1), sp4.saved()[8])
    print(
        "weights sha256: dp4 step 6 "
        + digest[:16]
        + "".join(f"; {n} step 8 {r.saved()[8][:16]}" for n, r in runs.items())
        + f"; back at dp4 step 10 {back.saved()[10][:16]}"
    )


def test_rerun_with_no_resume_refuses_then_overwrites(reference, launches):
    """``--train.no-resume`` into a finished run's directory: refused, nothing touched; with
    ``--train.overwrite`` the previous run is deleted and the new one is a clean fresh start."""
    refused = launches["refused"]
    run_dir = refused.run_dir
    assert refused.returncode != 0
    assert f"the run directory {run_dir} holds a previous run" in refused.output, refused.output[-3000:]
    for part in ("step_000002, step_000004, step_000006", "metrics.jsonl with 6 rows", "export/"):
        assert part in refused.output, part
    for way_out in ("drop --train.no-resume", "--run.name", "--train.overwrite"):
        assert way_out in refused.output, way_out
    before, after = launches["rerun_before"], launches["rerun_after"]
    assert after == before, "a refused launch must leave the previous run as it was"

    fresh = launches["rerun_again"]  # the same flags and --train.overwrite
    assert fresh.resumed() is None
    assert checkpoint_names(run_dir) == ["step_000002"]
    assert not (run_dir / "export").exists()
    # A fresh start of the same seed: the reference's first two steps, bit for bit.
    assert fresh.saved() == {2: reference.saved()[2]}
    want = last_rows(reference.run_dir)
    assert last_rows(run_dir) == {1: want[1], 2: want[2]}


def _tracebacks(output: str) -> int:
    return sum(1 for line in output.splitlines() if line.startswith("Traceback"))


def test_signal_stops_with_a_checkpoint_then_resume_is_bitwise_exact(reference, launches):
    """SIGTERM to one rank in the middle of rollout 1 (as Slurm's preemption signal, or a kill of
    one process): every rank abandons the rollout, step 2 is saved, every rank exits 0 with no
    traceback and the resume command is printed; resuming reaches the reference's step-6 weights
    and metrics bitwise. Then a Ctrl-C (SIGINT to torchrun and every worker) while rollout 1 runs:
    a checkpoint equal to the reference's at that step, torchrun's own SignalException the only
    traceback."""
    stopped = launches["sigterm"]
    assert stopped.returncode == 0, stopped.output[-3000:]
    assert finished_ranks(stopped.finished_dir) == {0, 1, 2, 3}
    assert _tracebacks(stopped.output) == 0, stopped.output[-3000:]
    assert stopped.saved() == {2: reference.saved()[2]}, stopped.output[-3000:]
    assert "stopped by SIGTERM after step 2 (1 of 3 rollouts done)" in stopped.output
    # Under plain torchrun the resume command is torchrun's, read from the parent's command line.
    assert (
        "To resume, relaunch the same command: python -m torch.distributed.run --standalone --nproc-per-node 4 "
        "--max-restarts 0 train_grpo.py --config configs/tiny_cpu.yaml" in stopped.output
    ), stopped.output[-3000:]
    assert launches["sigterm_left"] == (["step_000002"], [1, 2])

    resumed = launches["sigterm_again"]
    match = resumed.resumed()
    assert match is not None and Path(match[1]).name == "step_000002", resumed.output[-3000:]
    assert resumed.saved() == {6: reference.saved()[6]}, "final weights differ from the uninterrupted run"
    assert last_rows(resumed.run_dir) == last_rows(reference.run_dir)

    ctrl_c = launches["ctrl_c"]
    assert "stopped by SIGINT after step" in ctrl_c.output, ctrl_c.output[-3000:]
    saved = ctrl_c.saved()
    assert len(saved) == 1 and saved == {s: reference.saved()[s] for s in saved}, ctrl_c.output[-3000:]
    # Through miles.launch (issue 46): no traceback at all, not torchrun's SignalException either;
    # exit code 130; the resume command is the launch as typed, launcher included.
    assert _tracebacks(ctrl_c.output) == 0 and "KeyboardInterrupt" not in ctrl_c.output, ctrl_c.output[-3000:]
    assert "ChildFailedError" not in ctrl_c.output and "SignalException" not in ctrl_c.output
    assert ctrl_c.returncode == 130, ctrl_c.output[-3000:]
    assert (
        "To resume, relaunch the same command: python -m miles.launch --standalone --nproc-per-node 4 "
        "--max-restarts 0 train_grpo.py --config configs/tiny_cpu.yaml" in ctrl_c.output
    ), ctrl_c.output[-3000:]
    print(
        f"SIGTERM launch {stopped.seconds:.0f} s, resumed {resumed.seconds:.0f} s; Ctrl-C launch "
        f"{ctrl_c.seconds:.0f} s, saved step {next(iter(saved))}"
    )


def _eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(VOLATILE_PREFIXES)} for r in rows]


def test_ltx_double_run_is_bitwise(ltx_reference, launches):
    """The LTX reference launched again: the same metrics, evaluations, checkpoints and export."""
    first, second = ltx_reference, launches["ltx_double_again"]
    assert first.saved() == second.saved() and sorted(first.saved()) == [2, 4]
    assert last_rows(first.run_dir) == last_rows(second.run_dir) and len(last_rows(first.run_dir)) == 4
    evals = _eval_rows(first.run_dir)
    assert evals == _eval_rows(second.run_dir) and len(evals) == 2, evals  # the baseline, the last
    export = _files(first.run_dir / "export")
    assert any(p.suffix == ".safetensors" for p in export), sorted(export)
    assert export == _files(second.run_dir / "export")
    dp4 = launches["ltx_dp4_again"]
    print(
        f"LTX runs: reference {first.seconds:.1f} s, again {second.seconds:.1f} s, resumed at dp4 {dp4.seconds:.1f} s"
    )
