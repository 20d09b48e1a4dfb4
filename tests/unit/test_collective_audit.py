"""bench/collective_audit.py's hook finds the memory-lifetime hazards it reports on (issue 46).

Two gloo processes run, with the hook installed, clean collectives (main thread, contiguous,
waited), then a collective from a second thread, one on a non-contiguous tensor, an ``async_op=True``
work never waited and a functional collective never waited: each of the four is reported, at its
line, and the clean ones are not. The audit of a real launch
(``docs/bench/collective_audit_cpu.json``) is only as good as this.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import collective_audit  # noqa: E402  (bench scripts run as files)

SCRIPT = """
import os, sys, threading, torch, torch.distributed as dist
import torch.distributed._functional_collectives as ft_c
dist.init_process_group("gloo")
x = torch.ones(4, 4)
dist.all_reduce(x)                                   # clean: main thread, contiguous, synchronous
ft_c.wait_tensor(ft_c.all_reduce(x, "sum", dist.group.WORLD))
dist.all_reduce(torch.ones(2), async_op=True).wait()
t = threading.Thread(target=lambda: dist.all_reduce(torch.ones(3)), name="side")  # line 9: off the main thread
t.start(); t.join()
dist.all_reduce(torch.ones(4, 4).t()[:, :2])         # line 11: a non-contiguous view
work = dist.all_reduce(torch.ones(5), async_op=True) # line 12: never waited
y = ft_c.all_reduce(torch.ones(6), "sum", dist.group.WORLD)   # never waited
dist.barrier()
os._exit(0)  # the hook reports first; the unwaited works must not meet teardown (gloo can abort there)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path) -> tuple[list[dict], dict[str, int]]:
    hook = collective_audit.write_hook(tmp_path / "hook")
    out = tmp_path / "ranks"
    out.mkdir()
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "MILES_AUDIT_OUT": str(out),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    ranks, findings, calls = collective_audit.collect(out)
    assert len(ranks) == 2
    return findings, calls


def test_the_audit_reports_each_hazard_and_nothing_on_clean_use(tmp_path):
    findings, calls = _run(tmp_path)
    assert calls["all_reduce"] == 2 * 5 and calls["funcol.all_reduce"] == 2 * 2 and calls["barrier"] == 2
    kinds = {}
    for f in findings:
        kinds.setdefault(f["kind"], set()).add(f["rank"])
    assert kinds == {k: {0, 1} for k in ("thread", "noncontiguous", "unwaited", "act_dropped")}, findings
    lines = {f["kind"]: f["site"].split(" ")[0] for f in findings}
    # act_dropped is counted at the end (c10d's registry still holds the work), with no line
    assert lines == {"thread": "<string>:9", "noncontiguous": "<string>:11", "unwaited": "<string>:12",
                     "act_dropped": ""}, findings  # fmt: skip
    assert next(f for f in findings if f["kind"] == "thread")["extra"] == "side"
    assert len(findings) == 2 * 4, findings  # one of each kind per rank: the clean calls gave none
