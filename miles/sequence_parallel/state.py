"""Per-model sequence state of one forward: the real (unpadded) token count ``S``.

When ``S`` is not a multiple of ``sp``, the shard boundaries pad every sharded tensor at the
end to ``sp · ceil(S / sp)`` tokens (see ``comm.shard_sequence``); the attention must then
exclude the pad keys and the gather must drop the pad tokens, so both need ``S``. The shard
hooks record it here, the attention wrapper and the gather hook read it.

Lifetime: the model root's pre-forward hook clears it at the start of every model call, the
first shard of that call records it, and it then stays until the next model call. That
covers the backward of the call too, including activation-checkpoint recomputation (which
re-runs blocks, never the root's hooks). Ring attention and the gather additionally keep
``S`` in their autograd context, so a backward without recomputation never reads it. The one
pattern it cannot serve is recomputing call A after the forward of a call B with another
length; the first block's shard hook re-runs during recomputation, sees A's length, and
raises instead of computing with B's.

One object per model (``model._miles_sp_state``): two experts, or two models, never share
it. It holds no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["SequenceState", "sequence_state"]

STATE_ATTR = "_miles_sp_state"


@dataclass(eq=False)
class SequenceState:
    """``seq_len``: real token count of the current model call (None before its first shard).

    ``attention_pads``: set by an attention installer whose attention excludes pad keys
    (``apply_dispatch_sp_attention`` does); without it a length that ``sp`` does not divide
    raises at the shard instead of silently attending to pad tokens.
    """

    seq_len: int | None = None
    attention_pads: bool = False

    def __deepcopy__(self, memo: dict) -> SequenceState:
        # Hooks and the attention marker of a deep-copied model keep pointing at this object.
        return self

    def record(self, length: int) -> None:
        """Record the full length seen by a shard; every shard of one call must agree."""
        if self.seq_len is None:
            self.seq_len = length
        elif self.seq_len != length:
            raise ValueError(
                f"sequence-parallel shard of length {length}, but this model call already sharded "
                f"{self.seq_len} tokens. Either the plan shards tensors of different lengths, or an "
                f"activation-checkpointed block is being recomputed after a forward with another video "
                f"size: run each call's backward before the next call's forward when the video size "
                f"changes, or disable activation checkpointing."
            )


def sequence_state(model: nn.Module) -> SequenceState:
    """The model's :class:`SequenceState`, created on first use."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        state = SequenceState()
        setattr(model, STATE_ATTR, state)
    return state
