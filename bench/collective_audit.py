"""Audit every collective of a real launch for memory-lifetime hazards (issue 46's heap corruption).

    python bench/collective_audit.py --out runs/collective_audit --layout u2r2 --rollouts 2

Launches the band recipe (``bench/sp_stress.py``'s launch: 4 gloo processes, a checkpoint and the
export) with a hook installed in every rank before anything imports torch.distributed (a generated
``sitecustomize``). The hook wraps every collective of ``torch.distributed`` (FSDP2's, DCP's, the
Ulysses all-to-alls, miles' own) and of ``torch.distributed._functional_collectives`` (the ring
attention templates' K/V all-gather and dK/dV permute) and records, per rank:

- the calls per collective, and which thread made them: gloo runs one group's collectives in the
  order they are issued, so two threads issuing on one group at once would interleave their
  messages (a ``thread`` finding is any collective issued off the main thread);
- every tensor argument that is not contiguous (gloo reads and writes the raw buffer; ``noncontiguous``);
- every ``async_op=True`` call and whether its ``Work`` was waited (``Work.wait`` is wrapped;
  ``unwaited``: a work nobody waited, whose tensors the caller may have reused or freed while gloo
  still read or wrote them);
- every asynchronous functional-collective result (``AsyncCollectiveTensor``): how many, how many
  waits, the most works in flight at once (c10d's work registry: a work is registered when issued
  and removed when waited) and how many were never waited by the end (``act_dropped``);
- the call sites (first frame outside torch) of each kind.

Writes ``OUT/audit.json`` (per rank and the findings in all) and exits 1 when there is a finding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

HOOK = r"""
import atexit, collections, json, os, sys, threading, traceback, weakref

def _install():
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed._functional_collectives as ft_c

    stats = collections.defaultdict(lambda: collections.Counter())
    findings = []
    works = []  # (work, site, state dict)
    acts = {"created": 0, "waited": 0, "registry_max": 0, "registry_at_end": None}
    main = threading.main_thread()
    lock = threading.Lock()

    def site():
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/torch/" not in frame.filename and "sitecustomize" not in frame.filename:
                return f"{os.path.relpath(frame.filename)}:{frame.lineno} {frame.name}"
        return "?"

    def tensors(args, kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from (t for t in a if isinstance(t, torch.Tensor))

    def note(kind, name, extra=""):
        with lock:
            if sum(f["kind"] == kind for f in findings) < 50:
                findings.append({"kind": kind, "op": name, "site": site(), "extra": extra})

    def check(name, args, kwargs):
        stats[name]["calls"] += 1
        th = threading.current_thread()
        stats[name][f"thread:{th.name}"] += 1
        if th is not main:
            note("thread", name, th.name)
        for t in tensors(args, kwargs):
            if not t.is_contiguous():
                note("noncontiguous", name, f"{tuple(t.shape)} stride {t.stride()}")

    def wrap_dist(name, fn):
        def inner(*args, **kwargs):
            check(name, args, kwargs)
            out = fn(*args, **kwargs)
            if kwargs.get("async_op") and out is not None:
                stats[name]["async"] += 1
                works.append((weakref.ref(out) if hasattr(out, "__weakref__") else out, name, site(), {"waited": False}))
                _WAITED[id(out)] = works[-1][3]
            return out
        inner._miles_audit = True
        return inner

    _WAITED = {}
    Work = torch._C._distributed_c10d.Work
    real_wait = Work.wait
    def wait(self, *a, **k):
        state = _WAITED.get(id(self))
        if state is not None:
            state["waited"] = True
        return real_wait(self, *a, **k)
    try:
        Work.wait = wait
    except (TypeError, AttributeError):
        stats["_meta"]["work_wait_unhooked"] += 1

    import inspect
    def takes_async_op(fn):
        try:
            return "async_op" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False
    # every collective of c10d (all that take async_op), the object ones and the point-to-point ones
    names = sorted({n for n in c10d.__all__ if takes_async_op(getattr(c10d, n, None))} | {
        "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
        "send", "recv", "isend", "irecv", "batch_isend_irecv", "monitored_barrier",
        "send_object_list", "recv_object_list"})
    for name in names:
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            if fn is not None and not getattr(fn, "_miles_audit", False):
                setattr(mod, name, wrap_dist(name, fn))
            elif fn is not None:
                setattr(mod, name, getattr(dist, name))

    ACT = ft_c.AsyncCollectiveTensor
    registry = torch._C._distributed_c10d._get_work_registry_size
    real_wait_tensor = ft_c.wait_tensor
    def wait_tensor(tensor):
        acts["waited"] += 1
        return real_wait_tensor(tensor)
    ft_c.wait_tensor = wait_tensor  # ACT.wait and ACT.trigger_wait call it

    depth = threading.local()
    def wrap_funcol(name, fn):
        def inner(*args, **kwargs):
            outer = not getattr(depth, "n", 0)  # permute_tensor calls all_to_all_single: count it once
            depth.n = getattr(depth, "n", 0) + 1
            try:
                if outer:
                    check("funcol." + name, args, kwargs)
                out = fn(*args, **kwargs)
            finally:
                depth.n -= 1
            if outer and isinstance(out, ACT):
                acts["created"] += 1
                acts["registry_max"] = max(acts["registry_max"], registry())
            return out
        inner._miles_audit = True
        return inner

    for name in ("all_gather_tensor", "all_gather_tensor_autograd", "all_to_all_single",
                 "all_to_all_single_autograd", "permute_tensor", "all_reduce", "reduce_scatter_tensor",
                 "all_gather_single", "broadcast"):
        fn = getattr(ft_c, name, None)
        if fn is not None:
            setattr(ft_c, name, wrap_funcol(name, fn))

    def report():
        unwaited = []
        for _ref, name, where, state in works:
            if not state["waited"]:
                unwaited.append({"op": name, "site": where})
        for u in unwaited[:50]:
            findings.append({"kind": "unwaited", "op": u["op"], "site": u["site"], "extra": ""})
        acts["registry_at_end"] = registry()
        if acts["registry_at_end"]:
            findings.append({"kind": "act_dropped", "op": "funcol", "site": "",
                             "extra": f"{acts['registry_at_end']} functional-collective works never waited"})
        out = os.environ.get("MILES_AUDIT_OUT")
        if out:
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": int(rank), "stats": {k: dict(v) for k, v in stats.items()},
                           "async_works": len(works), "funcol": acts, "findings": findings}, f, indent=1)

    real_exit = os._exit
    def _exit(code):
        try:
            report()
        finally:
            real_exit(code)
    os._exit = _exit
    atexit.register(report)

if os.environ.get("MILES_AUDIT_OUT") and "RANK" in os.environ:
    _install()
"""


def write_hook(folder: Path) -> Path:
    """The ``sitecustomize.py`` that installs the audit in a process started with ``folder`` first on
    ``PYTHONPATH`` and ``MILES_AUDIT_OUT`` (where each rank writes ``rank<R>.json``) and ``RANK`` set."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder


def collect(ranks_dir: Path) -> tuple[list[dict], list[dict], dict[str, int]]:
    """(each rank's report, every finding with its rank, calls per collective over all ranks)."""
    ranks = [json.loads(f.read_text()) for f in sorted(ranks_dir.glob("rank*.json"))]
    findings = [dict(f, rank=r["rank"]) for r in ranks for f in r["findings"]]
    calls: dict[str, int] = {}
    for r in ranks:
        for op, counts in r["stats"].items():
            calls[op] = calls.get(op, 0) + counts.get("calls", 0)
    return ranks, findings, dict(sorted(calls.items()))


def main(argv: list[str] | None = None) -> int:
    import sp_stress  # noqa: E402  (bench scripts run as files)
    from e2e_bands import BANDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layout", default="u2r2", choices=[b[0] for b in BANDS])
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.extra = []
    out = args.out.resolve()
    args.out = out
    hook_dir, ranks_dir = out / "hook", out / "ranks"
    for d in (hook_dir, ranks_dir):
        d.mkdir(parents=True, exist_ok=True)
    for f in ranks_dir.glob("rank*.json"):
        f.unlink()
    shutil.rmtree(out / "runs", ignore_errors=True)
    write_hook(hook_dir)
    _, sp, ulysses = {b[0]: b for b in BANDS}[args.layout]
    cmd = sp_stress.command(args, sp, ulysses, f"audit_{args.layout}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MILES_AUDIT_OUT": str(ranks_dir),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    (out / "launch.log").write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
    ranks, findings, calls = collect(ranks_dir)
    summary = {
        "layout": args.layout,
        "rollouts": args.rollouts,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "ranks_reported": len(ranks),
        "calls_all_ranks": calls,
        "async_works_all_ranks": sum(r["async_works"] for r in ranks),
        "funcol_all_ranks": {k: sum(r["funcol"][k] for r in ranks) for k in ("created", "waited")},
        "funcol_in_flight_max": max((r["funcol"]["registry_max"] for r in ranks), default=None),
        "findings": findings,
        "ranks": ranks,
    }
    (out / "audit.json").write_text(json.dumps(summary, indent=1) + "\n")
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
    print(
        f"[collective_audit] {args.layout}: rc {proc.returncode}, {wall:.0f} s, {len(ranks)} ranks reported, "
        f"{sum(calls.values())} collectives, {len(findings)} findings -> {out / 'audit.json'}"
    )
    return 1 if findings or proc.returncode != 0 or len(ranks) != args.nproc else 0


if __name__ == "__main__":
    sys.exit(main())
