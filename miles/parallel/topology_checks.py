"""Startup checks of the parallel layout against the machines it runs on (pure functions).

The topology keeps Ulysses inside a node and lets the ring cross nodes: Ulysses groups are
``ulysses`` contiguous global ranks, and torchrun gives every node a contiguous block of
``LOCAL_WORLD_SIZE`` (``--nproc-per-node``) ranks, so a Ulysses group stays inside one node
exactly when ``ulysses`` divides the node's process count. Ulysses does two all-to-alls per
attention call and cannot overlap them with compute: across nodes (InfiniBand instead of
NVLink) it is several times slower, while the ring's K/V transfers hide behind compute.

    from miles.parallel.topology_checks import check_ulysses_within_node, local_world_size_from_env

    check_ulysses_within_node(dims, local_world_size_from_env())
"""

from __future__ import annotations

import math
import os

from miles.parallel.topology import ParallelDims, valid_ulysses_degrees

__all__ = [
    "check_ulysses_within_node",
    "local_world_size_from_env",
    "mesh_report",
    "node_note",
    "node_of_rank",
]


def local_world_size_from_env() -> int | None:
    """Processes per node: torchrun's ``LOCAL_WORLD_SIZE``, else the launch scripts' ``NPROC_PER_NODE``."""
    for name in ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def node_of_rank(rank: int, local_world_size: int) -> int:
    """The node that holds global ``rank`` (torchrun assigns each node a contiguous block of ranks)."""
    return rank // local_world_size


def check_ulysses_within_node(dims: ParallelDims, local_world_size: int | None) -> None:
    """Raise ``ValueError`` when a Ulysses group would span two nodes.

    ``local_world_size`` is the number of processes per node (``LOCAL_WORLD_SIZE``); ``None``
    (unknown) skips the check. On one node it always passes: the node holds every rank, and
    ``ulysses`` divides ``sp`` which divides the world size.
    """
    if local_world_size is None:
        return
    if local_world_size < 1:
        raise ValueError(f"local_world_size (processes per node) must be >= 1, got {local_world_size}")
    if local_world_size % dims.ulysses == 0:
        return
    fits = [u for u in valid_ulysses_degrees(dims.sp, dims.num_attention_heads) if local_world_size % u == 0]
    heads = f" and the {dims.num_attention_heads} attention heads" if dims.num_attention_heads else ""
    raise ValueError(
        f"--ulysses-degree {dims.ulysses} does not divide the {local_world_size} processes per node "
        f"(LOCAL_WORLD_SIZE / --nproc-per-node), so Ulysses groups would span two nodes and run their "
        f"all-to-alls over the inter-node network. Choose --ulysses-degree among {fits} (dividing "
        f"--sequence-parallel-size {dims.sp}{heads} and the processes per node); the ring "
        f"(sp / ulysses) takes the rest and may cross nodes. Or launch a multiple of {dims.ulysses} "
        f"processes per node."
    )


def mesh_report(
    cfg, heads: int, world_size: int, world_source: str, local_world_size: int | None
) -> tuple[ParallelDims, dict]:
    """The mesh, with the checks ParallelDims and the trainer apply, and its report section (the
    node note is added by the caller, after the input checks)."""
    p = cfg.parallel
    try:
        dims = ParallelDims(
            world_size=world_size,
            sequence_parallel_size=p.sequence_parallel_size,
            ulysses_degree=p.ulysses_degree,
            num_attention_heads=heads,
            replicate_size=p.replicate_size,
        )
    except ValueError as e:
        raise ValueError(f"invalid parallel layout (world size {world_size}, {world_source}): {e}") from None
    valid_u = valid_ulysses_degrees(dims.sp, heads)
    if p.ulysses_degree == 0:
        ulysses_note = f"auto: the largest of {valid_u} (divisors of sp {dims.sp} that divide {heads} heads)"
    else:
        ulysses_note = f"{dims.ulysses} set by --ulysses-degree"
    try:
        check_ulysses_within_node(dims, local_world_size)
    except ValueError as e:
        raise ValueError(f"invalid parallel layout: {e}") from None
    return dims, {
        "dp": dims.dp,
        "sp": dims.sp,
        "ulysses": dims.ulysses,
        "ring": dims.ring,
        "replicate": dims.replicate,
        "shard": dims.shard,
        "ulysses_auto": p.ulysses_degree == 0,
        "ulysses_note": ulysses_note,
        "node_note": None,
        "shard_groups": dims.shard_groups(),
        "groups": {
            "dp": dims.dp_groups(),
            "sp": dims.sp_groups(),
            "ulysses": dims.ulysses_groups(),
            "ring": dims.ring_groups(),
        },
    }


def node_note(dims: ParallelDims, world_size: int, local_world_size: int | None, local_source: str) -> str:
    if local_world_size is None:
        return (
            "processes per node unknown (set LOCAL_WORLD_SIZE or NPROC_PER_NODE): Ulysses groups stay inside "
            f"a node when the processes per node are a multiple of ulysses {dims.ulysses}"
        )
    num_nodes = math.ceil(world_size / local_world_size)
    ring_crosses = any(len({rank // local_world_size for rank in g}) > 1 for g in dims.ring_groups())
    return (
        f"{local_world_size} processes per node ({local_source}), {num_nodes} node(s): Ulysses groups stay "
        f"inside a node; ring groups {'cross nodes' if ring_crosses else 'stay inside a node'}"
    )
