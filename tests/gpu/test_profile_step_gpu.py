"""``bench/profile_step.py``'s CUDA attribution on a GPU (skipped without CUDA): every kernel launched
inside the phase ranges — the backward's too, which the autograd engine launches from its own thread —
is counted once, in its phase, and the phases' kernel totals add up to the profiler's own kernel
events.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_kernels_of_each_phase_add_up_to_the_profilers():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.profile_step import RANGE_PREFIX, phase_rows, summarize_phase

    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(RANGE_PREFIX + "rollout"):
            with torch.no_grad():
                (x @ w).sum()
            torch.cuda.synchronize()
        with record_function(RANGE_PREFIX + "train"):
            (x @ w).square().sum().backward()  # one forward mm, one backward mm (dW; x needs no grad)
            torch.cuda.synchronize()
    events = prof.events()
    rows = phase_rows(events, cuda=True)
    assert sorted(rows) == ["rollout", "train"]
    phases = {ph: summarize_phase(r["items"], wall_s=1.0, top=50) for ph, r in rows.items()}
    calls = {ph: sum(t["calls"] for t in p["top"]) for ph, p in phases.items()}
    assert calls["rollout"] >= 1 and calls["train"] >= calls["rollout"] + 2  # + the backward's kernels
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(RANGE_PREFIX)]
    total = sum(e.time_range.end - e.time_range.start for e in kernels)
    counted = sum(p["total_us"] for p in phases.values())
    assert counted == pytest.approx(total, rel=0.02)  # each kernel once, none lost
