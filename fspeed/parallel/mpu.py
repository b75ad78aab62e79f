"""A `Mesh` over an external Megatron-style `mpu` (model-parallel unit), as DeepSpeed's
`initialize(mpu=...)` takes one.

    mesh = fs.Mesh.from_mpu(mpu)          # every rank; the mpu's process groups become the mesh axes

An mpu answers `get_data_parallel_{rank,group,world_size}()` and `get_model_parallel_*()`; the
model axis prefers `get_tensor_model_parallel_*()` where the mpu has them (Megatron-LM's
"model parallel" group spans tensor and pipeline ranks), and the pipe axis is taken from
`get_pipeline_model_parallel_*()` (or DeepSpeed's grid's `get_pipe_parallel_*()`) when present,
else it is 1. The groups are used as they are, in any rank order: the ranks gather every rank's
coordinates and groups and check together (so all raise alike) that the axes tile the world,
each rank at one point of the grid, each group the ranks that share the other coordinates, in
the order of the axis coordinate. A pipeline (pipe > 1) needs fspeed's own rank order, model
fastest, then data, then pipe (its tied-stage groups are computed from it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from .comm import all_gather_objects

AXES = ("pipe", "data", "model")
# one axis of the grid: (size, this rank's coordinate, the group's global ranks in group order, the group or None)
MpuAxis = tuple[int, int, list[int], Optional[dist.ProcessGroup]]
_PREFIXES = {"data": ("get_data_parallel",), "model": ("get_tensor_model_parallel", "get_model_parallel"),
             "pipe": ("get_pipeline_model_parallel", "get_pipe_parallel")}


def mpu_axes(mpu: Any, ravel: Callable[[list[int], list[int]], int]) -> dict[str, MpuAxis]:
    """Each mesh axis of `mpu`'s groups, checked by every rank together to tile the world (module
    docstring); `ravel(coords, sizes)` is the rank fspeed's own layout puts at `coords`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    axes = {axis: _axis(mpu, axis, rank) for axis in AXES}
    sizes = {axis: size for axis, (size, _, _, _) in axes.items()}
    mine = (rank, {axis: coord for axis, (_, coord, _, _) in axes.items()},
            {axis: ranks for axis, (_, _, ranks, _) in axes.items()})
    problem = _tiling_problem(all_gather_objects(mine, "mpu groups", world, rank), sizes, world, ravel)
    if problem:
        raise ValueError(f"Mesh.from_mpu: the mpu's groups do not form a pipe x data x model grid: {problem}")
    return axes


def _axis(mpu: Any, axis: str, rank: int) -> MpuAxis:
    """`axis` of `mpu`'s grid, as this rank sees it."""
    prefix = next((p for p in _PREFIXES[axis] if hasattr(mpu, f"{p}_world_size")), None)
    if prefix is None:
        if axis == "pipe":
            return 1, 0, [rank], None
        wanted = " or ".join(f"{p}_{{rank,group,world_size}}()" for p in _PREFIXES[axis])
        raise TypeError(f"Mesh.from_mpu: {type(mpu).__name__} has no {wanted} (Megatron's mpu interface)")
    missing = [f"{prefix}_{what}" for what in ("rank", "group", "world_size") if not hasattr(mpu, f"{prefix}_{what}")]
    if missing:
        raise TypeError(f"Mesh.from_mpu: {type(mpu).__name__} has {prefix}_world_size() but not {', '.join(missing)}")
    size, coord = int(getattr(mpu, f"{prefix}_world_size")()), int(getattr(mpu, f"{prefix}_rank")())
    if size == 1:
        return 1, coord, [rank], None
    group = getattr(mpu, f"{prefix}_group")()
    return size, coord, list(dist.get_process_group_ranks(group)), group


def _tiling_problem(gathered: list, sizes: dict[str, int], world: int, ravel) -> Optional[str]:
    """What is wrong with every rank's (rank, coordinates, group ranks), or None."""
    total = sizes["pipe"] * sizes["data"] * sizes["model"]
    if total != world:
        return (f"pipe x data x model = {sizes['pipe']} x {sizes['data']} x {sizes['model']} = {total}, "
                f"world size {world}")
    at: dict[tuple, int] = {}
    for rank, coords, _ in gathered:
        point = tuple(coords[a] for a in AXES)
        if any(not 0 <= c < sizes[a] for a, c in zip(AXES, point)):
            return f"rank {rank} reports coordinates {coords}, outside the sizes {sizes}"
        if point in at:
            return f"ranks {at[point]} and {rank} report the same coordinates {coords}"
        at[point] = rank
    for rank, coords, groups in gathered:
        for i, axis in enumerate(AXES):
            line = [at[tuple(k if j == i else coords[a] for j, a in enumerate(AXES))] for k in range(sizes[axis])]
            if groups[axis] != line:
                return (f"rank {rank}'s {axis} group holds ranks {groups[axis]}, and the ranks that share its other "
                        f"coordinates, by {axis} rank, are {line}")
    if sizes["pipe"] > 1:
        for point, rank in at.items():
            if ravel(list(point), [sizes[a] for a in AXES]) != rank:
                return (f"with pipeline stages, ranks must be ordered model fastest, then data, then pipe (fspeed's "
                        f"layout); rank {rank} is at {dict(zip(AXES, point))}")
    return None


__all__ = ["mpu_axes"]
