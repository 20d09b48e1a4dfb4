"""Issue 46's heap corruption, reproduced in one process: torch's gloo worker threads race on a string.

    python bench/gloo_worker_race.py --out runs/gloo_race.json              # torch's default vs miles'
    python bench/gloo_worker_race.py --out X --check perturb --seconds 60   # glibc's allocator, no ASan

**The defect (torch 2.13, ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``).** A gloo process
group runs its collectives on ``Options::threads`` worker threads, 2 by default. After each
collective, ``ProcessGroupGloo::runLoop`` records it in the group's status —
``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)`` — after releasing
``workMutex_``, so two workers that finish at the same time assign one ``std::string`` at once. The
ring attention's backward has exactly that: the K/V all-gather (``ALLGATHER_COALESCED``, 19
characters: a heap buffer) and the dK/dV permute (``ALLTOALL``, 8: stored in place) in flight
together on one group. One worker swaps its new heap buffer in and frees the old one while the other
copies ``ALLTOALL`` into the old one it had already read: a write into a freed 32-byte chunk
of the first worker's tcache, which aborts that worker at its next small allocation with
``malloc(): unaligned tcache chunk detected`` — the crash of issue 46, in a gloo worker of the ring
group, beside the ring backward. helgrind (``valgrind --tool=helgrind``) reports the race on a real
u2r2 launch; this bench shows the write after free.

**What it runs.** One process, a gloo group of one rank (``dist.init_process_group`` on a
``HashStore``), and in a loop the ring backward's pair of collectives, 8 pairs in flight, then the
waits. Each arm is a fresh process (``--runs`` each):

- ``torch``: torch's default, 2 worker threads per gloo group;
- ``miles``: after :func:`miles.parallel.gloo.one_worker_per_gloo_group`, what every miles process
  runs (1 worker thread per gloo group).

By ``--check``: ``asan`` (default; gcc's libasan preloaded: its ``memcpy`` interceptor names a write
into a freed block, with the stacks of the write, the free and the allocation) or ``perturb``
(glibc's own allocator, ``MALLOC_PERTURB_``, as the crash ran). ``--chaos EVERY:NS`` preloads
``bench/chaos_memcpy.c`` (built with gcc): a copy of at most 24 bytes by a non-main thread sleeps NS
nanoseconds one time in EVERY, which widens the race's window (``0:0`` turns it off).

Writes ``--out`` (JSON): the settings and, per arm, every run's exit code, works done, seconds,
whether it crashed and the report's first lines. Exit code 1 when the ``miles`` arm crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHAOS_SOURCE = REPO / "bench" / "chaos_memcpy.c"
ASAN_OPTIONS = (
    "verify_asan_link_order=0:detect_leaks=0:halt_on_error=1:alloc_dealloc_mismatch=0:"
    "new_delete_type_mismatch=0:detect_odr_violation=0"
)
REPORT = re.compile(
    r"AddressSanitizer|malloc\(\)|free\(\)|double free|corrupted|tcache|Segmentation fault|Fatal Python error|"
    r"hung: timed out"
)
ARMS = ("torch", "miles")


def child(arm: str, seconds: float, pairs: int) -> None:
    """One arm's process: the ring backward's two collectives, ``pairs`` of each in flight, in a loop."""
    import torch
    import torch.distributed as dist

    if arm == "miles":
        from miles.parallel.gloo import one_worker_per_gloo_group

        one_worker_per_gloo_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    xs = [torch.ones(4) for _ in range(pairs)]
    works, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pending = []
        for x in xs:  # ALLGATHER_COALESCED (a heap string), then ALLTOALL (an in-place one)
            pending.append(backend.allgather_coalesced([[torch.empty(4)]], [x]))
            pending.append(backend.alltoall_base(torch.empty(4), x, [], []))
        for work in pending:
            work.wait()
        works += len(pending)
    print(json.dumps({"threads": backend.options._threads, "works": works}), flush=True)
    os._exit(0)  # no interpreter finalization with gloo's threads alive (pytorch/pytorch#179291)


def asan_library() -> Path | None:
    """gcc's ``libasan.so`` (resolved), or None when gcc or its libasan is missing."""
    try:
        found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    lib = Path(found.stdout.strip())
    return lib.resolve() if found.returncode == 0 and lib.is_absolute() and lib.exists() else None


def build_chaos(directory: Path) -> Path:
    lib = directory / "libchaos.so"
    cmd = ["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(CHAOS_SOURCE), "-ldl"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


def arm_env(check: str, chaos: tuple[int, int], chaos_lib: Path | None) -> dict[str, str]:
    """The environment of one run: the allocator check and the chaos library, preloaded in that order
    (ASan's runtime is told not to insist on coming first)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    preload = [str(chaos_lib)] if chaos_lib else []
    if check == "asan":
        lib = asan_library()
        if lib is None:
            raise SystemExit("--check asan needs gcc's libasan (apt-get install gcc)")
        preload.append(str(lib))
        env["ASAN_OPTIONS"] = ASAN_OPTIONS
    else:
        env["MALLOC_PERTURB_"] = "90"
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["CHAOS_EVERY"], env["CHAOS_DELAY_NS"] = (str(v) for v in chaos)
    return env


def run_arm(arm: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        arm,
        "--seconds",
        str(args.seconds),
        "--pairs",
        str(args.pairs),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.seconds * 4 + 120)
    except subprocess.TimeoutExpired as e:  # a hang (e.g. a worker dead in a lock) is a failure too
        proc = subprocess.CompletedProcess(cmd, -1, str(e.stdout or ""), f"{e.stderr or ''}\nhung: timed out")
    out = proc.stdout + proc.stderr
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    done = json.loads(last[-1]) if last else {}
    report = [ln.strip() for ln in out.splitlines() if REPORT.search(ln) or "runLoop" in ln][:12]
    return {
        "arm": arm,
        "returncode": proc.returncode,
        "crashed": proc.returncode != 0,
        "threads": done.get("threads"),
        "works": done.get("works"),
        "seconds": round(time.perf_counter() - t0, 1),
        "report": report,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON with every run")
    p.add_argument("--arms", default="torch,miles", help=f"comma-separated, of {ARMS}")
    p.add_argument("--runs", type=int, default=3, help="processes per arm, taken in turn")
    p.add_argument("--seconds", type=float, default=20.0, help="loop time per process")
    p.add_argument("--pairs", type=int, default=8, help="collective pairs in flight")
    p.add_argument("--check", choices=("asan", "perturb"), default="asan")
    p.add_argument("--chaos", default="4:100000", metavar="EVERY:NS", help="copy delays (0:0: none)")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.chaos = tuple(int(v) for v in args.chaos.split(":"))
        assert len(args.chaos) == 2 and min(args.chaos) >= 0
    except (ValueError, AssertionError):
        p.error(f"--chaos takes EVERY:NS (two integers >= 0), got {args.chaos!r}")
    args.arms = args.arms.split(",")
    if unknown := set(args.arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; known: {list(ARMS)}")
    if args.child is None and args.out is None:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.seconds, args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        chaos_lib = build_chaos(Path(tmp)) if args.chaos[0] and args.chaos[1] else None
        env = arm_env(args.check, args.chaos, chaos_lib)
        rows = []
        for index in range(args.runs):
            for arm in args.arms:
                row = {"index": index, **run_arm(arm, args, env)}
                rows.append(row)
                note = f" ({row['report'][0]})" if row["crashed"] and row["report"] else ""
                print(
                    f"[gloo_worker_race] {arm} #{index}: rc {row['returncode']}, {row['works']} works{note}"
                )
    arms = {a: {"runs": sum(r["arm"] == a for r in rows), "crashed": sum(r["crashed"] for r in rows if r["arm"] == a)}
            for a in args.arms}  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "child")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "arms": arms, "runs": rows}, indent=2) + "\n")
    print(f"[gloo_worker_race] {arms}; wrote {args.out}")
    return 1 if arms.get("miles", {}).get("crashed") else 0


if __name__ == "__main__":
    sys.exit(main())
