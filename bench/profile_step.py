"""One GRPO step under ``torch.profiler``: the top kernels (CPU ops on CPU) of each phase, as JSON (issue 43).

    python bench/profile_step.py --out OUT                                  # 1.3B, 81x480x832 (H200)
    python bench/profile_step.py --out OUT --model tiny --shape 5 64 64 --num-steps 2 --sde-window 1 \\
        --budget-gib 1                                                      # CPU, seconds

The step is ``bench/step_bench.py``'s (its parser, its config, its ``run_one`` with the jpeg reward
and its probes; every step bench flag works here): ``--rollouts`` rollouts (default 2), the first
the warm-up (compile, cudnn plans), the last profiled. Inside the probes each phase of the profiled
rollout — rollout, decode+reward (``Trainer.score``), train (``Trainer.train_on``) — runs, around the probes, in a
``record_function("miles::<phase>")`` range. Per phase the JSON holds:

- ``wall_s``: the phase's wall time (synchronized), and ``range_us``: the profiler's own inclusive
  CPU time of its range;
- ``kind``: ``cuda_kernels`` where CUDA ran (each kernel attributed to the phase whose window holds
  the CPU op that launched it, on any thread: the autograd engine's backward thread too; the range
  itself when no op inside it was open, as for Triton's launches) or ``cpu_ops`` (each op's self CPU
  time);
- ``total_us``: the sum over every kernel (op) of the phase, ``busy``: ``total_us`` over the wall
  time (the GPU's busy share on CUDA; above 1 where streams overlap), ``distinct``: how many names;
- ``top``: the ``--top`` names by self time, each with ``self_us``, ``share`` (of ``total_us``) and
  ``calls``.

Plus the device, shape, flags, the step bench's FLOPs and summary (``bench/mfu_table.py`` reads
both), so the profiled step's own TFLOP/s sit beside its kernels. Profiling slows the profiled
rollout a little (the CPU side records every op): its wall times are the profile's, the step bench's
unprofiled rows stay the speed reference. ``--trace FILE`` also writes the Chrome trace (large: not
for committing). Writes ``profile.json`` and ``profile.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import step_bench  # noqa: E402

PHASE_METHODS = {"rollout": "rollout", "score": "decode+reward", "train_on": "train"}
RANGE_PREFIX = "miles::"
NAME_CHARS = 200  # kernel names are long C++ templates: cut for the committed JSON


class StepProfiler:
    """Wraps the trainer's phase methods: the last of ``rollouts`` rollouts runs under the profiler,
    each phase in a ``record_function`` range and timed (synchronized)."""

    def __init__(self, rollouts: int, cuda: bool):
        import torch

        self.torch = torch
        self.rollouts, self.cuda = rollouts, cuda
        self.seen = 0  # rollouts started
        self.prof = None
        self.wall: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self.prof.start()

    def wrap(self, trainer_cls) -> None:
        for method, phase in PHASE_METHODS.items():
            setattr(trainer_cls, method, self._wrapped(getattr(trainer_cls, method), method, phase))

    def _wrapped(self, fn, method: str, phase: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if method == "rollout":
                self.seen += 1
                if self.seen == self.rollouts:
                    self._start()
            if self.prof is None or self.wall.get(phase) is not None:
                return fn(*args, **kwargs)
            self._sync()
            t0 = time.perf_counter()
            with self.torch.profiler.record_function(RANGE_PREFIX + phase):
                out = fn(*args, **kwargs)
                self._sync()
            self.wall[phase] = time.perf_counter() - t0
            if method == "train_on":
                self.prof.stop()
            return out

        return run


def _window_events(events, rng) -> list:
    """The CPU events (any thread) that start inside the range ``rng``'s window, the range excluded."""
    from torch.autograd import DeviceType

    lo, hi = rng.time_range.start, rng.time_range.end
    return [
        e
        for e in events
        if e.device_type == DeviceType.CPU
        and not e.is_async
        and e is not rng
        and not e.name.startswith(RANGE_PREFIX)
        and lo <= e.time_range.start <= hi
    ]


def phase_rows(events, cuda: bool) -> dict[str, list[tuple[str, float]]]:
    """Per phase, ``(name, self microseconds)`` of every kernel it launched (CUDA) or of every CPU op
    in its window (CPU), plus the range itself: ``{phase: {"range": FunctionEvent, "items": [...]}}``."""
    from torch.autograd import DeviceType

    ranges = {
        e.name[len(RANGE_PREFIX) :]: e
        for e in events
        if e.name.startswith(RANGE_PREFIX) and e.device_type == DeviceType.CPU
    }
    out = {}
    for phase, rng in ranges.items():
        inside = _window_events(events, rng)
        if cuda:  # a kernel launched with no op inside the range open (Triton's) is the range's own
            items = [(k.name, float(k.duration)) for e in [rng, *inside] for k in e.kernels]
        else:
            items = [(e.name, float(e.self_cpu_time_total)) for e in inside]
            items.append((rng.name, float(rng.self_cpu_time_total)))  # the range's own Python time
        out[phase] = {"range": rng, "items": items}
    return out


def summarize_phase(items: list[tuple[str, float]], wall_s: float, top: int) -> dict:
    """Totals and the ``top`` names by summed self time of one phase's ``(name, microseconds)``."""
    time_us, calls = defaultdict(float), defaultdict(int)
    for name, us in items:
        time_us[name] += us
        calls[name] += 1
    total = sum(time_us.values())
    ranked = sorted(time_us, key=lambda n: -time_us[n])[:top]
    return {
        "total_us": total,
        "busy": total / 1e6 / wall_s if wall_s > 0 else None,
        "distinct": len(time_us),
        "top": [
            {
                "name": n[:NAME_CHARS],
                "self_us": time_us[n],
                "share": time_us[n] / total if total > 0 else 0.0,
                "calls": calls[n],
            }
            for n in ranked
        ],
    }


def profile_summary(prof: StepProfiler, top: int) -> dict:
    rows = phase_rows(prof.prof.events(), prof.cuda)
    phases = {}
    for phase in PHASE_METHODS.values():
        if phase not in rows:
            continue
        wall = prof.wall[phase]
        phases[phase] = {
            "wall_s": wall,
            "range_us": float(rows[phase]["range"].cpu_time_total),
            "kind": "cuda_kernels" if prof.cuda else "cpu_ops",
            **summarize_phase(rows[phase]["items"], wall, top),
        }
    return phases


def markdown(result: dict) -> str:
    p = result["profile"]
    lines = [
        f"{result['model']}, {'x'.join(map(str, result['shape']))} ({result['tokens']} tokens), "
        f"{result['samples']} samples, {result['num_steps']} steps, attention "
        f"{result.get('attention_backend') or 'default'}, checkpointing {result['activation_checkpointing']}, "
        f"on {result['device']}: rollout {p['profiled_rollout']} of {result['rollouts']} profiled",
        "",
    ]
    for phase, row in p["phases"].items():
        busy = "" if row["busy"] is None else f", busy {row['busy']:.0%} of the wall"
        lines += [
            f"**{phase}**: {row['wall_s']:.2f} s wall, {row['total_us'] / 1e6:.2f} s of "
            f"{row['kind'].replace('_', ' ')}{busy}",
            "",
            "| name | self s | share | calls |",
            "| --- | ---: | ---: | ---: |",
        ]
        for t in row["top"]:
            name = t["name"].replace("|", "\\|")[:100]
            lines.append(f"| `{name}` | {t['self_us'] / 1e6:.3f} | {t['share']:.1%} | {t['calls']} |")
        lines.append("")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = step_bench.parser()
    ap.description = __doc__
    ap.set_defaults(rollouts=2, rewards=["jpeg"])
    ap.add_argument("--top", type=int, default=15, help="kernels (CPU ops) kept per phase")
    ap.add_argument("--trace", type=Path, default=None, help="also write the Chrome trace here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    args.memory_cap_gib = step_bench.cap_process_memory()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or args.out / "work"
    prof = StepProfiler(args.rollouts, torch.cuda.is_available())
    result = step_bench.run_one(args, "jpeg", around=prof.wrap)
    if prof.prof is None:
        raise SystemExit("the profiled rollout never started: --rollouts must be >= 1")
    if args.trace is not None:
        with contextlib.suppress(FileExistsError):
            args.trace.parent.mkdir(parents=True)
        prof.prof.export_chrome_trace(str(args.trace))
    result["rollouts"] = args.rollouts
    result["command"] = ["bench/profile_step.py", *(sys.argv[1:] if argv is None else argv)]
    result["profile"] = {
        "profiled_rollout": args.rollouts,
        "top": args.top,
        "phases": profile_summary(prof, args.top),
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "profile.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
