"""Several training runs in one torchrun launch: the e2e tests' way to pay the start-up once.

A torchrun launch of the tiny recipe spends most of its time starting (4 processes importing torch,
diffusers and transformers on 2 cores: ~15 s unloaded, 40 s on a busy machine) and a few seconds
training. ``launch_runs`` starts ONE launch of this file, which calls ``train_grpo.main`` — the
user's entry point: config parsing, warnings, the Trainer, its error handling — once per run, in
order, on the same process group (``main`` would destroy the group after each run, and a group
cannot be re-created under torchrun's store, so here it is kept until the last run is done; the
run's own groups, its mesh's, are destroyed: ``tests/dist_utils.release_subgroups``). Between runs
the process-wide switches a run sets are put back: deterministic algorithms, Inductor's
deterministic flag, Dynamo's caches, the default RNG.

Rank 0 writes ``[multi_run] begin NAME`` / ``[multi_run] end NAME`` to stdout and stderr around each
run; ``launch_runs`` cuts the output there, so each test reads its own run's log. A run that fails
ends the launch (its exit status is the launch's): the runs after it do not start. Runs whose
results must not share a process (a resume after a crash, a double run for bitwise equality) go in
separate launches.

    torchrun --standalone --nproc-per-node 4 tests/e2e/multi_run.py SPEC.json
    (SPEC.json: [{"name": ..., "argv": [train_grpo.py flags]}, ...])
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "[multi_run] begin ", "[multi_run] end "


@dataclass
class Run:
    name: str
    run_dir: Path
    stdout: str  # this run's part of the launch's stdout (rank 0's markers delimit it)
    stderr: str

    @property
    def seconds(self) -> float:
        """Wall time of the run inside the launch (rank 0, from its start to every rank's end)."""
        return float(re.search(rf"^\[multi_run\] {re.escape(self.name)} took (\S+) s$", self.stdout, re.M)[1])

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _segment(text: str, name: str) -> str:
    start = text.find(f"{BEGIN}{name}\n")
    end = text.find(f"{END}{name}\n", start)
    assert start >= 0 and end >= 0, f"run {name} did not finish in the launch:\n{text[-3000:]}"
    return text[start:end]


def launch_runs(
    root: Path,
    runs: dict[str, list[str]],
    *,
    nproc: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
    copies: dict[str, list[tuple[Path, Path]]] | None = None,
) -> dict[str, Run]:
    """One torchrun launch of ``nproc`` processes running ``train_grpo.py <flags> --run.output-dir
    root --run.name NAME`` for each ``NAME: flags`` of ``runs``, in order. ``copies[NAME]``: folders
    copied (``src``, ``dst``) just before run NAME starts, after the runs before it (a checkpoint an
    earlier run of the launch saved, to resume from in a fresh run folder). Asserts the launch
    succeeded; a failure after every rank had finished (a teardown abort) is retried once, from
    the run directories as they were before the launch."""
    from tests.dist_utils import FINISHED_ENV, may_retry

    root.mkdir(parents=True, exist_ok=True)
    spec = [
        {
            "name": name,
            "argv": [*flags, "--run.output-dir", str(root), "--run.name", name],
            "copies": [[str(src), str(dst)] for src, dst in (copies or {}).get(name, [])],
        }
        for name, flags in runs.items()
    ]
    spec_file = Path(tempfile.mkstemp(prefix="multi_run_", suffix=".json", dir=root)[1])
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", "0", str(Path(__file__)), str(spec_file)]
    # Unbuffered: every rank's lines of a run reach the pipe before rank 0 writes the run's end.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    for hook in ("MILES_FAULT_KILL", "MILES_FAULT_SIGNAL"):  # testing hooks reach only the runs that ask
        if hook not in (env or {}):
            full_env.pop(hook, None)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    backup = Path(tempfile.mkdtemp(prefix="before_", dir=root))  # run folders a run resumes from
    for name in runs:
        if (root / name).exists():
            shutil.copytree(root / name, backup / name)
    for attempt in range(2):
        full_env[FINISHED_ENV] = tempfile.mkdtemp(prefix="finished_", dir=root)
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)
        output = proc.stdout + proc.stderr
        if attempt or not may_retry(
            proc.returncode, full_env[FINISHED_ENV], nproc, f"runs {list(runs)}", output
        ):
            break
        for name in runs:
            shutil.rmtree(root / name, ignore_errors=True)
            if (backup / name).exists():
                shutil.copytree(backup / name, root / name)
    shutil.rmtree(backup, ignore_errors=True)
    assert proc.returncode == 0, (
        f"launch of {list(runs)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    return {
        name: Run(name, root / name, _segment(proc.stdout, name), _segment(proc.stderr, name))
        for name in runs
    }


# --- the launched side ------------------------------------------------------------------------------


def _say(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        for stream in (sys.stdout, sys.stderr):
            print(text, file=stream, flush=True)


def _switches() -> tuple:
    import torch
    from torch._inductor import config as inductor_config

    return torch.are_deterministic_algorithms_enabled(), getattr(inductor_config, "deterministic", None)


def _reset(switches: tuple, seed: int) -> None:
    """Put back the process-wide switches a run sets (Trainer's deterministic mode, compile)."""
    import torch
    from torch._inductor import config as inductor_config

    torch.use_deterministic_algorithms(switches[0])
    if switches[1] is not None:
        inductor_config.deterministic = switches[1]
    torch._dynamo.reset()
    torch.manual_seed(seed)


def _main(spec_file: str) -> int:
    import torch
    import torch.distributed as dist

    import train_grpo
    from tests.dist_utils import KeepGroup

    train_grpo.dist = KeepGroup()
    switches, seed = _switches(), torch.initial_seed()
    for run in json.loads(Path(spec_file).read_text()):
        if os.environ.get("RANK", "0") == "0":
            for src, dst in run["copies"]:
                shutil.copytree(src, dst)
        if dist.is_initialized():  # (before the first run, main's group start waits for rank 0)
            dist.barrier()  # no rank starts before the copies are there
        _say(f"{BEGIN}{run['name']}")
        t0 = time.perf_counter()
        code = train_grpo.main(run["argv"])
        if code != 0:
            return code
        if not dist.is_initialized():  # it cannot be re-created under torchrun: the next run would hang
            raise RuntimeError("train_grpo.main destroyed the process group: keep it as train_grpo.dist")
        dist.barrier()
        _say(f"[multi_run] {run['name']} took {time.perf_counter() - t0:.1f} s")
        _say(f"{END}{run['name']}")
        _reset(switches, seed)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    code = _main(sys.argv[1])
    if code == 0 and (finished := os.environ.get("MILES_FINISHED_DIR")):
        os.makedirs(finished, exist_ok=True)
        open(os.path.join(finished, f"rank{os.environ.get('RANK', '0')}"), "w").close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train_grpo.py: no interpreter finalization with gloo threads alive
