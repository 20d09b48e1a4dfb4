"""Parallel layout (dp x sp = ulysses x ring) and device-mesh construction."""

from miles.parallel.topology import (
    ParallelDims,
    ParallelMesh,
    build_parallel_mesh,
    resolve_ulysses_degree,
    valid_ulysses_degrees,
)

__all__ = [
    "ParallelDims",
    "ParallelMesh",
    "build_parallel_mesh",
    "resolve_ulysses_degree",
    "valid_ulysses_degrees",
]
