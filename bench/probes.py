"""Per-phase probes: wall time, peak GPU memory (allocated and reserved) and host RSS.

``Probes.wrap(obj, "method", "phase")`` replaces a method (or module function) with one that
runs inside ``Probes.phase("phase")``; nothing in ``miles/`` is edited. A phase resets the CUDA
peak counters (and the kernel's peak-RSS mark, ``/proc/self/clear_refs``) when it starts and
reads them when it ends; a phase nested inside another passes its peaks up to it, so an outer
phase's peak covers everything that ran inside it.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

GIB = 2**30


def host_rss_gib() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size of this process, GiB (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024 / GIB
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def _reset_host_peak() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS


class Probes:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.phases: list[dict] = []
        self._stack: list[dict] = []

    def _peaks(self) -> dict:
        rss, rss_peak = host_rss_gib()
        out = {"host_rss_gib": rss, "host_rss_peak_gib": rss_peak}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out.update(
                gpu_peak_allocated_gib=torch.cuda.max_memory_allocated(self.device) / GIB,
                gpu_peak_reserved_gib=torch.cuda.max_memory_reserved(self.device) / GIB,
                gpu_allocated_end_gib=torch.cuda.memory_allocated(self.device) / GIB,
            )
        return out

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        _reset_host_peak()

    @staticmethod
    def _merge(into: dict, peaks: dict) -> None:
        for key in ("host_rss_peak_gib", "gpu_peak_allocated_gib", "gpu_peak_reserved_gib"):
            if key in peaks:
                into[key] = max(into.get(key, 0.0), peaks[key])

    @contextlib.contextmanager
    def phase(self, name: str):
        if self._stack:  # what the enclosing phase has seen so far, before the counters reset
            self._merge(self._stack[-1]["carried"], self._peaks())
        row = {"phase": name, "carried": {}}
        self._stack.append(row)
        self._reset()
        t0 = time.perf_counter()
        try:
            yield row
        finally:
            peaks = self._peaks()
            self._merge(peaks, row.pop("carried"))
            row.update(wall_s=time.perf_counter() - t0, **peaks)
            self._stack.pop()
            if self._stack:
                self._merge(self._stack[-1]["carried"], peaks)
            self.phases.append(row)
            # As it goes: a run cut off by a time limit still leaves its finished phases in the log.
            print(
                f"[probes] {name}: {row['wall_s']:.1f} s, GPU peak "
                f"{row.get('gpu_peak_allocated_gib', 0.0):.2f} GiB allocated / "
                f"{row.get('gpu_peak_reserved_gib', 0.0):.2f} reserved, host RSS peak {row['host_rss_peak_gib']:.2f} GiB",
                flush=True,
            )

    def wrap(self, obj, attr: str, name: str, missing_ok: bool = False) -> bool:
        """Run ``obj.attr`` inside ``phase(name)`` from now on; False (nothing wrapped) when ``obj``
        has no ``attr`` and ``missing_ok`` (a trainer whose phase method was renamed)."""
        if missing_ok and not hasattr(obj, attr):
            print(f"[probes] {getattr(obj, '__name__', obj)}.{attr} not found: phase {name!r} not probed")
            return False
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, wrapped)
        return True

    def peak(self, key: str, phases: list[str] | None = None) -> float | None:
        values = [p[key] for p in self.phases if key in p and (phases is None or p["phase"] in phases)]
        return max(values) if values else None
