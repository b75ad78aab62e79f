"""A plan resolved for one parameter tree on one mesh: the `Layout`, static and hashable.

    layout = resolve(plan, params, mesh.sizes, mesh.coords, model.logical_axes)

The tree is flattened once, here. Per parameter: its placement (from the plan's transforms), its
tensor-parallel local shape and its unit. A unit is what ZeRO-3 gathers together and what
gradients are delivered by during backward: a layer (`blocks.3` for `blocks.3.attn.wqkv`,
`layers.0` for `layers.0.weight`) or a top-level entry (`wte`). Under ZeRO-3 each unit's
partitioned parameters (placement.params == "data") are flattened, padded to a multiple of N and
split into N contiguous shards; its persistent ones (at most `param_persistence_threshold`
elements each, DeepSpeed's rule, within `model_persistence_threshold` in total) keep their
compute copy whole on every rank, while their gradients, masters and optimizer state are
partitioned as DeepSpeed's are: all persistent parameters together form one flat buffer, padded
to a multiple of N and split into N contiguous partitions.

Storage (what a rank keeps in its flat buffers):

    stages 0-2   the tensor-parallel local tree, whole; ZeRO 1-2's masters, optimizer state and
                 reduced gradients are the rank's slice of it (`partition`)
    stage 3      `storage` (masters, optimizer state, reduced gradients): per unit its 1/N flat
                 shard, then the rank's 1/N partition of the persistent parameters;
                 `param_storage` (the compute parameters): the same, then every persistent
                 parameter whole (padded to N partitions, the all-gather's output). The compute
                 copy of the partition is what the optimizer's cast writes before that all-gather
                 (DeepSpeed's `ds_tensor` of a persistent parameter, beside its whole `data`). On
                 one data rank nothing is partitioned and both are the parameters whole, by unit.

A slice or shard is listed as the 1-D pieces of the parameters that fall in it, each under its
parameter's path (a parameter cut at a boundary is a piece on two ranks), and a zero `.pad` piece
where the padded buffer runs past the last parameter: optimizers see parameter paths (masks,
groups) and checkpoints name real parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import optree
import torch

from ..flat import FlatLayout
from ..pytree import PyTree, subtree, tree_flatten, tree_flatten_with_paths, tree_unflatten
from .comm import ceil_div
from .config import ZeroConfig
from .pipeline_transform import StagePlan
from .plan import ParamEntry, Placement, Plan
from .specs import PartitionSpec, local_shape


@dataclass(frozen=True)
class ParamInfo:
    path: str
    shape: tuple[int, ...]
    axes: tuple[Optional[str], ...]
    placement: Placement
    local_shape: tuple[int, ...]
    unit: str

    @property
    def spec(self) -> PartitionSpec:
        return self.placement.compute

    @property
    def tp_sharded(self) -> bool:
        return "model" in self.spec.axes()

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class UnitInfo:
    """One unit: its parameters (indices into `Layout.params`, in flat order), which of them are
    sharded (stage 3), and the flat layout of those (`shard_layout`, full paths)."""

    name: str
    index: int
    params: tuple[int, ...]
    sharded_params: tuple[int, ...]
    shard_layout: FlatLayout
    shard_numel: int  # ceil(sharded numel / N); 0 without sharded parameters
    tree: Optional[optree.PyTreeSpec]  # the unit's subtree structure, None when it is not a subtree

    @property
    def sharded(self) -> bool:
        return bool(self.sharded_params)

    @property
    def resident_params(self) -> tuple[int, ...]:
        return tuple(i for i in self.params if i not in self.sharded_params)

    @property
    def numel(self) -> int:
        """Elements of the sharded parameters, gathered (stage 3)."""
        return self.shard_layout.numel


@dataclass(frozen=True)
class Layout:
    """A plan resolved for given params and mesh sizes/coordinates (module docstring)."""

    plan: Plan
    zero: ZeroConfig
    mesh_sizes: tuple[tuple[str, int], ...]
    mesh_coords: tuple[tuple[str, int], ...]
    params: tuple[ParamInfo, ...]
    local: FlatLayout  # the TP-local parameter tree
    units: tuple[UnitInfo, ...]
    storage: FlatLayout  # what a rank stores (module docstring)
    partition: FlatLayout  # stages 1-2: this rank's slice of `local`, as pieces (module docstring)
    shard_starts: tuple[int, ...]  # stage 3: where each unit's shard starts in `storage` (-1: none)
    tensor_axes: tuple[str, ...] = ()  # logical axes sliced over `model`
    pipeline: Optional[StagePlan] = None  # the stages' layers; `params` are then this stage's only
    persistent: tuple[int, ...] = ()  # stage 3 on several data ranks: the persistent parameters, in storage order
    param_storage: Optional[FlatLayout] = None  # what the compute parameters hold (module docstring)

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def data_size(self) -> int:
        return dict(self.mesh_sizes).get("data", 1)

    @property
    def model_size(self) -> int:
        return dict(self.mesh_sizes).get("model", 1)

    @property
    def data_rank(self) -> int:
        return dict(self.mesh_coords).get("data", 0)

    @property
    def partition_numel(self) -> int:
        """Stages 1-2: elements of this rank's slice of the (padded) flat buffer."""
        return ceil_div(self.local.numel, self.data_size)

    @property
    def persistent_layout(self) -> FlatLayout:
        """Stage 3: the persistent parameters as one flat buffer (their whole compute copies)."""
        return labelled_layout([self.params[i].path for i in self.persistent],
                               [self.params[i].local_shape for i in self.persistent])

    @property
    def persistent_numel(self) -> int:
        return sum(self.params[i].local_numel for i in self.persistent)

    @property
    def persistent_part(self) -> int:
        """Stage 3: elements of a rank's partition of the persistent parameters (padded)."""
        return ceil_div(self.persistent_numel, self.data_size)

    @property
    def persistent_start(self) -> int:
        """Stage 3: where the persistent partition starts in `storage` and in `param_storage` (after
        the units' shards); the whole persistent parameters follow it in `param_storage`."""
        return sum(u.shard_numel for u in self.units)

    @property
    def info(self) -> dict[str, ParamInfo]:
        return {p.path: p for p in self.params}

    @property
    def sharded_units(self) -> tuple[UnitInfo, ...]:
        return tuple(u for u in self.units if u.sharded)

    def describe(self) -> str:
        return f"{self.plan!r} on mesh {dict(self.mesh_sizes)}"

    @property
    def is_local(self) -> bool:
        """No plan on one process: what a state built without plan= and mesh= has."""
        return not self.plan.transforms and all(size == 1 for _, size in self.mesh_sizes)


LOCAL_MESH = {"pipe": 1, "data": 1, "model": 1}


def default_unit(path: str) -> str:
    """The unit of a parameter: `blocks.3` for `blocks.3.attn.wqkv`, else the top-level entry."""
    parts = path.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def resolve(plan: Plan, params: PyTree, mesh_sizes: Mapping[str, int], mesh_coords: Mapping[str, int],
            logical_axes: Optional[Mapping[str, Sequence[Optional[str]]]] = None,
            units: Optional[Mapping[str, str]] = None, layers: Any = None) -> Layout:
    """Resolve `plan` for `params` (global shapes; meta tensors are fine) on a mesh with the given
    sizes and coordinates. `logical_axes` (the model's) are needed for tensor slicing; `units`
    (the model's: parameter path -> unit) default to `default_unit`; `layers` (the model's
    `LayerSequence`) are what a pipeline cuts into stages."""
    return resolve_flat(plan, *tree_flatten_with_paths(params), mesh_sizes, mesh_coords, logical_axes, units, layers)


def resolve_flat(plan: Plan, paths: Sequence[str], leaves: Sequence[torch.Tensor], treedef: optree.PyTreeSpec,
                 mesh_sizes: Mapping[str, int], mesh_coords: Mapping[str, int],
                 logical_axes: Optional[Mapping[str, Sequence[Optional[str]]]] = None,
                 units: Optional[Mapping[str, str]] = None, layers: Any = None) -> Layout:
    """`resolve` of a tree already flattened with paths (the one flattening a state's build needs).
    Under a pipeline the layout is the stage's: its parameters only, in a tree whose other leaves are
    None (so paths and the unit subtrees are the model's)."""
    stage_plan = None
    pipe = plan.find("pipeline")
    if pipe is not None:
        if layers is None:
            raise ValueError("a pipeline plan needs the model's layer sequence (Model.layers): pass model= to "
                             "init_train_state (the reference GPT and fs.models.sequential(...) have one)")
        zero = plan.find("zero")
        if zero is not None and zero.config.stage == 3:
            raise ValueError("ZeRO stage 3 with a pipeline: not allowed (a stage's parameters are whole on its "
                             "data ranks; DeepSpeed allows stages 0-1 with pipelines, fspeed 0-2)")
        stage_plan = pipe.stage_plan(layers, paths, [tuple(leaf.shape) for leaf in leaves], treedef,
                                     mesh_sizes, mesh_coords)
        keep = [stage_plan.holds(p) for p in paths]
        treedef = tree_flatten(tree_unflatten(treedef, [leaf if k else None for leaf, k in zip(leaves, keep)]))[1]
        paths = [p for p, k in zip(paths, keep) if k]
        leaves = [leaf for leaf, k in zip(leaves, keep) if k]
    if units is not None:
        missing = [p for p in paths if p not in units]
        if missing:
            raise ValueError(f"the model's units name no unit for parameter(s) {missing[:5]}; every parameter "
                             "needs one (Model.units)")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"parameter {path!r} is {type(leaf).__name__}, not a tensor")
    sizes = {a: int(s) for a, s in mesh_sizes.items()}
    tensor = plan.find("tensor_slicing")
    if tensor is not None and logical_axes is None:
        raise ValueError("tensor_slicing needs the model's logical axes (Model.logical_axes)")
    entries = []
    for path, leaf in zip(paths, leaves):
        shape = tuple(leaf.shape)
        axes = tuple(logical_axes.get(path, (None,) * len(shape))) if logical_axes else (None,) * len(shape)
        if len(axes) != len(shape):
            raise ValueError(f"logical axes of {path!r} {axes} do not match its shape {list(shape)}")
        entries.append(ParamEntry(path, shape, axes))
    placements = plan.place(entries, sizes)
    unit_of = units.__getitem__ if units is not None else default_unit
    infos = tuple(ParamInfo(e.path, e.shape, e.axes, pl, local_shape(e.shape, pl.compute, sizes, e.path),
                            unit_of(e.path)) for e, pl in zip(entries, placements))
    local = FlatLayout(treedef, tuple(paths), tuple(i.local_shape for i in infos))
    zero = plan.find("zero")
    zero_cfg = zero.config if zero is not None else ZeroConfig()
    n, rank = sizes.get("data", 1), int(mesh_coords.get("data", 0))
    units = _units(infos, treedef, n)
    part = ceil_div(local.numel, n)
    partition = labelled_layout(*_slice_pieces(local.paths, local.offsets, local.sizes, rank * part,
                                               (rank + 1) * part, "zero.pad"))
    persistent: tuple[int, ...] = ()
    if zero_cfg.stage == 3:
        if n > 1:
            persistent = tuple(i for u in units for i in u.resident_params)
        storage, param_storage, starts = _storage(infos, units, persistent, n, rank)
    else:
        storage, param_storage, starts = local, local, tuple(-1 for _ in units)
    tensor_axes = tensor.sliced_axes(sizes) if tensor is not None else ()
    if tensor_axes and not any(info.tp_sharded for info in infos):
        raise ValueError(f"tensor slicing over model={sizes['model']} slices none of the model's parameters: no "
                         f"parameter has a logical axis in {list(tensor_axes)} (traced_layers, or fs.models.sequential "
                         "without a tp_plan, has none); tensor-slice the reference GPT, fs.functionalize(module, "
                         "tp_plan=...) or fs.models.sequential(layers, tp_plan=...), or set model=1")
    return Layout(plan, zero_cfg, tuple(sorted(sizes.items())), tuple(sorted(mesh_coords.items())), infos, local,
                  units, storage, partition, starts, tensor_axes, stage_plan, persistent, param_storage)


def _units(infos: Sequence[ParamInfo], treedef: optree.PyTreeSpec, data_size: int) -> tuple[UnitInfo, ...]:
    index_tree = tree_unflatten(treedef, range(len(infos)))  # each leaf replaced by its index
    members: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        members.setdefault(info.unit, []).append(i)
    units = []
    for index, (name, idx) in enumerate(members.items()):
        sharded = tuple(i for i in idx if infos[i].placement.params == "data" and data_size > 1)
        shard_layout = labelled_layout([infos[i].path for i in sharded], [infos[i].local_shape for i in sharded])
        units.append(UnitInfo(name, index, tuple(idx), sharded, shard_layout,
                              ceil_div(shard_layout.numel, data_size) if sharded else 0,
                              _subtree_structure(index_tree, name, idx)))
    return tuple(units)


def _subtree_structure(index_tree: PyTree, name: str, members: Sequence[int]) -> Optional[optree.PyTreeSpec]:
    """The structure of the subtree at `name` when it holds exactly the parameters `members`, in
    order (`index_tree` has each parameter's index as its leaf); else None."""
    try:
        tree = subtree(index_tree, name)
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    leaves, treedef = tree_flatten(tree)
    return treedef if leaves == list(members) else None


def _slice_pieces(paths: Sequence[str], offsets: Sequence[int], sizes: Sequence[int], lo: int, hi: int,
                  pad: str) -> tuple[list[str], list[tuple[int, ...]]]:
    """The 1-D pieces of the parameters at (`paths`, `offsets`, `sizes`) within [lo, hi), in order,
    and a `pad` piece for the part past the last parameter."""
    names, shapes = [], []
    for path, off, size in zip(paths, offsets, sizes):
        a, b = max(off, lo), min(off + size, hi)
        if a < b:
            names.append(path)
            shapes.append((b - a,))
    end = max((o + s for o, s in zip(offsets, sizes)), default=0)
    if hi > max(end, lo):
        names.append(pad)
        shapes.append((hi - max(end, lo),))
    return names, shapes


def _storage(infos: Sequence[ParamInfo], units: Sequence[UnitInfo], persistent: Sequence[int], n: int,
             rank: int) -> tuple[FlatLayout, FlatLayout, tuple[int, ...]]:
    """Stage 3's stored trees (module docstring): `storage` (per unit the pieces of its flat
    shard, then this rank's partition of the `persistent` parameters), `param_storage` (the same,
    then the persistent parameters whole); and where each unit's shard starts. Without
    `persistent` (one data rank) both are per unit its shard, then its whole parameters."""
    paths: list[str] = []
    shapes: list[tuple[int, ...]] = []
    starts, at = [], 0
    for unit in units:
        starts.append(at if unit.sharded else -1)
        if unit.sharded:
            lo = rank * unit.shard_numel
            names, pieces = _slice_pieces(unit.shard_layout.paths, unit.shard_layout.offsets, unit.shard_layout.sizes,
                                          lo, lo + unit.shard_numel, f"{unit.name}.pad")
            paths += names
            shapes += pieces
            at += unit.shard_numel
        if not persistent:
            for i in unit.resident_params:
                paths.append(infos[i].path)
                shapes.append(infos[i].local_shape)
                at += infos[i].local_numel
    if not persistent:
        storage = labelled_layout(paths, shapes)
        return storage, storage, tuple(starts)
    whole = labelled_layout([infos[i].path for i in persistent], [infos[i].local_shape for i in persistent])
    part = ceil_div(whole.numel, n)
    names, pieces = _slice_pieces(whole.paths, whole.offsets, whole.sizes, rank * part, (rank + 1) * part, "zero.pad")
    storage = labelled_layout(paths + names, shapes + pieces)
    # the compute copy of the partition (written by the optimizer's cast, then all-gathered into the
    # whole parameters) is one piece under a name of its own: the parameters' paths name the whole copies
    tail = [("zero.persistent", (part,))] + list(zip(whole.paths, whole.shapes))
    if n * part > whole.numel:
        tail.append(("zero.persistent.pad", (n * part - whole.numel,)))
    param_storage = labelled_layout(paths + [p for p, _ in tail], shapes + [s for _, s in tail])
    return storage, param_storage, tuple(starts)


def slice_layout(flat: FlatLayout, lo: int, hi: int) -> FlatLayout:
    """The 1-D pieces of `flat`'s tensors within elements [lo, hi) of its buffer (a range of a
    ZeRO partition: what an elementwise optimizer updates piece by piece)."""
    return labelled_layout(*_slice_pieces(flat.paths, flat.offsets, flat.sizes, lo, hi, "zero.pad"))


def labelled_layout(paths: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> FlatLayout:
    """A flat layout of tensors with the given paths and shapes, in that order (a list tree)."""
    treedef = FlatLayout.of_tree([torch.empty(0, device="meta") for _ in paths]).treedef
    return FlatLayout(treedef, tuple(paths), tuple(tuple(s) for s in shapes))


__all__ = ["Layout", "ParamInfo", "UnitInfo", "default_unit", "labelled_layout", "resolve", "resolve_flat", "slice_layout", "subtree"]
