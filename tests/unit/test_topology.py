"""Topology as pure functions: coordinates, groups, validation, auto Ulysses degree."""

from __future__ import annotations

import itertools

import pytest

from miles.parallel.topology import ParallelDims, resolve_ulysses_degree, valid_ulysses_degrees


def test_coords_layout_ulysses_contiguous_ring_strided():
    dims = ParallelDims(world_size=8, sequence_parallel_size=4, ulysses_degree=2)
    assert (dims.dp, dims.sp, dims.ulysses, dims.ring) == (2, 4, 2, 2)
    # rank = dp_rank * sp + ring_rank * ulysses + ulysses_rank
    assert [dims.coords(r) for r in range(8)] == [
        (0, 0, 0, 0),
        (0, 1, 1, 0),
        (0, 2, 0, 1),
        (0, 3, 1, 1),
        (1, 0, 0, 0),
        (1, 1, 1, 0),
        (1, 2, 0, 1),
        (1, 3, 1, 1),
    ]
    assert dims.sp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.ulysses_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("world,sp,u", [(1, 1, 1), (4, 4, 4), (4, 4, 1), (8, 4, 2), (12, 6, 3), (16, 8, 2)])
def test_groups_partition_the_world_and_agree_with_coords(world, sp, u):
    dims = ParallelDims(world_size=world, sequence_parallel_size=sp, ulysses_degree=u)
    for groups, size in [
        (dims.dp_groups(), dims.dp),
        (dims.sp_groups(), sp),
        (dims.ulysses_groups(), u),
        (dims.ring_groups(), sp // u),
    ]:
        assert sorted(itertools.chain(*groups)) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        dp_rank, sp_rank, u_rank, r_rank = dims.coords(rank)
        assert dims.rank_of(dp_rank, r_rank, u_rank) == rank
        assert dims.group_of(dims.sp_groups(), rank)[sp_rank] == rank
        assert dims.group_of(dims.dp_groups(), rank)[dp_rank] == rank
        assert dims.group_of(dims.ulysses_groups(), rank)[u_rank] == rank
        assert dims.group_of(dims.ring_groups(), rank)[r_rank] == rank
        ug = dims.group_of(dims.ulysses_groups(), rank)
        assert ug == list(range(ug[0], ug[0] + u))  # contiguous
        rg = dims.group_of(dims.ring_groups(), rank)
        assert all(b - a == u for a, b in itertools.pairwise(rg))  # strided by ulysses


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=4, sequence_parallel_size=0), "sequence-parallel-size must be >= 1"),
        (dict(world_size=4, sequence_parallel_size=2, ulysses_degree=-1), "ulysses-degree must be >= 0"),
        (dict(world_size=6, sequence_parallel_size=4), "not divisible by --sequence-parallel-size 4"),
        (
            dict(world_size=8, sequence_parallel_size=4, ulysses_degree=3),
            r"choose a ulysses degree among \[1, 2, 4\]",
        ),
        (dict(world_size=0), "world_size must be >= 1"),
    ],
)
def test_dims_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_dims_is_frozen_and_rank_checked():
    dims = ParallelDims(world_size=4, sequence_parallel_size=2, ulysses_degree=1)
    with pytest.raises(AttributeError):
        dims.world_size = 8
    with pytest.raises(ValueError, match="out of range"):
        dims.coords(4)


def test_auto_ulysses_degree():
    assert resolve_ulysses_degree(4, 0, 40) == 4
    assert resolve_ulysses_degree(8, 0, 12) == 4  # 8 does not divide 12 -> ulysses 4, ring 2
    assert resolve_ulysses_degree(8, 0, 5) == 1  # ring takes everything
    assert resolve_ulysses_degree(6, 0, 40) == 2
    assert resolve_ulysses_degree(1, 0, 40) == 1
    assert resolve_ulysses_degree(4, 2, 40) == 2
    assert valid_ulysses_degrees(8, 12) == [1, 2, 4]
    # in ParallelDims: with the head count auto is resolved; without it auto means pure Ulysses
    assert ParallelDims(world_size=8, sequence_parallel_size=8, num_attention_heads=12).ulysses_degree == 4
    assert ParallelDims(world_size=8, sequence_parallel_size=8, num_attention_heads=12).ring == 2
    assert ParallelDims(world_size=8, sequence_parallel_size=4).ulysses_degree == 4
    assert ParallelDims(world_size=8, sequence_parallel_size=1).ring == 1


def test_explicit_ulysses_degree_must_divide_heads():
    with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4\]"):
        resolve_ulysses_degree(8, 8, 12)
    with pytest.raises(ValueError, match="must divide both"):
        ParallelDims(world_size=8, sequence_parallel_size=8, ulysses_degree=8, num_attention_heads=12)
    with pytest.raises(ValueError, match=">= 0"):
        resolve_ulysses_degree(4, -1, 12)


def test_heads_that_sp_does_not_divide():
    # Wan2.1-1.3B: 12 heads; Wan2.2-5B: 24 heads; a tiny model: 6 heads. Auto keeps the largest
    # Ulysses degree dividing both, the ring takes the rest; an explicit bad degree lists the valid ones.
    assert resolve_ulysses_degree(4, 0, 6) == 2
    assert resolve_ulysses_degree(16, 0, 12) == 4
    assert resolve_ulysses_degree(16, 0, 24) == 8
    assert resolve_ulysses_degree(8, 0, 24) == 8
    dims = ParallelDims(world_size=16, sequence_parallel_size=16, num_attention_heads=12)
    assert (dims.ulysses, dims.ring) == (4, 4)
    with pytest.raises(
        ValueError, match=r"ulysses_degree=4 .* num_attention_heads=6.*Valid degrees: \[1, 2\]"
    ):
        resolve_ulysses_degree(4, 4, 6)
    with pytest.raises(ValueError, match=r"Valid degrees: \[1, 2, 4, 8\]"):
        resolve_ulysses_degree(16, 16, 24)


def test_hsdp_groups():
    # 16 ranks on 2 nodes of 8: replicate 2, shard groups of 8 (one node), sp 4 inside them.
    dims = ParallelDims(world_size=16, sequence_parallel_size=4, ulysses_degree=2, replicate_size=2)
    assert (dims.replicate, dims.shard, dims.dp_shard, dims.dp) == (2, 8, 2, 4)
    assert dims.shard_groups() == [list(range(8)), list(range(8, 16))]
    assert dims.replicate_groups() == [[j, j + 8] for j in range(8)]
    for rank in range(16):  # every sp group lies inside one shard group
        (sp_group,) = [g for g in dims.sp_groups() if rank in g]
        assert set(sp_group) <= set(dims.group_of(dims.shard_groups(), rank))
    # replicate = world: shard groups of one rank (DDP-like); replicate = 1: one group of all ranks
    ddp = ParallelDims(world_size=4, replicate_size=4)
    assert ddp.shard_groups() == [[0], [1], [2], [3]] and ddp.replicate_groups() == [[0, 1, 2, 3]]
    assert ParallelDims(world_size=4).shard_groups() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(world_size=8, replicate_size=3),
            r"not divisible by --parallel.replicate-size 3.*\[1, 2, 4, 8\]",
        ),
        (dict(world_size=8, replicate_size=0), "replicate-size must be >= 1"),
        (
            dict(world_size=8, sequence_parallel_size=4, replicate_size=4),
            r"shard groups of 2 ranks.*sequence-parallel groups.*replicate_size among \[1, 2\]",
        ),
    ],
)
def test_hsdp_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)
