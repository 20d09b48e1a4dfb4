"""An exponential moving average of the trained weights, sharded as they are.

    ema = EMA(trainable_named_parameters, decay=0.99)
    ema.update()                     # after every optimizer step: e ← decay·e + (1 − decay)·p
    with ema.applied():              # evaluate or export with the averaged weights
        ...

The average lives beside each trainable parameter with the parameter's own placement: under
FSDP2 every rank keeps the fp32 shard of the average of its own shard, so the memory is one more
copy of the sharded trainable weights and nothing is gathered. ``update`` runs on local shards
only (an element-wise lerp needs no communication). ``state_dict`` gives the averages under the
parameters' names for torch.distributed.checkpoint, which saves and reloads them resharded.
With ``train.ema_decay > 0`` the trainer evaluates and exports the averaged weights and keeps
training the raw ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay must be in (0, 1) (0 turns the EMA off), got {decay}")
        self.decay = decay
        self.params = dict(named_parameters)
        self.shadow = {name: p.detach().clone().float() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """e ← decay·e + (1 − decay)·p, on every rank's local shards."""
        shadows = [_local(self.shadow[n]) for n in self.params]
        params = [_local(p.detach()).float() for p in self.params.values()]
        torch._foreach_lerp_(shadows, params, 1.0 - self.decay)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in place of the trained ones, restored bit for bit after."""
        with torch.no_grad():
            backup = {n: _local(p.detach()).clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                _local(p.detach()).copy_(_local(self.shadow[n]))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    _local(p.detach()).copy_(backup[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise ValueError(
                f"the checkpoint holds no EMA for {missing[:3]}...: it was saved without train.ema_decay"
            )
        with torch.no_grad():
            for n, t in self.shadow.items():
                _local(t).copy_(_local(state[n]))
