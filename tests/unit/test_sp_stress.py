"""bench/sp_stress.py's verdicts: glibc's heap messages and a rank killed by a signal are crashes of
their kind, a launch whose metrics differ from its layout's first is ``diverged``, and each ``--check``
sets the allocator's variables."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import sp_stress  # noqa: E402

# What the crashed launch of issue 46 printed (one rank aborted by glibc, torchrun's summary).
ISSUE_46 = """[rollout 3] step 8 reward mean=0.8302 std=0.0211
malloc(): unaligned tcache chunk detected
Fatal Python error: Aborted

Current thread 0x00007f24f3c7eb80 (most recent call first):
  File "/repo/miles/train/trainer.py", line 472 in _iteration
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: Connection reset by peer
  exitcode  : -6 (pid: 367)  (SIGABRT)
"""


def test_the_issues_abort_is_a_heap_crash_with_its_stack():
    kind, lines = sp_stress.classify(1, ISSUE_46, timed_out=False)
    assert kind == "heap"
    assert lines == ["malloc(): unaligned tcache chunk detected"]
    trace = sp_stress.fault_trace(ISSUE_46)
    assert trace[0] == "Fatal Python error: Aborted"
    assert any("_iteration" in line for line in trace)


def test_other_failures_and_passes():
    killed = "  exitcode  : -9 (pid: 12)  (SIGKILL)\n  traceback : Signal 9 (SIGKILL) received by PID 12\n"
    assert sp_stress.classify(1, killed, False)[0] == "signal"
    assert sp_stress.classify(1, "Traceback (most recent call last):\nValueError: x\n", False)[0] == "error"
    assert sp_stress.classify(-1, "", True)[0] == "timeout"
    assert sp_stress.classify(0, ISSUE_46, False) == ("pass", [])  # the exit code decides a pass


def test_a_launch_whose_metrics_differ_from_its_layouts_first_diverged():
    def row(layout, digest):
        crashed = digest is None  # a crashed launch: no metrics to compare
        return {
            "layout": layout,
            "metrics_sha256": digest,
            "crashed": crashed,
            "kind": "signal",
            "wall_s": 1.0,
        }

    rows = [row("u2r2", "aa"), row("u4r1", "bb"), row("u2r2", "aa"), row("u2r2", "ff"), row("u2r2", None)]
    summary = sp_stress.summarize(rows, ["u2r2", "u4r1"])
    assert [r.get("diverged") for r in rows] == [False, False, False, True, None]
    assert summary["layouts"]["u2r2"]["diverged"] == 1 and summary["total"]["diverged"] == 1
    assert summary["layouts"]["u2r2"]["crashes"] == 1 and summary["layouts"]["u4r1"]["runs"] == 1


def test_each_check_sets_the_allocators_variables(tmp_path):
    assert sp_stress.check_env("none", 165, tmp_path / "x") == {}
    assert sp_stress.check_env("perturb", 7, tmp_path / "x") == {"MALLOC_PERTURB_": "7"}
    env = sp_stress.check_env("malloc", 165, tmp_path / "x")
    assert env["MALLOC_CHECK_"] == "3" and env["MALLOC_PERTURB_"] == "165"
    if any(Path(p).exists() for p in sp_stress.MALLOC_DEBUG):  # glibc >= 2.34 needs it preloaded
        assert "libc_malloc_debug" in env["LD_PRELOAD"]


def test_arms_set_their_variable_and_every_arm_must_match_the_layouts_first(tmp_path):
    args = sp_stress.parse_args(
        ["--out", str(tmp_path), "--arms", "overlap=MILES_RING_OVERLAP=1", "waited=MILES_RING_OVERLAP=0"]
    )
    assert args.arm_env == {"overlap": {"MILES_RING_OVERLAP": "1"}, "waited": {"MILES_RING_OVERLAP": "0"}}
    for bad in (["x"], ["=K=V"], ["name=novalue"]):
        try:
            sp_stress.parse_args(["--out", str(tmp_path), "--arms", *bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--arms {bad} accepted")
    rows = [
        {"layout": f"u2r2/{arm}", "metrics_sha256": d, "crashed": False, "kind": "pass", "wall_s": 1.0}
        for arm, d in (("overlap", "aa"), ("waited", "aa"), ("overlap", "aa"), ("waited", "bb"))
    ]
    summary = sp_stress.summarize(rows, ["u2r2/overlap", "u2r2/waited"])
    assert [r["diverged"] for r in rows] == [False, False, False, True]  # the arms must agree bitwise
    assert summary["layouts"]["u2r2/waited"] == {
        "runs": 2, "crashes": 0, "heap": 0, "diverged": 1, "mean_wall_s": 1.0
    }  # fmt: skip
