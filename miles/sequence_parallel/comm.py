"""Differentiable collectives of sequence parallelism: shard, gather, Ulysses all-to-all.

- ``shard_sequence``: keep this rank's chunk of a full-sequence tensor. A length S that sp
  does not divide is first zero-padded at the END to sp·c tokens, c = ceil(S / sp), so every
  rank holds c tokens and every collective stays even-sized; only the highest ranks hold pads
  (backward: the slice's gradient, zero elsewhere and at the pads).
- ``gather_sequence``: all-gather the chunks back into the full sequence and drop the trailing
  pads. Its backward all-reduces (SUM) the full gradient over the sp group and returns the
  local slice (zero at the pads). Every sp rank computes the same loss from the same full
  output, so each rank's local gradient is then ``sp x`` its share; FSDP's mean over dp x sp
  turns that back into the dp mean exactly: (1/(dp·sp)) · Σ_dp Σ_sp sp·g_local = (1/dp) · Σ_dp g.
- ``ulysses_all_to_all``: (B, S/sp, H, D) -> (B, S/ring, H/u, D) and its inverse; an
  equal-split all-to-all is its own adjoint, so the backward is the opposite all-to-all.

Groups are always passed in; nothing here keeps a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = [
    "gather_sequence",
    "padded_chunk",
    "shard_sequence",
    "ulysses_all_to_all",
    "ulysses_all_to_all_inverse",
]


# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def padded_chunk(length: int, size: int) -> int:
    """Tokens per rank when ``length`` tokens are sharded over ``size`` ranks: ceil(length / size)."""
    return -(-length // size)


def shard_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (chunk index = rank in ``group``).

    A length that the group size does not divide is zero-padded at the end to ``size · c``,
    ``c = ceil(length / size)``; the chunk of a rank past the real length holds pads only.
    """
    size = _group_size(group)
    length = x.size(dim)
    chunk = padded_chunk(length, size)
    if chunk * size != length:
        # (..., S, ...) -> (..., size·c, ...): zeros keep the pad tokens finite through every layer.
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, chunk * size - length]
        x = F.pad(x, pad)
    return x.narrow(dim, dist.get_rank(group) * chunk, chunk).contiguous()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup, length: int | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        # Gather along dim 0 into one buffer: (size * chunk, ...) then move the axis back.
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local, group=group)
        ctx.padded = out.shape[0]
        if length is not None and length != ctx.padded:
            assert ctx.padded - size < length < ctx.padded, (length, ctx.padded, size)
            out = out[:length]  # drop the trailing pads
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A copy: the all-reduce is in place and the incoming gradient may be referenced elsewhere.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunk = ctx.padded // size
        grad = grad.movedim(ctx.dim, 0)
        if grad.shape[0] != ctx.padded:  # pads had no output: their gradient is zero
            grad = torch.cat([grad, grad.new_zeros((ctx.padded - grad.shape[0], *grad.shape[1:]))])
        return grad[rank * chunk : (rank + 1) * chunk].movedim(0, ctx.dim).contiguous(), None, None, None


def gather_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, length: int | None = None
) -> torch.Tensor:
    """All-gather the sequence chunks of ``group`` along ``dim``; backward = SUM over sp, local slice.

    ``length``: the real sequence length when the chunks carry trailing pads (see
    :func:`shard_sequence`); the result is cut to it. ``None``: keep everything.
    """
    return _GatherSequence.apply(x, dim, group, length)


# The all-to-all is a custom op with its own autograd: the compiler sees one opaque op with a
# registered backward. Written as an autograd.Function around the in-place ``dist`` call, Dynamo
# in torch 2.11 traced it without its backward: compiled Ulysses blocks got no gradient through
# attention (tests/distributed/test_compile.py fails there; torch 2.13 traced it correctly).
@torch.library.custom_op("miles::ulysses_all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk j goes to rank j, chunk j of the result came from rank j."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=_resolve_process_group(group_name))
    return out


@_all_to_all.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _all_to_all_setup(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


def _all_to_all_backward(ctx, grad: torch.Tensor):
    # An equal-split all-to-all is its own adjoint.
    return _all_to_all(grad.contiguous(), ctx.group_name), None


_all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable equal-split all-to-all along dim 0 over ``group`` (None: the world)."""
    group = group or dist.group.WORLD
    return _all_to_all(x.contiguous(), group.group_name)


def ulysses_all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Shard heads, gather sequence: (B, s, H, D) -> (B, u·s, H/u, D) over a Ulysses group of size u."""
    u = _group_size(group)
    if u == 1:
        return x
    b, s, h, d = x.shape
    if h % u != 0:
        raise ValueError(f"{h} attention heads are not divisible by the ulysses degree {u}")
    # (B, s, H, D) -> (u, B, s, H/u, D): chunk j (head group j) is sent to Ulysses rank j.
    x = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4)
    x = all_to_all(x, group)
    # (u, B, s, H/u, D), chunk j = rank j's tokens -> (B, u·s, H/u, D)
    return x.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def ulysses_all_to_all_inverse(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Inverse of :func:`ulysses_all_to_all`: (B, u·s, H/u, D) -> (B, s, H, D)."""
    u = _group_size(group)
    if u == 1:
        return x
    b, us, hu, d = x.shape
    s = us // u
    # (B, u·s, H/u, D) -> (u, B, s, H/u, D): token chunk j goes back to Ulysses rank j.
    x = x.reshape(b, u, s, hu, d).permute(1, 0, 2, 3, 4)
    x = all_to_all(x, group)
    # (u, B, s, H/u, D), chunk j = head group j -> (B, s, H, D)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s, u * hu, d)
