"""USP self-attention and its install into a diffusers model through ``dispatch_attention_fn``.

``usp_attention`` = Ulysses all-to-all (heads sharded, sequence gathered), ring attention over
the ring group (or the ordinary local attention when ring = 1), inverse all-to-all.

Padded sequences (S % sp != 0, see ``comm.shard_sequence``): the chunks carry trailing pad
tokens. Pad KEYS must not be attended to; pad QUERIES are harmless (their outputs are dropped
by the gather, so their output gradient is exactly zero and adds nothing to dK/dV). With
ring = 1 the local attention runs on the first S tokens only (queries too, so every real
row is the very computation of sp = 1) and the pad rows of the output are zeros; with
ring > 1 each ring step cuts its K/V chunk to its real length (``ring.ring_attention``).

Install (``apply_dispatch_sp_attention``): the modeling module's global
``dispatch_attention_fn`` (found through the model class's MRO, so it is also found after
FSDP2 swaps the class to ``FSDP<Name>``) is replaced by a wrapper, and a marker
``_USPDispatchConfig`` carrying the groups is set as every attention processor's
``_parallel_config``. Diffusers' Wan processor forwards ``_parallel_config`` only for
self-attention and passes ``parallel_config=None`` for text and image cross-attention, so:

- marked call (self-attention)  -> ``usp_attention`` (no diffusers parallel_config downstream)
- any other call                -> the original ``dispatch_attention_fn``, untouched

A family whose processor forwards ``_parallel_config`` in its (masked) cross-attention too marks
only its self-attention modules (``only``: e.g. ``attn1``), through its family plan's installer.

The processors themselves are never replaced; the attention backend chosen with diffusers'
``set_attention_backend`` reaches the wrapper as the ordinary ``backend=`` keyword and picks
the ring kernel. The module global is process-wide (two experts share it), so the wrapper is
reference-counted and gated only by the marker; groups live in the marker, never in globals.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles.sequence_parallel.comm import ulysses_all_to_all, ulysses_all_to_all_inverse
from miles.sequence_parallel.ring import ring_attention
from miles.sequence_parallel.state import SequenceState, sequence_state

__all__ = ["usp_attention", "apply_dispatch_sp_attention", "find_dispatch_module"]

_DISPATCH_NAME = "dispatch_attention_fn"
_WRAPPED_ATTR = "__miles_usp_original__"
_REFCOUNT_ATTR = "__miles_usp_refcount__"


@dataclass(frozen=True, eq=False)
class _USPDispatchConfig:
    """Marker set as a processor's ``_parallel_config``: route this self-attention through USP.

    ``state``: the model's :class:`SequenceState`, whose ``seq_len`` (the real token count of
    the current call, recorded by the shard boundaries) tells the attention which keys are pads.
    """

    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    state: SequenceState | None = None

    def __deepcopy__(self, memo: dict) -> _USPDispatchConfig:
        # Process groups cannot be copied; a deep-copied model shares the marker (and the hooks).
        return self


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _default_dispatch() -> Callable[..., torch.Tensor]:
    from diffusers.models import attention_dispatch

    return attention_dispatch.dispatch_attention_fn


def usp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    backend: Any = None,
    local_attention: Callable[..., torch.Tensor] | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Non-causal self-attention over the full sequence from sequence-sharded inputs.

    ``query``/``key``/``value``: (B, c, H, D), this rank's chunk (chunk index = sp_rank =
    ring_rank · u + ulysses_rank) of a sequence of sp·c tokens. Returns (B, c, H, D).
    ``seq_len``: the real length S when the sequence carries trailing pads (sp·c - S < sp of
    them, see ``comm.shard_sequence``); pad keys are excluded, pad query rows are don't-care
    (zeros with ring = 1). ``None`` means no pads. ``backend`` is the diffusers attention backend
    of the call site; with ring = 1 the local attention is ``local_attention(q, k, v,
    backend=backend)`` (default: diffusers' ``dispatch_attention_fn``), so Ulysses only runs the
    same kernel as sp = 1, per head. With ring > 1 it selects the ring kernel (see
    ``ring.RING_KERNELS``).
    """
    # (B, c, H, D) -> (B, u·c, H/u, D): the contiguous token range of this rank's ring rank
    q, k, v = (ulysses_all_to_all(t, ulysses_group) for t in (query, key, value))
    ring = _size(ring_group)
    padded = q.shape[1] * ring
    if seq_len is not None:
        if not padded - _size(ulysses_group) * ring < seq_len <= padded:
            raise ValueError(
                f"seq_len={seq_len} does not fit {ring} ring chunk(s) of {q.shape[1]} tokens "
                f"(sp = {_size(ulysses_group) * ring}); expected sp·c - sp < seq_len <= sp·c. Under "
                f"activation checkpointing this is a block recomputed after a forward with another video "
                f"size: run each call's backward before the next call's forward when the size changes."
            )
        if seq_len == padded:
            seq_len = None
    if ring > 1:
        out = ring_attention(q, k, v, ring_group, backend=backend, seq_len=seq_len)
    else:
        dispatch = local_attention if local_attention is not None else _default_dispatch()
        if seq_len is None:
            out = dispatch(q, k, v, backend=backend)
        else:
            # Exactly sp = 1's attention on the S real tokens; the pad rows (dropped later) are zeros.
            q, k, v = (t[:, :seq_len] for t in (q, k, v))
            out = dispatch(q, k, v, backend=backend)
            # (B, S, H/u, D) -> (B, sp·c, H/u, D)
            out = F.pad(out, (0, 0, 0, 0, 0, padded - seq_len))
    # (B, u·c, H/u, D) -> (B, c, H, D)
    return ulysses_all_to_all_inverse(out, ulysses_group)


def _check_self_attention_args(bound: inspect.BoundArguments) -> None:
    args = bound.arguments
    problems = []
    if args.get("attn_mask") is not None:
        problems.append("an attention mask")
    if args.get("dropout_p", 0.0):
        problems.append(f"dropout_p={args['dropout_p']}")
    if args.get("is_causal", False):
        problems.append("is_causal=True")
    if args.get("scale") is not None:
        problems.append(f"an explicit scale={args['scale']}")
    if args.get("enable_gqa", False):
        problems.append("enable_gqa=True")
    if args.get("attention_kwargs"):
        problems.append(f"attention_kwargs={sorted(args['attention_kwargs'])}")
    if problems:
        raise ValueError(
            f"sequence-parallel self-attention got {', '.join(problems)}; USP supports only unmasked, "
            f"non-causal attention without dropout and with the default 1/sqrt(D) scale. Run with "
            f"--sequence-parallel-size 1, or remove these from the model's self-attention."
        )


def _make_wrapper(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    signature = inspect.signature(original)

    def dispatch_attention_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        config = kwargs.get("parallel_config")
        if not isinstance(config, _USPDispatchConfig):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        _check_self_attention_args(bound)
        a = bound.arguments
        return usp_attention(
            a["query"],
            a["key"],
            a["value"],
            ulysses_group=config.ulysses_group,
            ring_group=config.ring_group,
            backend=a.get("backend"),
            local_attention=original,
            seq_len=config.state.seq_len if config.state is not None else None,
        )

    dispatch_attention_fn.__doc__ = original.__doc__
    dispatch_attention_fn.__wrapped__ = original
    setattr(dispatch_attention_fn, _WRAPPED_ATTR, original)
    setattr(dispatch_attention_fn, _REFCOUNT_ATTR, 0)
    return dispatch_attention_fn


def find_dispatch_module(model: nn.Module):
    """The module defining ``dispatch_attention_fn`` for ``model``'s class, searched through its MRO."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and callable(getattr(module, _DISPATCH_NAME, None)):
            return module
    return None


def _attention_processors(model: nn.Module, only: str | None = None) -> list[Any]:
    seen: dict[int, Any] = {}
    for name, m in model.named_modules():
        if only is not None and name.rsplit(".", 1)[-1] != only:
            continue
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_parallel_config"):
            seen.setdefault(id(proc), proc)
    return list(seen.values())


def apply_dispatch_sp_attention(
    model: nn.Module,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    only: str | None = None,
) -> Callable[[], None]:
    """Install USP self-attention in ``model`` (in place); returns a function that removes it.

    ``only``: mark only the processors of attention modules with this name (e.g. ``attn1``), for a
    model whose processor class forwards its ``_parallel_config`` in cross-attention too."""
    module = find_dispatch_module(model)
    if module is None:
        mro = [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__]
        raise ValueError(
            f"no module in the class hierarchy of {type(model).__name__} ({mro}) defines {_DISPATCH_NAME}, "
            f"so sequence-parallel attention cannot be installed generically. Attach a family plan "
            f"(model._miles_sp_plan = SequenceParallelPlan(...)) with its own attention_installer, or run "
            f"with --sequence-parallel-size 1."
        )
    processors = _attention_processors(model, only)
    if not processors:
        raise ValueError(
            f"{type(model).__name__} has no attention processor with a `_parallel_config` attribute, so the "
            f"USP marker cannot reach {_DISPATCH_NAME}. Attach a family plan (model._miles_sp_plan) with its "
            f"own attention_installer, or run with --sequence-parallel-size 1."
        )

    current = getattr(module, _DISPATCH_NAME)
    wrapper = current if hasattr(current, _WRAPPED_ATTR) else _make_wrapper(current)
    setattr(wrapper, _REFCOUNT_ATTR, getattr(wrapper, _REFCOUNT_ATTR) + 1)
    setattr(module, _DISPATCH_NAME, wrapper)

    state = sequence_state(model)
    marker = _USPDispatchConfig(ulysses_group=ulysses_group, ring_group=ring_group, state=state)
    state.attention_pads = True  # usp_attention excludes pad keys
    # (processor, had an instance attribute, its value): the default lives on the class.
    saved = [(proc, "_parallel_config" in vars(proc), proc._parallel_config) for proc in processors]
    for proc in processors:
        proc._parallel_config = marker

    removed = False

    def remove() -> None:
        nonlocal removed
        if removed:
            return
        removed = True
        state.attention_pads = False
        for proc, had_own, old in saved:
            if proc._parallel_config is not marker:
                continue
            if had_own:
                proc._parallel_config = old
            else:
                del proc._parallel_config
        count = getattr(wrapper, _REFCOUNT_ATTR) - 1
        setattr(wrapper, _REFCOUNT_ATTR, count)
        if count == 0 and getattr(module, _DISPATCH_NAME) is wrapper:
            setattr(module, _DISPATCH_NAME, getattr(wrapper, _WRAPPED_ATTR))

    return remove
