"""Issue 46's fix: torch's gloo worker threads race on a std::string, and one worker per group ends it.

``bench/gloo_worker_race.py`` runs the ring backward's two collectives in flight on one gloo group,
with small copies slowed in the workers (``bench/chaos_memcpy.c``): on torch's default of two
workers ASan names a write into a block another worker freed, inside ``ProcessGroupGloo::runLoop``;
with miles' one worker per group nothing is reported. If torch fixes the race, the first assertion
fails: then the workaround (``miles/parallel/gloo.py``) can go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gloo_worker_race  # noqa: E402

from miles.parallel.gloo import GLOO_WORKERS_ENV, gloo_workers  # noqa: E402


@pytest.mark.skipif(gloo_worker_race.asan_library() is None, reason="needs gcc and its libasan")
def test_torchs_two_gloo_workers_write_after_free_and_one_worker_does_not(tmp_path):
    # torch's default aborts within seconds (3.5-5.6 s in docs/bench/gloo_worker_race_asan_cpu.json):
    # it gets 40 s so that a slow machine does not make the test flaky; the fix runs 8 s clean.
    runs = {}
    for arm, seconds in (("torch", "40"), ("miles", "8")):
        out = tmp_path / f"{arm}.json"
        code = gloo_worker_race.main(["--out", str(out), "--arms", arm, "--runs", "1", "--seconds", seconds])
        runs[arm] = (code, json.loads(out.read_text())["runs"][0])
    (_, torch_run), (miles_code, miles_run) = runs["torch"], runs["miles"]
    assert torch_run["crashed"], torch_run
    report = "\n".join(torch_run["report"])
    assert "heap-use-after-free" in report and "ProcessGroupGloo::runLoop" in report, report
    assert torch_run["seconds"] < 40, torch_run  # it died of the race, not of the timeout
    assert miles_code == 0 and not miles_run["crashed"], miles_run
    assert miles_run["threads"] == 1 and miles_run["works"] > 1000, miles_run


PROBE = """
import json, os
import torch, torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from miles.parallel.gloo import gloo_worker_threads
from miles.train.runtime import init_distributed
init_distributed(60.0)  # the trainer's set-up: one process, a store on a free port
group = dist.new_group([0])
explicit = ProcessGroupGloo._Options()
explicit._threads = 3
explicit._devices = [ProcessGroupGloo.create_default_device()]
own = ProcessGroupGloo(dist.HashStore(), 0, 1, explicit)
print(json.dumps([gloo_worker_threads(dist.group.WORLD), gloo_worker_threads(group), own.options._threads]))
os._exit(0)
"""


def _probe(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.pop(GLOO_WORKERS_ENV, None)
    if env_value is not None:
        env[GLOO_WORKERS_ENV] = env_value
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_every_gloo_group_the_trainer_makes_has_one_worker_and_explicit_options_stay():
    one, two = _probe(None), _probe("2")
    assert one.returncode == 0, one.stderr[-2000:]
    assert json.loads(one.stdout.splitlines()[-1]) == [1, 1, 3]  # the world, a new group, explicit options
    assert json.loads(two.stdout.splitlines()[-1]) == [2, 2, 3]  # torch's default, for the stress's arms


def test_a_bad_worker_count_is_refused_naming_the_variable(monkeypatch):
    for bad in ("0", "two", "65"):
        monkeypatch.setenv(GLOO_WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=f"{GLOO_WORKERS_ENV}=.*unset it"):
            gloo_workers()
    monkeypatch.delenv(GLOO_WORKERS_ENV)
    assert gloo_workers() == 1
