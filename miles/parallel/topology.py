"""Parallel layout: data parallel (dp) x sequence parallel (sp = ulysses x ring).

Coordinates are pure functions of the global rank, so they can be checked without
``torch.distributed``:

    global rank = dp_rank * sp + sp_rank,   sp_rank = ring_rank * ulysses + ulysses_rank

Ulysses ranks are contiguous (its all-to-all is bandwidth-hungry: keep it inside a node, on
NVLink); ring ranks are strided by ``ulysses`` (its K/V transfers overlap with compute, so
it tolerates the slower cross-node links). The chunk of the token sequence a rank holds is
its ``sp_rank``; after the Ulysses all-to-all a rank holds the contiguous chunk
``ring_rank`` of length S / ring.

``build_parallel_mesh`` turns the layout into a ``DeviceMesh`` with axes
``("dp", "ring", "ulysses")`` plus the flattened ``"sp"`` (ring x ulysses) and ``"dp_sp"``
(all ranks; the mesh FSDP2 shards parameters over) axes, and checks that the groups it got
are the ones the pure functions describe.

HSDP (``replicate_size`` R > 1): dp splits into ``replicate`` x ``dp_shard`` and the mesh axes
are ``("replicate", "dp_shard", "ring", "ulysses")``. FSDP2 gets the 2-D mesh
``("replicate", "shard")``, where a shard group is W / R contiguous ranks (one node, when R is the
number of nodes) holding whole sp groups, and a replicate group is R ranks strided by W / R:
parameters are sharded within a shard group and replicated across them; gradients are
reduce-scattered inside the shard group and all-reduced across the replicas. Data parallelism
is unchanged (dp = R x dp_shard ranks hold different samples):

    shard group   = ranks [k * W/R, (k+1) * W/R)          (k = replicate rank)
    replicate grp = ranks {j + k * W/R : k < R}           (j = rank within the shard group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "ParallelDims",
    "ParallelMesh",
    "build_parallel_mesh",
    "resolve_ulysses_degree",
    "valid_ulysses_degrees",
]


def valid_ulysses_degrees(sequence_parallel_size: int, num_attention_heads: int | None = None) -> list[int]:
    """Divisors of ``sequence_parallel_size`` that also divide ``num_attention_heads`` (if given)."""
    return [
        u
        for u in range(1, sequence_parallel_size + 1)
        if sequence_parallel_size % u == 0 and (num_attention_heads is None or num_attention_heads % u == 0)
    ]


def resolve_ulysses_degree(sequence_parallel_size: int, requested: int, num_attention_heads: int) -> int:
    """The Ulysses degree to use for ``sequence_parallel_size`` ranks.

    ``requested == 0`` means auto: the largest divisor of sp that divides the number of
    attention heads (Ulysses keeps forward and input gradients bitwise equal to sp=1); the
    ring takes the rest. An explicit degree must divide both sp and the heads.
    """
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    if requested < 0:
        raise ValueError(f"ulysses_degree must be >= 0 (0 = auto), got {requested}")
    if num_attention_heads < 1:
        raise ValueError(f"num_attention_heads must be >= 1, got {num_attention_heads}")
    valid = valid_ulysses_degrees(sequence_parallel_size, num_attention_heads)
    if requested == 0:
        return max(valid)
    if requested not in valid:
        raise ValueError(
            f"ulysses_degree={requested} is not valid for sequence_parallel_size={sequence_parallel_size} "
            f"and num_attention_heads={num_attention_heads}: it must divide both. "
            f"Valid degrees: {valid} (or 0 for auto)."
        )
    return requested


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Parallel degrees of one run; validates itself on construction.

    ``ulysses_degree = 0`` means auto: resolved with :func:`resolve_ulysses_degree` when
    ``num_attention_heads`` is given, else to ``sequence_parallel_size`` (pure Ulysses; the
    head-count check then happens in ``apply_sequence_parallel``).
    """

    world_size: int
    sequence_parallel_size: int = 1
    ulysses_degree: int = 0
    num_attention_heads: int | None = None
    replicate_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        sp = self.sequence_parallel_size
        if sp < 1:
            raise ValueError(f"--sequence-parallel-size must be >= 1, got {sp}")
        if self.ulysses_degree < 0:
            raise ValueError(f"--ulysses-degree must be >= 0 (0 = auto), got {self.ulysses_degree}")
        if self.world_size % sp != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by --sequence-parallel-size {sp}: "
                f"choose sp among the divisors of the world size {_divisors(self.world_size)}"
            )
        if self.ulysses_degree and sp % self.ulysses_degree != 0:
            raise ValueError(
                f"--sequence-parallel-size {sp} is not divisible by --ulysses-degree {self.ulysses_degree}: "
                f"choose a ulysses degree among {_divisors(sp)} (ring = sp / ulysses), or 0 for auto"
            )
        self._check_replicate()
        if self.num_attention_heads is not None:
            resolved = resolve_ulysses_degree(sp, self.ulysses_degree, self.num_attention_heads)
        else:
            resolved = self.ulysses_degree or sp
        object.__setattr__(self, "ulysses_degree", resolved)

    def _check_replicate(self) -> None:
        R, W, sp = self.replicate_size, self.world_size, self.sequence_parallel_size
        if R < 1:
            raise ValueError(f"--parallel.replicate-size must be >= 1 (1 = plain FSDP), got {R}")
        if W % R != 0:
            raise ValueError(
                f"world size {W} is not divisible by --parallel.replicate-size {R}: choose the number of "
                f"replicas among the divisors of the world size {_divisors(W)} (typically the number of nodes)"
            )
        if (W // R) % sp != 0:
            fits = [r for r in _divisors(W) if (W // r) % sp == 0]
            raise ValueError(
                f"--parallel.replicate-size {R} leaves shard groups of {W // R} ranks, which do not hold whole "
                f"sequence-parallel groups of --sequence-parallel-size {sp} (an sp group must share one "
                f"parameter shard layout): choose replicate_size among {fits}, or a smaller sp"
            )

    @property
    def sp(self) -> int:
        return self.sequence_parallel_size

    @property
    def replicate(self) -> int:
        """HSDP replicas (1: plain FSDP)."""
        return self.replicate_size

    @property
    def shard(self) -> int:
        """Ranks one FSDP shard group holds: parameters, gradients and optimizer state are divided by it."""
        return self.world_size // self.replicate_size

    @property
    def dp_shard(self) -> int:
        """dp ranks inside one shard group."""
        return self.shard // self.sequence_parallel_size

    @property
    def ulysses(self) -> int:
        return self.ulysses_degree

    @property
    def ring(self) -> int:
        return self.sequence_parallel_size // self.ulysses_degree

    @property
    def dp(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(dp_rank, sp_rank, ulysses_rank, ring_rank)`` of a global rank."""
        self._check_rank(rank)
        dp_rank, sp_rank = divmod(rank, self.sp)
        ring_rank, ulysses_rank = divmod(sp_rank, self.ulysses)
        return dp_rank, sp_rank, ulysses_rank, ring_rank

    def rank_of(self, dp_rank: int, ring_rank: int, ulysses_rank: int) -> int:
        """Inverse of :meth:`coords`."""
        return dp_rank * self.sp + ring_rank * self.ulysses + ulysses_rank

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same sequence chunk of different samples (one group per sp_rank)."""
        return [[d * self.sp + s for d in range(self.dp)] for s in range(self.sp)]

    def sp_groups(self) -> list[list[int]]:
        """Ranks sharing one sample's sequence (contiguous blocks of sp)."""
        return [[d * self.sp + s for s in range(self.sp)] for d in range(self.dp)]

    def ulysses_groups(self) -> list[list[int]]:
        """Contiguous groups of ``ulysses`` ranks inside each sp group."""
        return [
            [self.rank_of(d, r, u) for u in range(self.ulysses)]
            for d in range(self.dp)
            for r in range(self.ring)
        ]

    def ring_groups(self) -> list[list[int]]:
        """Groups of ``ring`` ranks strided by ``ulysses`` inside each sp group."""
        return [
            [self.rank_of(d, r, u) for r in range(self.ring)]
            for d in range(self.dp)
            for u in range(self.ulysses)
        ]

    def shard_groups(self) -> list[list[int]]:
        """FSDP shard groups: ``shard`` contiguous ranks each (all ranks when replicate = 1)."""
        return [list(range(k * self.shard, (k + 1) * self.shard)) for k in range(self.replicate)]

    def replicate_groups(self) -> list[list[int]]:
        """HSDP replicate groups: ranks holding the same parameter shard, strided by ``shard``."""
        return [[j + k * self.shard for k in range(self.replicate)] for j in range(self.shard)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        """The group in ``groups`` that contains ``rank``."""
        self._check_rank(rank)
        (group,) = [g for g in groups if rank in g]
        return group


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelMesh:
    """The device mesh of a run and the sub-meshes / groups named by purpose.

    - ``fsdp_mesh``: what FSDP2 shards parameters over: 1-D over all dp x sp ranks, or under
      HSDP the 2-D ``("replicate", "shard")`` mesh (``fully_shard`` on a 2-D mesh is HSDP).
    - ``dp_mesh`` / ``dp_group``: ranks that hold different samples; data is split over it.
    - ``sp_group``: ranks that share one sample's sequence; boundaries shard/gather over it.
    - ``ulysses_group`` / ``ring_group``: the two factors of ``sp_group`` used by attention.
    """

    dims: ParallelDims
    device_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    sp_mesh: DeviceMesh
    dp_mesh: DeviceMesh

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.sp_mesh.get_group()

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("ulysses")

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("ring")

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def sp_rank(self) -> int:
        return self.sp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def sp_size(self) -> int:
        return self.dims.sp


def _hsdp_meshes(
    dims: ParallelDims, device_type: str
) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh, DeviceMesh]:
    """(root, dp, sp, fsdp) meshes: the root axes, and FSDP's mesh 1-D (plain) or 2-D (HSDP)."""
    if dims.replicate == 1:
        mesh = init_device_mesh(
            device_type, (dims.dp, dims.ring, dims.ulysses), mesh_dim_names=("dp", "ring", "ulysses")
        )
        sp_mesh = mesh["ring", "ulysses"]._flatten("sp")
        fsdp_mesh = mesh["dp", "ring", "ulysses"]._flatten("dp_sp")
        return mesh, mesh["dp"], sp_mesh, fsdp_mesh
    names = ("replicate", "dp_shard", "ring", "ulysses")
    mesh = init_device_mesh(
        device_type, (dims.replicate, dims.dp_shard, dims.ring, dims.ulysses), mesh_dim_names=names
    )
    dp_mesh = mesh["replicate", "dp_shard"]._flatten("dp")
    sp_mesh = mesh["ring", "ulysses"]._flatten("sp")
    shard_mesh = mesh["dp_shard", "ring", "ulysses"]._flatten("shard")
    # (replicate, shard): bookkept from the two meshes (slicing a flattened axis off the root is
    # deprecated from torch 2.11 on; older releases have no _concatenate)
    if hasattr(DeviceMesh, "_concatenate"):
        fsdp_mesh = DeviceMesh._concatenate([mesh["replicate"], shard_mesh])
    else:
        fsdp_mesh = mesh["replicate", "shard"]
    return mesh, dp_mesh, sp_mesh, fsdp_mesh


def build_parallel_mesh(dims: ParallelDims, device_type: str = "cuda") -> ParallelMesh:
    """Build the (dp, ring, ulysses) device mesh — (replicate, dp_shard, ring, ulysses) under HSDP;
    needs ``torch.distributed`` initialised.

    Collective: every rank must call it, with the same ``dims``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_parallel_mesh needs torch.distributed initialised (dist.init_process_group)"
        )
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"ParallelDims.world_size={dims.world_size} but torch.distributed has {world} ranks")
    mesh, dp_mesh, sp_mesh, fsdp_mesh = _hsdp_meshes(dims, device_type)
    parallel_mesh = ParallelMesh(
        dims=dims, device_mesh=mesh, fsdp_mesh=fsdp_mesh, sp_mesh=sp_mesh, dp_mesh=dp_mesh
    )
    _check_groups(parallel_mesh, dist.get_rank())
    return parallel_mesh


def _check_groups(parallel_mesh: ParallelMesh, rank: int) -> None:
    """The groups the mesh gave must be the ones the pure functions describe."""
    dims, fsdp_mesh = parallel_mesh.dims, parallel_mesh.fsdp_mesh
    expected = {
        "dp": dims.group_of(dims.dp_groups(), rank),
        "sp": dims.group_of(dims.sp_groups(), rank),
        "ulysses": dims.group_of(dims.ulysses_groups(), rank),
        "ring": dims.group_of(dims.ring_groups(), rank),
        "shard": dims.group_of(dims.shard_groups(), rank),
    }
    got = {
        "dp": dist.get_process_group_ranks(parallel_mesh.dp_group),
        "sp": dist.get_process_group_ranks(parallel_mesh.sp_group),
        "ulysses": dist.get_process_group_ranks(parallel_mesh.ulysses_group),
        "ring": dist.get_process_group_ranks(parallel_mesh.ring_group),
        "shard": dist.get_process_group_ranks(fsdp_mesh.get_group(fsdp_mesh.ndim - 1)),
    }
    if dims.replicate > 1:
        expected["replicate"] = dims.group_of(dims.replicate_groups(), rank)
        got["replicate"] = dist.get_process_group_ranks(fsdp_mesh.get_group(0))
    assert got == expected, f"device mesh groups {got} differ from the topology {expected}"
    dp_rank, sp_rank, _, _ = dims.coords(rank)
    assert (parallel_mesh.dp_rank, parallel_mesh.sp_rank) == (dp_rank, sp_rank)
