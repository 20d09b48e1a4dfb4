"""The old policy of forward-process algorithms (DiffusionNFT): a lagging copy of the experts.

    old = OldPolicy(old_experts, trained_experts)   # copies built and sharded like the trained ones
    sample_with_logprob(old.transformers, ...)       # the old policy samples the rollouts
    old.soft_update(decay)                           # θ_old ← decay·θ_old + (1 − decay)·θ

The trainer builds each copy as a meta skeleton (with the same LoRA adapters), installs SP and
FSDP2 exactly as on the original and copies the original's local shards into it
(``miles.models.sharded_load.copy_local_shards``; no rank ever holds a whole expert), so every
parameter of the copy has the same placement and local shard as its twin: the soft update is an
element-wise lerp of local shards, with no communication. Only the trainable parameters move (LoRA: the adapters; the
frozen base is the same in both). ``state_dict`` gives the old trainable parameters under the
trained ones' names for torch.distributed.checkpoint. Memory: one more sharded copy of the
experts (its trainable parameters in fp32, a LoRA base in the compute dtype; 1/world_size of them
per rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from miles.models.sharded_load import clean_name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class OldPolicy:
    def __init__(self, old: Sequence[nn.Module], trained: Sequence[nn.Module]):
        if len(old) != len(trained):
            raise ValueError(f"{len(old)} old experts for {len(trained)} trained ones")
        self.transformers = list(old)
        self.pairs: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for i, (o, t) in enumerate(zip(old, trained)):
            # matched by unwrapped name: the trained blocks may carry activation-checkpointing wrappers
            olds = {clean_name(n): p for n, p in o.named_parameters()}
            for name, p in t.named_parameters():
                if p.requires_grad:
                    old_p = olds.get(clean_name(name))
                    if old_p is None or old_p.shape != p.shape:
                        raise ValueError(
                            f"the old policy has no parameter {name} shaped like {tuple(p.shape)}"
                        )
                    self.pairs[f"{i}.{name}"] = (old_p, p)
        for o in self.transformers:
            o.requires_grad_(False).eval()

    @torch.no_grad()
    def soft_update(self, decay: float) -> None:
        """θ_old ← decay·θ_old + (1 − decay)·θ on every rank's local shards (decay 0: a copy)."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the old policy's decay must be in [0, 1), got {decay}")
        olds = [_local(o.detach()) for o, _ in self.pairs.values()]
        news = [_local(p.detach()).to(o.dtype) for (_, p), o in zip(self.pairs.values(), olds)]
        if decay == 0.0:
            torch._foreach_copy_(olds, news)
        else:
            torch._foreach_lerp_(olds, news, 1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: o.detach() for name, (o, _) in self.pairs.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.pairs) - set(state))
        if missing:
            raise ValueError(f"the checkpoint holds no old policy for {missing[:3]}...")
        with torch.no_grad():
            for name, (o, _) in self.pairs.items():
                _local(o.detach()).copy_(_local(state[name]))
