"""The algorithm seam: what a rollout records, and how the loss of an optimizer step is formed.

The training loop is the same for every algorithm: roll out, decode and score, normalise the
rewards within prompt groups, then take ``train.steps_per_rollout`` optimizer steps, each over
its share of the rollout's micro-batches. An :class:`Algorithm` decides what differs: which
weights sample the rollout (the trained ones, or a lagging "old" copy), which denoising steps
the rollout samples stochastically and records (Flow-GRPO: SDE steps with their
log-probabilities; a forward-process method: none, only clean samples), the loss it
backpropagates over one optimizer step's micro-batches, and what it does once a rollout's
updates are done. Algorithms are chosen by ``algorithm.name`` from the registry
(``miles.algorithms.build_algorithm``); the trainer never branches on the name.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from miles.rollout.batch import MicroBatch, RolloutBatch
from miles.rollout.schedule import FlowSchedule


@dataclass
class Policy:
    """What an algorithm needs of the model being trained (the trainer builds it)."""

    transformers: Sequence[nn.Module]
    guidance_scales: list[float]
    routing: object
    """The model family's ``ExpertRouting`` (``model.routing``): the expert of each timestep and the
    timestep it takes."""
    reference: Callable[[], AbstractContextManager[Sequence[nn.Module]]] | None
    """A context giving the reference (initial) policy's experts: the frozen copy, or the LoRA model
    with its adapters off. None: no reference is kept (no KL term)."""
    generator: Callable[..., torch.Generator]
    """generator(*parts): a CPU generator seeded from the run seed and ``parts``, the same on every
    rank given the same parts (key draws by global sample index for layout-independent runs)."""
    old: object | None = None
    """The old policy (``miles.train.old_policy.OldPolicy``) where the algorithm asks for one."""


def run_schedule(cfg, schedule: FlowSchedule | None) -> FlowSchedule:
    """The run's noise schedule: the model family's (``RunPlan.schedule``, given to ``build_algorithm``),
    else Wan's, ``rollout.shift`` on the sampler's grid (an algorithm built from a config alone)."""
    return schedule if schedule is not None else FlowSchedule(shift=cfg.rollout.shift)


class Algorithm(abc.ABC):
    """One RL algorithm behind the loop; subclasses register with ``@register_algorithm``."""

    name: str = ""
    summary: str = ""
    """One line for ``algorithm.name``'s ``--help``: what it rolls out, its loss, its config section."""
    uses_old_policy: bool = False
    """Whether the trainer keeps an old policy: a sharded copy of the experts that samples the
    rollouts and that ``after_rollout`` moves towards the trained weights."""
    records_means: bool = False
    """Whether the rollout keeps each SDE step's mean (``Rollout.means``)."""
    uses_reference: bool = False
    """Whether the loss needs the reference (initial) policy (a KL term): the trainer then keeps a
    frozen sharded copy of a full fine-tune (LoRA: the adapters are switched off instead)."""
    batch_source: str = "rollout"
    """Where a step's latents come from (``miles.train.sources``): ``rollout``, sampled by the policy
    (``miles.train.collect``), or ``videos``, the encoded videos of a JSONL dataset (supervised)."""
    uses_rewards: bool = True
    """Whether training reads the batch's rewards and advantages; False skips decoding and scoring
    (the logged training reward is then 0: such an algorithm is measured by held-out evaluation)."""

    trains_clipped_ratio = False
    """It trains Flow-GRPO's clipped ratio with the ``grpo`` section's ``clip_range`` and ``kl_beta``
    (so ``grpo.clip_range: auto`` and ``train.guard kl`` have something to act on)."""

    @classmethod
    def check(cls, cfg) -> list[str]:
        """The refusals of the whole config ``cfg`` that concern this algorithm (combinations it
        cannot run), each naming the setting to change; the config's validation raises the first.
        Its options' ranges are its options class's ``RANGES``, checked with every other range.
        Subclasses extend this list (``super().check(cfg)``)."""
        errors = []
        if cfg.grpo.clip_range == "auto" and not cls.trains_clipped_ratio:
            errors.append(
                f"grpo.clip_range auto calibrates Flow-GRPO's ratio clip; algorithm.name {cfg.algorithm.name} "
                "does not use grpo.clip_range"
            )
        if cfg.train.guard == "kl" and not (cls.trains_clipped_ratio and cfg.grpo.kl_beta > 0):
            errors.append(
                "train.guard kl raises the KL coefficient of a run that has one: an algorithm with Flow-GRPO's "
                "clipped ratio (algorithm.name flow_grpo or grpo_guard) with grpo.kl_beta > 0 (the reference "
                "policy is kept only then)"
            )
        return errors

    @abc.abstractmethod
    def sde_steps(self, num_steps: int, generator: torch.Generator) -> list[int]:
        """The denoising steps the rollout samples stochastically and records, the same on
        every rank (drawn from ``generator``); [] records none (ODE rollouts)."""

    @abc.abstractmethod
    def accumulate(
        self, policy: Policy, batch: RolloutBatch, chunks: list[MicroBatch], step_in_rollout: int = 0
    ) -> dict[str, float]:
        """Backpropagate the loss of one optimizer step over ``chunks`` (its micro-batches of the
        rollout ``batch``; ``step_in_rollout`` is the step's index in the rollout) into the
        gradients. Per sample of this rank, ``batch`` holds ``advantages`` (group-normalised,
        negated for the negative control), ``rewards`` (the trained reward), ``group_ids`` and
        ``sample_ids`` (global indices); each chunk its ``slice`` of them, ``pos``/``neg`` text
        embeddings, the ``rollout`` record and the image ``condition``. Every rank must run the
        same experts in the same order (FSDP's collectives pair up by call order), so anything
        that routes a pass is drawn alike on every rank.
        Return the step's metrics (sample-weighted means), with ``loss`` among them and
        ``log_prob_mean_abs_diff`` where the algorithm has one."""

    @abc.abstractmethod
    def forwards_per_sample(self, batch: RolloutBatch) -> int:
        """Transformer forwards (in samples, CFG counted twice) that training runs per sample of
        ``batch``, with and without gradient: the throughput metric's numerator."""

    def rollout_transformers(self, policy: Policy) -> Sequence[nn.Module]:
        """The experts that sample the rollouts: the trained ones unless the algorithm keeps an old policy."""
        return policy.old.transformers if self.uses_old_policy else policy.transformers

    def state_dict(self) -> dict:
        """What the algorithm learnt during the run beyond the weights (saved in the checkpoint's
        trainer state; JSON). Default: nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values at a resume. Default: nothing."""
        del state

    def scale_kl(self, factor: float) -> float:
        """Multiply the KL coefficient by ``factor`` (``train.guard: kl``); returns the new one."""
        raise ValueError(f"{self.name} has no KL coefficient the guard can raise")

    def after_rollout(self, policy: Policy, step: int) -> dict[str, float]:
        """Called once a rollout's optimizer steps are done (``step``: optimizer steps so far);
        returns metrics to log. Default: nothing."""
        return {}
