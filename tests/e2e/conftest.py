"""Training runs that the e2e modules read, launched once per session.

A module that lists its runs in ``SHARED_RUNS`` (``{nproc: {name: train_grpo.py flags}}``, or a
function returning that) gets them from the fixture ``shared_runs``: the runs of every collected
module with that attribute go through one torchrun launch per process count
(``tests/e2e/multi_run.py``), so ``make test`` pays each launch's start-up once, and a module run
alone (``pytest tests/e2e/test_export.py``) launches only its own runs. Names are unique across
modules; runs that must not share a process with others (a resume after a crash, the second run
of a double run) are launched by their tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.multi_run import Run, launch_runs

# Runs without their own --run.wandb-mode log to wandb offline (tests/e2e/test_train.py checks it).
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    """The folder of the shared runs (``<shared_root>/<name>``)."""
    return tmp_path_factory.mktemp("shared") / "runs"


@pytest.fixture(scope="session")
def shared_runs(request, shared_root) -> dict[str, Run]:
    modules = {item.module.__name__: item.module for item in request.session.items}
    by_nproc: dict[int, dict[str, list[str]]] = {}
    for _, module in sorted(modules.items()):
        runs = getattr(module, "SHARED_RUNS", None)
        for nproc, named in (runs() if callable(runs) else runs or {}).items():
            clash = named.keys() & by_nproc.setdefault(nproc, {}).keys()
            assert not clash, f"{module.__name__}: run names {sorted(clash)} are taken"
            by_nproc[nproc].update(named)
    done: dict[str, Run] = {}
    for nproc, runs in sorted(by_nproc.items()):
        done.update(launch_runs(shared_root, runs, nproc=nproc, env=ENV, timeout_s=3600))
    return done
