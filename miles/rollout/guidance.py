"""Classifier-free guidance per expert, computed in one place for rollout, training, evaluation
and memory planning."""

from __future__ import annotations

__all__ = ["guidance_scales", "uses_cfg"]


def guidance_scales(r, num_experts: int) -> list[float]:
    """The CFG scale of each expert of ``r`` (the run's ``RolloutConfig``): ``guidance_scale``, and
    ``guidance_scale_2`` (else the same) for the low-noise expert of a two-expert model."""
    g2 = r.guidance_scale if r.guidance_scale_2 is None else r.guidance_scale_2
    return [r.guidance_scale, g2][:num_experts]


def uses_cfg(r, num_experts: int) -> bool:
    """Whether classifier-free guidance runs (cond and uncond as one batch) for any expert."""
    return any(s > 1.0 for s in guidance_scales(r, num_experts))
