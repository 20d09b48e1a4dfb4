"""``bench/profile_step.py`` (issue 43): one tiny CPU step under ``torch.profiler``, its JSON checked
against the profiler's own output (the Chrome trace of the same run), and the CUDA attribution
(kernels by the phase window of the CPU op that launched them, any thread) on synthetic events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
PHASES = ["rollout", "decode+reward", "train"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("profile")
    cmd = [sys.executable, "bench/profile_step.py", "--out", str(out), "--model", "tiny"]
    cmd += ["--shape", "5", "64", "64", "--num-steps", "2", "--sde-window", "1", "--budget-gib", "1"]
    cmd += ["--top", "4", "--trace", str(out / "trace.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    trace = json.loads((out / "trace.json").read_text())
    assert (out / "profile.md").read_text().count("| name | self s |") == 3
    return json.loads((out / "profile.json").read_text()), trace


def test_profile_matches_the_profilers_totals(profiled):
    result, trace = profiled
    prof = result["profile"]
    assert list(prof["phases"]) == PHASES  # the phases that ran, in order
    assert prof["profiled_rollout"] == 2 and result["rollouts"] == 2
    # the step bench's own record rides along: two rollouts probed, the second profiled
    assert [p["phase"] for p in result["phases"] if p["phase"] != "init"] == PHASES * 2
    ranges = {
        e["name"].removeprefix("miles::"): e["dur"]
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
        and e.get("name", "").startswith("miles::")
        and e.get("cat") == "user_annotation"
    }
    assert set(ranges) == set(PHASES)
    for phase, row in prof["phases"].items():
        assert row["kind"] == "cpu_ops"
        # the range's inclusive time as the trace has it, and the sum of every op's self time inside it
        assert row["range_us"] == pytest.approx(ranges[phase], rel=1e-6)
        assert row["range_us"] - 1.0 <= row["total_us"] <= row["range_us"] * 1.01
        assert row["wall_s"] * 1e6 >= row["range_us"] * 0.99
        top = row["top"]
        assert 1 <= len(top) <= 4 < row["distinct"]
        assert sum(t["share"] for t in top) <= 1.0 + 1e-9
        for t in top:
            assert t["share"] == pytest.approx(t["self_us"] / row["total_us"])
            assert isinstance(t["calls"], int) and t["calls"] >= 1
        assert [t["self_us"] for t in top] == sorted((t["self_us"] for t in top), reverse=True)


def test_profile_records_the_setup(profiled):
    result, _ = profiled
    assert result["device"] == "cpu" and result["shape"] == [5, 64, 64]
    assert (
        result["command"][:3] == ["bench/profile_step.py", "--out", result["command"][2]]
        and "--top" in result["command"]
    )
    assert result["activation_checkpointing"] == "budget"  # the recipe's
    assert result["canary_per_rollout"] == [0.0, 0.0] and result["canary_exact"] is True
    assert result["flops"]["rollout"] > 0 and "summary" in result  # what bench/mfu_table.py reads


def _event(name, start, end, thread=1, kernels=(), self_us=0.0, cpu=True):
    from torch.autograd import DeviceType

    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CPU if cpu else DeviceType.CUDA,
        is_async=False,
        thread=thread,
        time_range=SimpleNamespace(start=start, end=end),
        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
        self_cpu_time_total=self_us,
        cpu_time_total=end - start,
    )


def test_kernels_go_to_the_phase_that_launched_them():
    from bench.profile_step import phase_rows, summarize_phase

    events = [
        _event("miles::rollout", 0, 100),
        _event("miles::train", 200, 400, kernels=[("triton_fused", 10.0)]),  # launched with no op open
        _event("aten::mm", 10, 20, kernels=[("gemm", 30.0)]),
        _event("aten::mm", 250, 260, kernels=[("gemm", 50.0)]),
        # the autograd engine's thread: backward kernels launched inside train's window
        _event("autograd::engine", 300, 390, thread=2, kernels=[("flash_bwd", 60.0), ("gemm", 20.0)]),
        _event("aten::mm", 150, 160, kernels=[("gemm", 999.0)]),  # between the phases: neither
        _event("gemm", 260, 290, cpu=False),  # the kernel's own device event is not counted twice
    ]
    rows = phase_rows(events, cuda=True)
    assert sorted(rows) == ["rollout", "train"]
    assert sorted(rows["rollout"]["items"]) == [("gemm", 30.0)]
    train = summarize_phase(rows["train"]["items"], wall_s=2e-4, top=1)
    assert train["total_us"] == 140.0 and train["distinct"] == 3
    assert train["top"] == [{"name": "gemm", "self_us": 70.0, "share": pytest.approx(70 / 140), "calls": 2}]
    assert train["busy"] == pytest.approx(140.0 / 200.0)
