"""The noise schedule the sampler denoises on: σ from 1 to 0 over ``num_steps`` steps, t = 1000·σ.

A model family owns its schedule (``FamilyModel.flow_schedule``) and hands the run a
:class:`FlowSchedule`; the sampler, the algorithms that draw noise levels and evaluation read its
:meth:`FlowSchedule.sigmas`. Two forms, each bitwise what its source computes:

- **Wan** (``FlowSchedule(shift)``, the default): σ_i = shift·s/(1 + (shift − 1)·s) with
  s = 1 − i/T, i = 0..T, computed in fp64 and rounded to fp32 (:func:`flow_sigmas`): the shift of
  Wan's FlowMatch/UniPC schedulers on DanceGRPO's evenly spaced grid, endpoints exact.
- **diffusers' FlowMatchEulerDiscreteScheduler as a pipeline drives it** (``grid="pipeline"``,
  LTX-Video's ``LTXPipeline``): the grid ``linspace(1, 1/T, T)`` the pipeline passes as ``sigmas``,
  shifted in fp32 by the scheduler's exponential time shift at μ (``use_dynamic_shifting``: μ from
  the token count, ``calculate_shift``) or by its static ``shift``, then stretched so that the last
  σ before 0 is ``shift_terminal`` (``stretch_shift_to_terminal``), then 0 appended — the numpy
  arithmetic of ``set_timesteps`` op for op (tests/unit/test_ltx_schedule.py: bitwise against
  ``retrieve_timesteps(scheduler, sigmas=..., mu=...)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def flow_sigmas(num_steps: int, shift: float | FlowSchedule = 1.0) -> Tensor:
    """The (num_steps + 1,) fp32 sigma schedule from 1 to 0: time-shifted as in Wan for a float
    ``shift``, or ``shift.sigmas(num_steps)`` for a family's :class:`FlowSchedule`."""
    if isinstance(shift, FlowSchedule):
        return shift.sigmas(num_steps)
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


@dataclass(frozen=True)
class FlowSchedule:
    """A family's noise schedule (module docstring). ``FlowSchedule(shift)`` is Wan's."""

    shift: float = 1.0
    """The time shift σ' = shift·σ/(1 + (shift − 1)·σ) (= e^μ with ``mu``)."""
    mu: float | None = None
    """diffusers' dynamic shifting: the exponential time shift at μ (``shift`` is then e^μ, for display)."""
    shift_terminal: float | None = None
    """The last σ before 0, the shifted grid stretched to it (diffusers' ``shift_terminal``); None: no stretch."""
    grid: str = "wan"
    """``wan`` (:func:`flow_sigmas`, fp64) or ``pipeline`` (diffusers' scheduler on its pipeline's grid, fp32)."""
    source: str = "rollout.shift"
    """Where the numbers come from, for the dry run (e.g. the folder's scheduler config at N tokens)."""

    def sigmas(self, num_steps: int) -> Tensor:
        """The (num_steps + 1,) fp32 σ from 1 to 0 the sampler steps through."""
        if self.grid == "wan":
            if self.mu is not None or self.shift_terminal:
                raise ValueError("a wan-grid FlowSchedule takes a shift only (no mu, no shift_terminal)")
            return flow_sigmas(num_steps, self.shift)
        if self.grid != "pipeline":
            raise ValueError(f"FlowSchedule.grid must be 'wan' or 'pipeline', got {self.grid!r}")
        if num_steps < 1 or (self.shift_terminal and num_steps < 2):
            need = 2 if self.shift_terminal else 1
            raise ValueError(
                f"num_steps {num_steps}: this schedule needs >= {need} steps (shift_terminal "
                f"{self.shift_terminal} stretches the last step before 0 onto it; raise rollout.num_steps)"
            )
        # (T,) as LTXPipeline passes it and set_timesteps reads it: fp64 linspace, then fp32.
        s = np.array(np.linspace(1.0, 1 / num_steps, num_steps)).astype(np.float32)
        if self.mu is not None:  # FlowMatchEulerDiscreteScheduler._time_shift_exponential(mu, 1.0, s)
            s = math.exp(self.mu) / (math.exp(self.mu) + (1 / s - 1) ** 1.0)
        else:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        if self.shift_terminal:  # stretch_shift_to_terminal
            one_minus_z = 1 - s
            scale_factor = one_minus_z[-1] / (1 - self.shift_terminal)
            s = 1 - (one_minus_z / scale_factor)
        return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])

    def describe(self, num_steps: int) -> str:
        """One line for the dry run: the rule, where it comes from and the σ it gives."""
        rule = (
            f"shift {self.shift:.4g}"
            if self.mu is None
            else f"mu {self.mu:.4f} (shift e^mu = {self.shift:.4g})"
        )
        if self.shift_terminal:
            rule += f", stretched to shift_terminal {self.shift_terminal:g}"
        sig = self.sigmas(num_steps).tolist()
        shown = ", ".join(f"{v:.4f}" for v in (sig if len(sig) <= 9 else sig[:4] + sig[-4:]))
        gap = "" if len(sig) <= 9 else " (first and last 4)"
        return f"{rule} [{self.source}, {self.grid} grid]; sigmas{gap} {shown}"
