"""bench/sp_stress.py's verdicts: glibc's heap messages and a rank killed by a signal are crashes of
their kind, a launch whose metrics differ from its layout's first is ``diverged``, and each ``--check``
sets the allocator's variables."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
        ["--out", str(tmp_path), "--arms", "torch=MILES_GLOO_WORKERS=2", "miles=MILES_GLOO_WORKERS=1"]
    )
    assert args.arm_env == {"torch": {"MILES_GLOO_WORKERS": "2"}, "miles": {"MILES_GLOO_WORKERS": "1"}}
    for bad in (["x"], ["=K=V"], ["name=novalue"]):
        try:
            sp_stress.parse_args(["--out", str(tmp_path), "--arms", *bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--arms {bad} accepted")
    rows = [
        {"layout": f"u2r2/{arm}", "metrics_sha256": d, "crashed": False, "kind": "pass", "wall_s": 1.0}
        for arm, d in (("torch", "aa"), ("miles", "aa"), ("torch", "aa"), ("miles", "bb"))
    ]
    summary = sp_stress.summarize(rows, ["u2r2/torch", "u2r2/miles"])
    assert [r["diverged"] for r in rows] == [False, False, False, True]  # the arms must agree bitwise
    assert summary["layouts"]["u2r2/miles"] == {
        "runs": 2, "crashes": 0, "heap": 0, "diverged": 1, "mean_wall_s": 1.0
    }  # fmt: skip


def test_each_load_kind_is_a_runnable_program():
    for kind, source in sp_stress.LOAD_KINDS.items():
        compile(source, f"<load {kind}>", "exec")  # a syntax error would only show as a silent idle load
    procs = sp_stress.start_load(1, nice=0, kind="churn")
    try:
        assert procs[0].poll() is None  # still running: it works and sleeps forever
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_memcheck_runs_every_rank_under_valgrind_with_a_longer_timeout(tmp_path):
    args = sp_stress.parse_args(["--out", str(tmp_path), "--check", "memcheck"])
    assert args.timeout == 7200.0 and sp_stress.parse_args(["--out", str(tmp_path)]).timeout == 900.0
    cmd = sp_stress.command(args, 4, 2, "u2r2_000", tmp_path / "logs" / "u2r2_000")
    at = cmd.index("--no-python")
    assert cmd[at + 1] == "valgrind" and "--tool=memcheck" in cmd
    assert cmd.index(sys.executable, at) < cmd.index("train_grpo.py")  # valgrind starts python
    assert f"--log-file={tmp_path / 'logs' / 'u2r2_000'}.memcheck.%p" in cmd
    assert cmd[cmd.index("--run.collective-timeout-s") + 1] == "7200"
    plain = sp_stress.command(sp_stress.parse_args(["--out", str(tmp_path)]), 4, 2, "x")
    assert "--no-python" not in plain and "--run.collective-timeout-s" not in plain


# A memcheck report as valgrind 3.19 writes it (abridged stacks), and the loader's suppressed kind.
MEMCHECK_LOG = """==71== Memcheck, a memory error detector
==71== Invalid write of size 8
==71==    at 0x4C3B2A1: gloo::transport::tcp::Pair::handleCompletion() (in libtorch_cpu.so)
==71==    by 0x4C3B9F0: gloo::transport::tcp::Loop::run() (in libtorch_cpu.so)
==71==  Address 0x1b2c3d40 is 0 bytes inside a block of size 24 free'd
==71==    at 0x484B27F: operator delete(void*) (vg_replace_malloc.c:923)
==71==    by 0x4C1A111: c10d::ProcessGroupGloo::runLoop(int) (in libtorch_cpu.so)
==71==
==71== Conditional jump or move depends on uninitialised value(s)
==71==    at 0x5A1: at::TensorIteratorBase::build(at::TensorIteratorConfig&) (in libtorch_cpu.so)
==71==
==71== ERROR SUMMARY: 2 errors from 2 contexts (suppressed: 4 from 1)
"""


def test_memcheck_reports_of_heap_misuse_are_crashes_with_their_stacks(tmp_path):
    log = tmp_path / "u2r2_000.memcheck.71"
    log.write_text(MEMCHECK_LOG)
    lines = sp_stress.memcheck_errors([log])
    assert lines[0] == f"{log.name}: ==71== Invalid write of size 8"
    assert any("block of size 24 free'd" in ln for ln in lines) and any("runLoop" in ln for ln in lines)
    assert not any("uninitialised" in ln for ln in lines)  # not a heap misuse
    clean = tmp_path / "u2r2_001.memcheck.72"
    clean.write_text(MEMCHECK_LOG.split("==71== Invalid")[0] + "==71== ERROR SUMMARY: 0 errors\n")
    assert sp_stress.memcheck_errors([clean]) == []


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_memcheck_as_run_finds_a_write_after_free_and_passes_the_loader(tmp_path):
    """The prefix the ranks run under, on a process that writes into a freed 24-byte block (the
    issue's chunk size) and one that does not: the first is reported with the free's stack, the
    second has nothing (the loader's over-read is suppressed)."""
    uaf = "import ctypes; c = ctypes.CDLL(None); c.malloc.restype = ctypes.c_void_p; "
    uaf += "p = c.malloc(24); c.free(ctypes.c_void_p(p)); ctypes.memset(p, 1, 8)"
    for name, code in (("bad", uaf), ("good", "import ctypes; ctypes.CDLL(None)")):
        prefix = sp_stress.valgrind_prefix(tmp_path / name)
        assert prefix[:2] == ["--no-python", "valgrind"] and prefix[-1] == sys.executable
        subprocess.run([*prefix[1:], "-c", code], check=True, timeout=300)  # valgrind ... python -c
    bad = sp_stress.memcheck_errors(sorted(tmp_path.glob("bad.memcheck.*")))
    assert bad and "Invalid write of size 8" in bad[0]
    assert any("free'd" in ln for ln in bad)
    assert sp_stress.memcheck_errors(sorted(tmp_path.glob("good.memcheck.*"))) == []


def test_chaos_preloads_its_library_before_the_checks_and_tells_asan(tmp_path):
    args = sp_stress.parse_args(["--out", str(tmp_path), "--chaos", "4:100000"])
    assert args.chaos == (4, 100000)
    lib = tmp_path / "libchaos.so"
    env = sp_stress.chaos_env(lib, args.chaos, "/lib/libasan.so", "halt_on_error=1")
    assert env["LD_PRELOAD"] == f"{lib}:/lib/libasan.so"  # the delay wraps ASan's checked copy
    assert env["ASAN_OPTIONS"] == "halt_on_error=1:verify_asan_link_order=0"
    assert (env["CHAOS_EVERY"], env["CHAOS_DELAY_NS"]) == ("4", "100000")
    assert sp_stress.chaos_env(lib, (1, 1), None, None) == {
        "LD_PRELOAD": str(lib), "CHAOS_EVERY": "1", "CHAOS_DELAY_NS": "1"
    }  # fmt: skip
    for bad in ("4", "0:10", "a:b", "1:2:3"):
        with pytest.raises(SystemExit):
            sp_stress.parse_args(["--out", str(tmp_path), "--chaos", bad])
