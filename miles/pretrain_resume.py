"""A pretraining run that stops at a time budget and continues where it stopped.

``miles.pretrain_world`` (and through it ``miles.pretrain_world_81``) trains in stages — the VAE,
the latents, the prior, the save, the evaluation — each of its loops asking :meth:`Resumable.due`
before every step. When the budget (``--max-minutes``) is spent, or a SIGTERM arrived (``timeout``,
a scheduler), the loop hands its full state to :meth:`Resumable.pause`: the stage, the step, the
model and optimizer, every random generator (numpy's, the CPU generators, torch's global CPU and
CUDA states) and whatever the later stages need (the trained VAE's weights), written atomically
(a temporary file, fsync, rename) to ``STATE_DIR/state.pt``; the process then exits with
:data:`PAUSED_EXIT` (75, ``EX_TEMPFAIL``). The same command run again loads it and continues: on CPU
the result is bitwise that of one uninterrupted run (``tests/unit/test_pretrain_resume.py``); on a
GPU, to the nondeterminism of its kernels.

What is not saved is recomputed on resume, deterministically: the rendered pools, the encoded
latents (81-frame latents are 3.2 GB: re-encoding costs seconds, carrying them would not fit a
64 MiB carry), the text embeddings. A state written under another configuration is refused by
name (the fields that differ) rather than continued.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

PAUSED_EXIT = 75
"""Exit status of a run paused at its budget: run the same command again to continue it."""
_VERSION = 1


class Paused(Exception):
    """Raised by :meth:`Resumable.pause` once the state is on disk."""

    def __init__(self, stage: str, step: int, path: Path):
        super().__init__(f"paused in stage {stage!r} at step {step}; the state is in {path}")
        self.stage, self.step, self.path = stage, step, path


class Budget:
    """When a launch must stop: after ``seconds`` of wall time, at a SIGTERM, or (tests) after
    ``steps`` calls of :meth:`spent` — a deterministic cut at a chosen step."""

    def __init__(self, seconds: float | None = None, steps: int | None = None):
        self.seconds, self.steps, self.start = seconds, steps, time.monotonic()
        self.signalled = False

    def install_sigterm(self) -> None:
        """SIGTERM becomes "stop at the next step" (main thread only)."""
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def remaining(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.start)

    def spent(self, reserve_s: float = 0.0) -> bool:
        """True once the launch should stop; ``reserve_s``: stop already when less is left (a stage
        that cannot pause midway)."""
        if self.steps is not None:
            self.steps -= 1
            if self.steps < 0:
                return True
        return self.signalled or self.remaining() < reserve_s


def rng_state(generators: dict[str, torch.Generator], rng: np.random.Generator | None = None) -> dict:
    """Every random stream a loop draws from: the named generators, numpy's, torch's global ones."""
    state = {
        "generators": {k: g.get_state() for k, g in generators.items()},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if rng is not None:
        state["numpy"] = rng.bit_generator.state
    return state


def set_rng_state(
    state: dict, generators: dict[str, torch.Generator], rng: np.random.Generator | None = None
) -> None:
    for k, g in generators.items():
        g.set_state(state["generators"][k])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    if rng is not None:
        rng.bit_generator.state = state["numpy"]


class Resumable:
    """The state of one pretraining run in ``state_dir``: loaded at start, written at a pause and
    at stage boundaries, removed by :meth:`finish`. ``fingerprint``: the configuration (a dict of
    JSON values) a state must have been written under to be continued."""

    def __init__(self, state_dir: Path, fingerprint: dict, budget: Budget | None = None):
        self.dir, self.fingerprint, self.budget = Path(state_dir), fingerprint, budget
        self.path = self.dir / "state.pt"
        self.state: dict = {}
        if self.path.exists():
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            self._check(state)
            self.state = state

    def _check(self, state: dict) -> None:
        if state.get("version") != _VERSION:
            raise SystemExit(f"{self.path}: a state of another version; delete {self.dir} to start over")
        saved = state["config"]
        differ = sorted(
            k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k)
        )
        if differ:
            raise SystemExit(
                f"{self.path} was written by a run with other settings ({', '.join(differ)}); run with "
                f"the same settings to continue it, or delete {self.dir} to start over"
            )

    @property
    def stage(self) -> str | None:
        return self.state.get("stage")

    def get(self, key: str, default=None):
        return self.state.get(key, default)

    def due(self, reserve_s: float = 0.0) -> bool:
        return self.budget is not None and self.budget.spent(reserve_s)

    def save(self, stage: str, **entries) -> None:
        """Record ``stage`` and ``entries`` (merged into what is kept), atomically."""
        self.state.update(entries, stage=stage, version=_VERSION, config=self.fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".state.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def pause(self, stage: str, step: int, **entries) -> None:
        """Save and raise :class:`Paused`."""
        self.save(stage, step=step, **entries)
        raise Paused(stage, step, self.path)

    def finish(self) -> None:
        """The run is done: its state goes."""
        if self.path.exists():
            self.path.unlink()
        if self.dir.exists() and not any(self.dir.iterdir()):
            self.dir.rmdir()


@contextlib.contextmanager
def timed(times: dict, key: str):
    """Add the block's wall seconds to ``times[key]``, also when it pauses."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def run_paused_or_done(call: Callable[[], dict]) -> dict | None:
    """``call()``'s report, or None after printing how to continue when it paused (``main`` then
    exits with ``PAUSED_EXIT``)."""
    try:
        return call()
    except Paused as p:
        print(f"{p}; run the same command again to continue (exit {PAUSED_EXIT})", flush=True)
        return None


def cli_budget(max_minutes: float | None) -> Budget:
    """``--max-minutes``'s budget; SIGTERM pauses too."""
    budget = Budget(seconds=None if max_minutes is None else 60 * max_minutes)
    budget.install_sigterm()
    return budget
