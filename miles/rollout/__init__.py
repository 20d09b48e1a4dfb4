"""Rollout: the Flow-GRPO SDE step with log-probabilities and the sampling loop (experts routed by the model family)."""

from miles.rollout.sampler import (
    NUM_TRAIN_TIMESTEPS,
    Rollout,
    cfg_combine,
    compute_log_prob,
    initial_noise,
    predict_velocity,
    sample_with_logprob,
    sde_step_indices,
)
from miles.rollout.schedule import FlowSchedule, flow_sigmas
from miles.rollout.sde import SDEStep, ode_step, sde_step_with_logprob

__all__ = [
    "NUM_TRAIN_TIMESTEPS",
    "FlowSchedule",
    "Rollout",
    "SDEStep",
    "cfg_combine",
    "compute_log_prob",
    "flow_sigmas",
    "initial_noise",
    "ode_step",
    "predict_velocity",
    "sample_with_logprob",
    "sde_step_indices",
    "sde_step_with_logprob",
]
