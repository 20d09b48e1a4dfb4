"""Count the bytes every collective of one rank moves, by kind: Ulysses all-to-all, ring, the SP
boundary gather, FSDP all-gather / reduce-scatter.

A ``TorchDispatchMode`` sees every ``c10d`` and ``_c10d_functional`` op at the dispatcher (the
level every torch.distributed API reaches, whatever its Python name in this torch version), and
the SP modules tell it whose op it is: the Ulysses all-to-all is its own op
(``miles::ulysses_all_to_all``); while ring attention or the sequence gather runs (forward or
backward), their ops are tagged so; untagged all-gathers and reduce-scatters are FSDP2's. Under
the fake process group nothing moves, but the buffers are the real ones.

Per op two numbers: ``buffer`` — the bytes of the tensor this rank hands to the collective (its
input; for a receive, the buffer filled) — and ``wire`` — what leaves this rank on a ring/pairwise
algorithm over a group of n: all-to-all (n-1)/n, all-gather (n-1) x input, reduce-scatter
(n-1)/n, all-reduce 2(n-1)/n, send/recv 1x.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_INPUT_FIRST = {"allreduce_", "allreduce_coalesced_", "send", "recv_", "recv_any_source_", "broadcast_"}
_KIND = {
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "send": "send",
    "recv": "recv",
    "broadcast": "broadcast",
}


def op_kind(name: str) -> str | None:
    for key, kind in _KIND.items():
        if key in name:
            return kind
    return None


def wire_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {
        "all_to_all": (n - 1) / n,
        "all_gather": float(n - 1),
        "reduce_scatter": (n - 1) / n,
        "all_reduce": 2 * (n - 1) / n,
    }.get(kind, 1.0)


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Sums ``buffer`` bytes per (category, kind); categories come from :meth:`tagged`."""

    def __init__(self):
        super().__init__()
        self.buffer: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.tag: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional", "miles"):
            name = func._opname
            kind = op_kind(name)
            if kind is not None:
                if func.namespace != "c10d" or name in _INPUT_FIRST:
                    nbytes = _tensor_bytes(args[0])
                else:  # c10d ops take (output, input, ...)
                    nbytes = _tensor_bytes(args[1])
                category = (
                    "ulysses"  # miles::ulysses_all_to_all, a custom op: its inner c10d op is not seen here
                    if func.namespace == "miles"
                    else self.tag or ("fsdp" if kind in ("all_gather", "reduce_scatter") else "other")
                )
                self.buffer[(category, kind)] += nbytes
                self.calls[(category, kind)] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def tagged(self, tag: str):
        outer, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = outer


def _tag_function(counter: CollectiveCounter, fn_cls, tag: str, saved: list) -> None:
    """Run ``fn_cls.forward`` and ``fn_cls.backward`` (an autograd Function) under ``tag``."""
    for attr in ("forward", "backward"):
        original = fn_cls.__dict__[attr]
        saved.append((fn_cls, attr, original))
        fn = original.__func__ if isinstance(original, staticmethod) else original

        def wrapped(*args, _fn=fn, **kwargs):
            with counter.tagged(tag):
                return _fn(*args, **kwargs)

        setattr(fn_cls, attr, staticmethod(wrapped))


@contextlib.contextmanager
def count_collectives():
    """``with count_collectives() as counter:`` — every collective inside is counted and tagged."""
    from miles.sequence_parallel import comm, ring

    counter = CollectiveCounter()
    saved: list = []
    _tag_function(counter, comm._GatherSequence, "sp_boundary", saved)
    _tag_function(counter, ring._RingAttention, "ring", saved)
    try:
        with counter:
            yield counter
    finally:
        for cls, attr, original in saved:
            setattr(cls, attr, original)


def summarize(counter: CollectiveCounter, group_sizes: dict[str, int], num_layers: int) -> list[dict]:
    """Rows per (category, kind): calls, buffer and wire bytes per step and per layer."""
    rows = []
    for (category, kind), nbytes in sorted(counter.buffer.items()):
        wire = nbytes * wire_factor(kind, group_sizes.get(category, 1))
        rows.append(
            {
                "category": category,
                "kind": kind,
                "group_size": group_sizes.get(category),
                "calls": counter.calls[(category, kind)],
                "buffer_bytes": nbytes,
                "wire_bytes": wire,
                "buffer_bytes_per_layer": nbytes / num_layers,
                "wire_bytes_per_layer": wire / num_layers,
            }
        )
    return rows
