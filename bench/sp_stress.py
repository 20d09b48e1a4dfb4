"""Stress the sequence-parallel layouts for native crashes: torchrun launches in a loop, heap checks on.

    python bench/sp_stress.py --out runs/sp_stress --runs 5                  # 5 launches of each layout
    python bench/sp_stress.py --out runs/sp_stress --minutes 60 --layouts u2r2 --load 2
    python bench/sp_stress.py --out runs/sp_asan --runs 1 --check asan      # AddressSanitizer preloaded
    python bench/sp_stress.py --out runs/sp_chaos --layouts u2r2 --check perturb --chaos 4:100000 \
        --arms torch=MILES_GLOO_WORKERS=2 miles=MILES_GLOO_WORKERS=1          # issue 46, torch vs the fix

Each launch is the e2e band recipe (``configs/tiny_bands.yaml``: the tiny two-expert Wan, 4 gloo
processes, ``--deterministic-mode``) at one dp x sp layout, ``--rollouts`` rollouts, a checkpoint
and the export at the end: every phase of a run (load, rollout, the reward worker thread, training,
save, export, teardown) runs in every launch. Layouts (``bench/e2e_bands.py``'s bands):

    u2r2 (Ulysses 2 x ring 2), u4r1, u1r4 (dp1 x sp4) · dp2xu2 (dp2 x sp2) · sp1 (dp4)

Every rank runs with ``PYTHONFAULTHANDLER=1`` (the trainer also enables it itself: a fatal signal
prints every thread's Python stack) and, by ``--check``:

- ``malloc`` (default): glibc's checking allocator (``libc_malloc_debug.so`` preloaded,
  ``MALLOC_CHECK_=3``) and ``MALLOC_PERTURB_``: freed memory is overwritten, so a read after free
  gives garbage (a bitwise-different run or a crash) and a write after free or a double free
  aborts at the next check instead of much later;
- ``perturb``: ``MALLOC_PERTURB_`` alone, on glibc's own allocator (its per-thread caches, the
  ``tcache`` of the reported ``malloc(): unaligned tcache chunk detected``, stay on);
- ``asan``: ``libasan`` preloaded (gcc's), no recompilation: every ``malloc``/``free`` is tracked and
  freed blocks are quarantined; the intercepted ``memcpy``/``read``/``recv`` of uninstrumented code
  (gloo, torch) are checked against freed and out-of-bounds memory. The report goes to
  ``OUT/logs/<launch>.asan.<pid>``;
- ``memcheck``: every rank runs under valgrind's memcheck (``torchrun --no-python valgrind ...``):
  every load and store of every library (gloo, torch's kernels, Python) is checked against freed
  blocks (kept out of reuse for ``--freelist-vol`` bytes) and block bounds, with the stacks of the
  access, the free and the allocation. Valgrind runs one thread of a process at a time, so a race
  shows only if its interleaving comes up; a launch takes minutes (``--timeout`` 7200, the ranks'
  collective timeout is raised to match). Reports go to ``OUT/logs/<launch>.memcheck.<pid>``;
  glibc's dynamic loader's word-wise ``strncmp`` over-read is suppressed (``bench/valgrind.supp``)
  and uninitialised values are not tracked (torch's optimised code reports thousands);
- ``none``: as a user runs it.

``--arms NAME=KEY=VALUE ...`` runs every layout once per arm in turn, each arm's launches with its
environment variable set (e.g. ``torch=MILES_GLOO_WORKERS=2 miles=MILES_GLOO_WORKERS=1``: torch's
two gloo worker threads per group against miles' one, issue 46); the counts are per layout and
arm (``u2r2/torch``), interleaved so that both see the same machine load.

``--chaos EVERY:NS`` preloads ``bench/chaos_memcpy.c`` (built with gcc into ``OUT``) in every rank: a
copy of at most 24 bytes by a thread other than the main one sleeps NS nanoseconds one time in EVERY.
It widens the window of races between threads (issue 46's: torch's two gloo workers of one group
writing one string, ``bench/gloo_worker_race.py``) so that a launch loses them far more often than by
chance, without changing any value. ``--arms torch=MILES_GLOO_WORKERS=2 miles=MILES_GLOO_WORKERS=1``
compares torch's default against the fix.

``--load N`` keeps N busy processes running beside the launches: the reported crash came on a loaded
machine, where the ranks' threads interleave differently. ``--load-nice`` sets their niceness (19 by
default: they take only the idle CPU, so they barely preempt a rank; 0 competes with the ranks as
other users' jobs did) and ``--load-kind`` what they do: ``spin`` (a busy loop) or ``churn`` (random
bursts of 0.2-5 ms of work and sleeps of up to 2 ms, so the scheduler switches threads at many
more, random, points, as a machine shared with other test runs does).

Writes ``OUT/stress.json`` after every launch: the settings, one row per launch (layout, exit
code, seconds, the machine's 1-minute load average at its start and end, ``crashed``, the kind — ``heap`` (a glibc heap check, a double free, ASan),
``signal`` (a rank died by a signal), ``error`` (a Python exception), ``timeout`` — whether every
rank had already finished its work (a teardown failure), the first lines naming the crash, and
the faulthandler stack of the crashed rank, the sha256 of its metrics) and the counts per layout.
Deterministic mode makes every launch of a layout bitwise the same, so a passing launch whose
metrics differ from its layout's first one is counted ``diverged``: a read of freed memory
(which ``MALLOC_PERTURB_`` fills with garbage) shows up there even when nothing aborts. The log
of a crashed launch stays in ``OUT/logs``. Exit code 1 when any launch crashed or diverged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from e2e_bands import BANDS, _stable, read_metrics  # noqa: E402  (bench scripts run as files, not a package)
from gloo_worker_race import asan_library, build_chaos  # noqa: E402

DEFAULT_LAYOUTS = "u2r2,u4r1,u1r4,dp2xu2"
MALLOC_DEBUG = ("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/lib64/libc_malloc_debug.so.0")
ASAN_OPTIONS = (
    "detect_leaks=0:halt_on_error=1:abort_on_error=1:quarantine_size_mb=256:"
    "alloc_dealloc_mismatch=0:new_delete_type_mismatch=0:detect_odr_violation=0"
)
# Lines that name a native heap error (glibc's messages, ASan's report).
HEAP_PATTERNS = re.compile(
    r"malloc\(\)|free\(\)|double free|corrupted|tcache|unaligned .*chunk|malloc_consolidate|"
    r"AddressSanitizer|heap-use-after-free|heap-buffer-overflow"
)
CHECKS = ("malloc", "perturb", "asan", "memcheck", "none")
VALGRIND_SUPP = REPO / "bench" / "valgrind.supp"
# memcheck's reports that name a heap misuse (an access outside any live block, a bad free).
MEMCHECK_ERROR = re.compile(
    r"^==\d+== (Invalid (read|write|free)|Mismatched free|Source and destination overlap)"
)
SIGNAL_PATTERNS = re.compile(r"Fatal Python error|Signal \d+ \(SIG\w+\)|exitcode\s*:\s*-\d+|terminate called")
# What each --load process runs.
LOAD_KINDS = {
    "spin": "import itertools\nfor _ in itertools.count(): pass",
    "churn": (
        "import random, time\nrng = random.Random()\nwhile True:\n"
        "    end = time.perf_counter() + rng.uniform(2e-4, 5e-3)\n"
        "    while time.perf_counter() < end: pass\n"
        "    time.sleep(rng.uniform(0, 2e-3))"
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (stress.json, logs, runs)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated bands of bench/e2e_bands.py")
    p.add_argument("--runs", type=int, default=3, help="launches per layout (taken in turn)")
    p.add_argument("--minutes", type=float, default=None, help="start no launch after this many minutes")
    p.add_argument("--rollouts", type=int, default=2, help="rollouts per launch (2 optimizer steps each)")
    p.add_argument("--prompts", type=int, default=8, help="global prompt groups per rollout")
    p.add_argument("--check", choices=CHECKS, default="malloc", help="heap checking")
    p.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ byte (--check malloc, perturb)")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the launches")
    p.add_argument("--load-nice", type=int, default=19, help="their niceness (0: compete with the ranks)")
    p.add_argument("--load-kind", choices=LOAD_KINDS, default="spin", help="spin, or churn (work and sleep)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=None, help="seconds per launch (900; 7200 for memcheck)")
    p.add_argument("--keep-logs", action="store_true", help="keep the logs of passing launches too")
    p.add_argument(
        "--arms", nargs="+", default=[], metavar="NAME=KEY=VALUE", help="launch each layout once per arm"
    )
    p.add_argument("--chaos", default=None, metavar="EVERY:NS", help="slow small copies off the main thread")
    p.add_argument("extra", nargs="*", help="further train_grpo.py flags for every launch (after --)")
    args = p.parse_args(argv)
    try:
        args.arm_env = {a.split("=", 1)[0]: dict([a.split("=", 1)[1].split("=", 1)]) for a in args.arms}
    except (ValueError, IndexError):
        p.error(f"--arms takes NAME=KEY=VALUE, got {args.arms}")
    if any(not name for name in args.arm_env):
        p.error(f"--arms takes NAME=KEY=VALUE, got {args.arms}")
    known = {b[0] for b in BANDS}
    if unknown := set(args.layouts.split(",")) - known:
        p.error(f"unknown layouts {sorted(unknown)}; known: {sorted(known)}")
    if args.runs < 1 or args.rollouts < 1:
        p.error("--runs and --rollouts must be >= 1")
    if args.chaos is not None:
        try:
            args.chaos = tuple(int(v) for v in args.chaos.split(":"))
            assert len(args.chaos) == 2 and min(args.chaos) > 0
        except (ValueError, AssertionError):
            p.error(f"--chaos takes EVERY:NS (two integers > 0), got {args.chaos!r}")
    if args.timeout is None:
        args.timeout = 7200.0 if args.check == "memcheck" else 900.0
    return args


def check_env(check: str, perturb: int, log_stem: Path) -> dict[str, str]:
    """The environment variables of ``--check`` (empty for none); raises when its library is missing."""
    if check == "none":
        return {}
    if check == "memcheck":  # not an environment: the ranks' command starts valgrind (command())
        if shutil.which("valgrind") is None:
            raise SystemExit("--check memcheck needs valgrind (apt-get install valgrind)")
        return {}
    if check == "perturb":  # glibc's own allocator, tcache and all (the reported crash's)
        return {"MALLOC_PERTURB_": str(perturb)}
    if check == "malloc":
        lib = next((p for p in MALLOC_DEBUG if Path(p).exists()), None)
        env = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": str(perturb)}
        # glibc >= 2.34 reads MALLOC_CHECK_ only with its debug allocator preloaded.
        return {**env, "LD_PRELOAD": lib} if lib else env
    lib = asan_library()
    if lib is None:
        raise SystemExit(
            "--check asan needs gcc's libasan (apt-get install gcc); `gcc -print-file-name=libasan.so`"
        )
    return {
        "LD_PRELOAD": str(lib),
        "ASAN_OPTIONS": f"{ASAN_OPTIONS}:log_path={log_stem}.asan",
    }


def chaos_env(lib: Path, chaos: tuple[int, int], preload: str | None, asan: str | None) -> dict[str, str]:
    """``--chaos``: ``bench/chaos_memcpy.c`` preloaded before the check's library (ASan is told not to
    insist on coming first)."""
    env = {
        "LD_PRELOAD": ":".join([str(lib), *([preload] if preload else [])]),
        "CHAOS_EVERY": str(chaos[0]),
        "CHAOS_DELAY_NS": str(chaos[1]),
    }
    if asan:
        env["ASAN_OPTIONS"] = f"{asan}:verify_asan_link_order=0"
    return env


def valgrind_prefix(log_stem: Path) -> list[str]:
    """What runs each rank under memcheck: torchrun starts ``valgrind ... python`` (``--no-python``)."""
    return [
        "--no-python", "valgrind", "--tool=memcheck", "--num-callers=40", "--error-limit=no",
        "--fair-sched=yes", "--freelist-vol=200000000", "--undef-value-errors=no",
        f"--suppressions={VALGRIND_SUPP}", f"--log-file={log_stem}.memcheck.%p", sys.executable,
    ]  # fmt: skip


def memcheck_errors(paths: list[Path], limit: int = 40) -> list[str]:
    """The lines of every heap-misuse report in memcheck's logs (each with its stacks), [] when none."""
    out: list[str] = []
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if MEMCHECK_ERROR.match(line):
                end = next(
                    (j for j in range(i + 1, len(lines)) if lines[j].rstrip().endswith("==")), len(lines)
                )
                out += [f"{path.name}: {ln}" for ln in lines[i : min(end, i + limit)]]
    return out


def command(
    args: argparse.Namespace, sp: int, ulysses: int, name: str, log_stem: Path | None = None
) -> list[str]:
    dp = args.nproc // sp
    memcheck = args.check == "memcheck"
    prefix = valgrind_prefix(log_stem or args.out / "logs" / name) if memcheck else []
    # Ranks under valgrind run 20-50x slower: a rank waits for the others far longer than usual.
    slow = ["--run.collective-timeout-s", str(int(max(args.timeout, 600)))] if memcheck else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        *prefix, "train_grpo.py", "--config", "configs/tiny_bands.yaml",
        "--sequence-parallel-size", str(sp), "--ulysses-degree", str(ulysses),
        "--data.prompts-per-rank", str(args.prompts // dp),
        "--train.num-rollouts", str(args.rollouts), "--train.checkpoint-every", str(args.rollouts),
        "--train.keep-checkpoints", "0", "--train.no-resume", "--deterministic-mode",
        "--run.output-dir", str(args.out / "runs"), "--run.name", name,
        "--run.wandb-mode", "disabled", "--run.no-progress", *slow, *args.extra,
    ]  # fmt: skip


def classify(rc: int, output: str, timed_out: bool) -> tuple[str, list[str]]:
    """(kind, the lines naming it): pass, heap, signal, error or timeout."""
    lines = output.splitlines()
    if timed_out:
        return "timeout", lines[-5:]
    if rc == 0:
        return "pass", []
    heap = [ln for ln in lines if HEAP_PATTERNS.search(ln)]
    if heap:
        return "heap", heap[:10]
    signal = [ln for ln in lines if SIGNAL_PATTERNS.search(ln)]
    if signal:
        return "signal", signal[:10]
    return "error", [ln for ln in lines if "Error" in ln or "Traceback" in ln][:10]


def fault_trace(output: str, limit: int = 80) -> list[str]:
    """The faulthandler report of the first rank that died by a signal (its threads' stacks)."""
    lines = output.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Fatal Python error" in ln), None)
    if start is None:
        return []
    return lines[start : start + limit]


def launch(
    args: argparse.Namespace, layout: str, sp: int, ulysses: int, index: int, arm: str | None = None
) -> dict:
    name = f"{layout}_{index:03d}" + (f"_{arm}" if arm else "")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_dir, finished = args.out / "runs" / name, args.out / "runs" / f"{name}.finished"
    for path in (run_dir, finished):
        shutil.rmtree(path, ignore_errors=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONFAULTHANDLER": "1",
        "MILES_FINISHED_DIR": str(finished),  # train_grpo.py: rank<R> once that rank's work returned 0
        **check_env(args.check, args.perturb, logs / name),
        **(args.arm_env[arm] if arm else {}),
    }
    if args.chaos:
        env.update(chaos_env(args.chaos_lib, args.chaos, env.get("LD_PRELOAD"), env.get("ASAN_OPTIONS")))
    cmd = command(args, sp, ulysses, name, logs / name)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    timed_out = False
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, timed_out = -1, True
        output = f"{e.stdout or ''}{e.stderr or ''}\n[sp_stress] timed out after {args.timeout:g}s"
    wall = time.perf_counter() - t0
    ranks_done = len(list(finished.glob("rank*"))) if finished.is_dir() else 0
    kind, lines = classify(rc, output, timed_out)
    asan_reports = sorted(str(p) for p in logs.glob(f"{name}.asan*"))
    if asan_reports and kind != "timeout":
        kind = "heap"
        lines = lines or [Path(asan_reports[0]).read_text(errors="replace").splitlines()[0]]
    memcheck = memcheck_errors(sorted(logs.glob(f"{name}.memcheck.*")))
    if memcheck and kind != "timeout":
        kind, lines = "heap", memcheck
    crashed = kind != "pass"
    metrics = read_metrics(run_dir)
    digest = hashlib.sha256(json.dumps([_stable(r) for r in metrics], sort_keys=True).encode()).hexdigest()
    log = logs / f"{name}.log"
    if crashed or args.keep_logs:
        log.write_text(" ".join(cmd) + "\n\n" + output)
    if not crashed:
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(finished, ignore_errors=True)
    return {
        "layout": f"{layout}/{arm}" if arm else layout,
        "arm": arm,
        "index": index,
        "returncode": rc,
        "wall_s": round(wall, 1),
        "loadavg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],  # at the start and the end
        "crashed": crashed,
        "kind": kind,
        "metrics_sha256": digest[:16] if metrics and not crashed else None,
        "ranks_finished": ranks_done,  # == nproc on a crash: it came at teardown, after the work
        "lines": lines,
        "fault_trace": fault_trace(output) if crashed else [],
        "asan_reports": asan_reports,
        "log": str(log) if crashed or args.keep_logs else None,
    }


def mark_diverged(rows: list[dict]) -> None:
    """A passing launch whose metrics differ from its layout's first passing launch: ``diverged``
    (deterministic mode makes every launch of a layout bitwise the same; a read of freed memory,
    which ``MALLOC_PERTURB_`` fills with garbage, shows up here even when nothing aborts)."""
    first: dict[str, str] = {}
    for r in rows:
        if r["metrics_sha256"] is None:
            continue
        ref = first.setdefault(r["layout"].split("/")[0], r["metrics_sha256"])  # every arm alike
        r["diverged"] = r["metrics_sha256"] != ref


def summarize(rows: list[dict], layouts: list[str]) -> dict:
    mark_diverged(rows)
    per = {}
    for layout in layouts:
        mine = [r for r in rows if r["layout"] == layout]
        per[layout] = {
            "runs": len(mine),
            "crashes": sum(r["crashed"] for r in mine),
            "heap": sum(r["kind"] == "heap" for r in mine),
            "diverged": sum(bool(r.get("diverged")) for r in mine),
            "mean_wall_s": round(sum(r["wall_s"] for r in mine) / len(mine), 1) if mine else None,
        }
    total = {k: sum(v[k] for v in per.values()) for k in ("runs", "crashes", "heap", "diverged")}
    return {"layouts": per, "total": total}


def start_load(n: int, nice: int = 19, kind: str = "spin") -> list[subprocess.Popen]:
    cmd = ["nice", "-n", str(nice), sys.executable, "-c", LOAD_KINDS[kind]]
    return [subprocess.Popen(cmd) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    layouts = args.layouts.split(",")
    arms = list(args.arm_env) or [None]
    keys = [f"{layout}/{arm}" if arm else layout for layout in layouts for arm in arms]
    bands = {b[0]: b for b in BANDS}
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("out", "chaos_lib")
    }
    settings["env"] = {k: v for k, v in check_env(args.check, args.perturb, Path("<log>")).items()}
    settings["cpus"] = os.cpu_count()
    rows: list[dict] = []
    args.chaos_lib = build_chaos(args.out) if args.chaos else None
    # SIGTERM (kill, a scheduler) ends like Ctrl-C: the launch in flight and the load processes are killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = start_load(args.load, args.load_nice, args.load_kind)
    t_start = time.monotonic()
    try:
        for index in range(args.runs):
            for layout, arm in [(layout, arm) for layout in layouts for arm in arms]:
                if args.minutes is not None and time.monotonic() - t_start > 60 * args.minutes:
                    break
                _, sp, ulysses = bands[layout]
                row = launch(args, layout, sp, ulysses, index, arm)
                rows.append(row)
                note = (
                    f" ({row['kind']}: {row['lines'][0] if row['lines'] else ''})" if row["crashed"] else ""
                )
                print(
                    f"[sp_stress] {row['layout']} #{index}: rc {row['returncode']}, {row['wall_s']} s{note}",
                    flush=True,
                )
                summary = {"settings": settings, **summarize(rows, keys), "runs": rows}
                (args.out / "stress.json").write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        for p in load:
            p.kill()
            p.wait()
    summary = summarize(rows, keys)
    for layout, v in summary["layouts"].items():
        print(
            f"[sp_stress] {layout}: {v['crashes']} crash(es) ({v['heap']} heap), {v['diverged']} diverged, "
            f"in {v['runs']} launches"
        )
    print(f"[sp_stress] wrote {args.out / 'stress.json'}")
    return 1 if summary["total"]["crashes"] or summary["total"]["diverged"] else 0


if __name__ == "__main__":
    sys.exit(main())
