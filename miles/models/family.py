"""The model-family seam: what the run needs of a family of video diffusion transformers.

A family's folders differ in how their experts are routed and called, how images and videos
are encoded, how latents decode, how much one block keeps for backward and how an export is
laid out. The trainer, the run plan and dry run, evaluation, memory planning, the algorithms,
the sampler and export go through the three Protocols below, never through a family's names:

- :class:`ModelFamily`: loads a folder (whole, as skeletons, or as configs only for the run
  plan), names its expert folders (the export layout) and saves LoRA adapters;
- :class:`FamilyModel`: a loaded folder: the experts, the frozen text encoder and VAE
  (``pipeline``), prompt/image/video encoding, decoding, the noise schedule (``flow_schedule``,
  :func:`rollout_schedule`), the SP plan, block calibration;
- :class:`ExpertRouting`: which expert denoises at a timestep, and the timestep it takes.

A folder's family is the one that claims the pipeline class its ``model_index.json`` names
(:func:`family_of`). The installed families are listed in :mod:`miles.models.families`; adding
one: a module that implements the three Protocols, and its entry there (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from miles.models.families import FAMILIES
from miles.models.folder import read_pipeline_index, resolve_model_path
from miles.rollout.schedule import FlowSchedule


class ExpertRouting(Protocol):
    """How a folder's experts are called at a timestep t = 1000·σ (the sampler, the algorithms)."""

    @property
    def boundary_sigma(self) -> float | None:
        """σ at which the second expert takes over (None: one expert)."""

    @property
    def per_token_timesteps(self) -> bool:
        """Whether the experts take one timestep per token (memory planning counts its activations)."""

    def expert_index(self, t: float | Tensor, num_experts: int) -> int:
        """The index of the expert that denoises at timestep ``t``."""

    def model_timestep(self, t: Tensor, x: Tensor, expert: nn.Module) -> Tensor:
        """The timestep ``expert`` takes for samples' timesteps ``t`` (B,) at model input ``x``."""

    def forward(self, expert: nn.Module, x: Tensor, timestep: Tensor, text: Tensor, **extra) -> Tensor:
        """``expert``'s output (B, C, F, H, W) at model input ``x`` (B, C, F, H, W), its timestep and
        the family's text condition ``text`` (what :meth:`FamilyModel.encode_prompts` returned, rows
        as the batch): how the family's experts take the latent and the text (as they are, or the
        latent packed into tokens and the text's mask read from the condition)."""

    def report(self, num_experts: int) -> dict:
        """The run plan's fields for the routing, with ``expert_switch`` and ``timestep_layout``
        (the dry run's words, or None)."""


class FamilyModel(Protocol):
    """A loaded folder (or its configs only, on the meta device, for the run plan)."""

    path: Path
    transformers: list[nn.Module]  # the experts, in routing order
    pipeline: object  # the diffusers pipeline: text_encoder, tokenizer, vae, scheduler
    condition_mode: str | None  # image-to-video: the image condition's mode; None: text-to-video

    @property
    def routing(self) -> ExpertRouting: ...

    @property
    def expert_folders(self) -> tuple[str, ...]:
        """The folder of each expert, in ``transformers`` order (sharded loading, copies)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def architecture(self) -> dict:
        """The expert's sizes the run plan and memory model read: ``num_layers``, ``ffn_dim``,
        ``text_dim`` (the width of the text condition :meth:`encode_prompts` returns) and
        ``patch_size`` (t, h, w)."""

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]: ...

    def num_tokens(self, num_frames: int, height: int, width: int) -> int: ...

    def vae_decoder_memory(self) -> tuple[int, float]:
        """(d, k) of the VAE decoder for the memory plan: its base width d and its peak working set k in
        bytes per output pixel, per channel of d, per byte of the VAE's dtype (``miles.train.memory_budget``)."""
        ...

    def flow_schedule(self, rollout, num_tokens: int) -> FlowSchedule:
        """The noise schedule the sampler denoises on for the run's rollout section ``rollout`` at
        ``num_tokens`` tokens a sample: ``rollout.shift`` on the sampler's grid, or the folder's own
        scheduler (its shift from the token count, a terminal σ), which refuses a ``rollout.shift``
        set by hand with a ``ValueError`` naming the fix."""
        ...

    def text_length_warnings(self, max_sequence_length: int) -> list[str]:
        """Warnings about a text length the family's transformers do not expect (the plan prints them)."""
        ...

    def sequence_parallel_plan(self, transformer: nn.Module):
        """The SP plan of one expert (``miles.sequence_parallel.SequenceParallelPlan``): the engine
        installs it on every copy of the expert (policy, old policy, reference)."""

    def encode_prompts(self, prompts: list[str], negative_prompt: str, max_sequence_length: int, device):
        """(prompt, negative) text conditions, each (B, L, D'): an opaque tensor to the run (cached,
        batched, CFG-concatenated along the batch) that only :meth:`ExpertRouting.forward` reads."""

    def encode_texts(self, texts: list[str], max_sequence_length: int, device) -> Tensor:
        """The text conditions (N, L, D') of ``texts``, as :meth:`encode_prompts` encodes each row
        (the prompt cache encodes every unique prompt once with it)."""

    def encode_images(self, images: list, num_frames: int, height: int, width: int, device): ...

    def encode_video(self, clip: Tensor, device) -> Tensor: ...

    def decode(self, latents: Tensor) -> Tensor: ...

    def calibrate_block_memory(
        self, transformer: nn.Module, tokens: int, device, **options
    ) -> dict[str, float]: ...


class ModelFamily(Protocol):
    """A family of model folders."""

    name: str
    pipeline_classes: frozenset[str]  # the model_index.json classes the family reads
    expert_folders: tuple[str, ...]  # every expert folder, in routing order (the export layout)

    def load(self, model_cfg, device: torch.device, experts: str = "load", seed: int = 0) -> FamilyModel:
        """The folder of ``model_cfg`` loaded (``experts``: ``load`` whole, or ``skeleton`` on meta)."""

    def load_meta(self, cfg, strict: bool = False) -> tuple[FamilyModel, dict, list[str]]:
        """The folder of ``cfg.model`` as configs only: the model, its model_index.json, warnings."""

    def save_lora_weights(self, folder: Path, **kwargs) -> None:
        """Save one expert's LoRA adapter (diffusers' ``save_lora_weights`` arguments)."""


__all__ = [
    "FAMILIES",
    "ExpertRouting",
    "FamilyModel",
    "ModelFamily",
    "family_of",
    "model_folder",
    "rollout_schedule",
]


def model_folder(model_cfg) -> Path:
    """The run's model folder: ``model.path``, or the embedded tiny model's, built on demand."""
    return resolve_model_path(model_cfg)


def family_of(path: Path) -> ModelFamily:
    """The family that reads the folder ``path`` (by its ``model_index.json`` pipeline class); a
    ``ValueError`` naming the fix when none does."""
    name = read_pipeline_index(Path(path)).get("_class_name")
    for family in FAMILIES.values():
        if name in family.pipeline_classes:
            return family
    known = "; ".join(f"{f.name}: {sorted(f.pipeline_classes)}" for f in FAMILIES.values())
    raise ValueError(f"model.path {path} holds a {name}, which no model family reads ({known})")


def rollout_schedule(model: FamilyModel, rollout) -> FlowSchedule:
    """The noise schedule of the rollout section ``rollout`` on ``model``'s folder, at the rollout's
    token count: what the sampler, the algorithms' noise levels, evaluation and the dry run use."""
    return model.flow_schedule(rollout, model.num_tokens(rollout.num_frames, rollout.height, rollout.width))
