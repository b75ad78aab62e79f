"""ZeRO stages 0-3 over flat buffers: how a rank stores its parameter state and what it does at
the gradient-accumulation boundary.

Storage per rank (the TP-local flat buffer has Psi elements, N data ranks, P = ceil(Psi / N)):

    stage 0   params Psi (compute dtype), fp32 masters Psi (mixed precision), grads Psi
    stage 1   params Psi (padded to N*P), masters and optimizer state P (this rank's slice)
    stage 2   as 1; the gradient reaches the optimizer as a P-slice (reduce-scattered)
    stage 3   resident units whole, every other unit as its 1/N flat shard: params, masters,
              grads and optimizer state all follow that storage

At the boundary: stage 0 all-reduces the accumulated gradient; stages 1-2 reduce-scatter it into
the rank's slice; stage 3's shards arrive reduced from the backward pass (resident units are
all-reduced). The optimizer updates the local masters; stages 1-2 then all-gather the updated
compute parameters. Collectives are bucketed (`reduce_bucket_size`, `allgather_bucket_size`).
Gradients are summed over data ranks; the loss is pre-divided by the data size, so the sum is the
mean DeepSpeed computes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .flat import Flat, FlatLayout
from .pytree import PyTree, tree_flatten_with_paths, tree_map, tree_unflatten
from .plan import Layout, ShardedUnit, replace_units, subtree
from .precision import Precision
from .sharding import shard

def partition_layout(numel: int) -> FlatLayout:
    """The one-leaf layout of a ZeRO-1/2 slice (`partition`: [numel])."""
    return FlatLayout.of_tree({"partition": torch.empty(numel, device="meta")})


def local_params(params: PyTree, layout: Layout) -> PyTree:
    """This rank's tensor-parallel piece of every parameter (the tree's structure is kept)."""
    sizes, coords = dict(layout.mesh_sizes), dict(layout.mesh_coords)
    paths, leaves, treedef = tree_flatten_with_paths(params)
    info = layout.info
    return tree_unflatten(treedef, [shard(leaf.detach(), info[p].spec, sizes, coords) for p, leaf in zip(paths, leaves)])


def build_param_state(params: PyTree, layout: Layout, precision: Precision,
                      device: Optional[torch.device | str] = None) -> tuple[Flat, Optional[Flat], Flat]:
    """(compute params, fp32 masters or None, what the optimizer updates) for this rank."""
    local = local_params(params, layout)
    n, rank = layout.data_size, dict(layout.mesh_coords).get("data", 0)
    if layout.stage == 3:
        shards = {}
        for unit in layout.sharded_units:
            flat = unit.layout.flatten(subtree(local, unit.name), dtype=torch.float32)
            flat = torch.cat([flat, flat.new_zeros(unit.shard_numel * n - flat.numel())])
            shards[unit.name] = ShardedUnit(flat[rank * unit.shard_numel:(rank + 1) * unit.shard_numel].clone(), unit)
        storage = Flat.from_tree(replace_units(local, shards), dtype=torch.float32, device=device)
        compute = storage.to(precision.param_dtype) if precision.has_master else storage
        master = storage if precision.has_master else None
        return compute, master, storage
    padded = n * layout.partition_numel if layout.stage in (1, 2) else None
    full = Flat.from_tree(local, dtype=torch.float32, device=device, padded_numel=padded)
    compute = full.to(precision.param_dtype) if precision.has_master else full
    if layout.stage == 0:
        master = full if precision.has_master else None
        return compute, master, full
    p = layout.partition_numel
    part = Flat(full.buffer[rank * p:(rank + 1) * p].clone(), partition_layout(p))
    return compute, part, part


class NormPieces(NamedTuple):
    """Views of the optimizer's gradient buffer grouped by how their squares must be summed."""

    data_model: list  # partitioned over data and sliced over model
    data_only: list
    model_only: list
    local: list  # replicated everywhere


class ZeroRuntime:
    """The per-step data-parallel work of a layout on a mesh (see module docstring)."""

    def __init__(self, layout: Layout, mesh):
        self.layout = layout
        self.data = mesh.comm("data")
        self.model = mesh.comm("model")
        self.n = layout.data_size
        self.rank = self.data.rank
        self._pieces_for: dict = {}
        self._partition: Optional[torch.Tensor] = None  # stages 1-2: the reduce-scattered gradient slice

    # -- the boundary ----------------------------------------------------------------------

    def reduce(self, acc: torch.Tensor, grad_layout: FlatLayout) -> Flat:
        """Sum the accumulated local gradient over data ranks; returns what the optimizer consumes."""
        stage, cfg = self.layout.stage, self.layout.zero
        if self.n == 1:
            part = acc[: self.layout.partition_numel] if stage in (1, 2) else acc
            return Flat(part, partition_layout(part.numel()) if stage in (1, 2) else grad_layout)
        if stage == 0:
            self._all_reduce_buckets(acc, cfg.reduce_bucket_size)
            return Flat(acc, grad_layout)
        if stage in (1, 2):
            p = self.layout.partition_numel
            if self._partition is None or self._partition.dtype != acc.dtype or self._partition.device != acc.device:
                self._partition = torch.empty(p, dtype=acc.dtype, device=acc.device)
            out = self._partition
            self.data.reduce_scatter(acc[: self.n * p], out, cfg.reduce_bucket_size)
            return Flat(out, partition_layout(p))
        resident = self._resident_segments(acc, grad_layout)
        if resident:
            packed = torch.cat([seg.reshape(-1) for seg in resident])
            self.data.all_reduce_(packed)
            torch._foreach_copy_(resident, list(packed.split([seg.numel() for seg in resident])))
        return Flat(acc, grad_layout)

    def partition_bytes(self) -> int:
        return 0 if self._partition is None else self._partition.numel() * self._partition.element_size()

    def _all_reduce_buckets(self, buf: torch.Tensor, bucket: int) -> None:
        for lo in range(0, buf.numel(), bucket):
            self.data.all_reduce_(buf[lo: lo + bucket])

    def _resident_segments(self, acc: torch.Tensor, grad_layout: FlatLayout) -> list[torch.Tensor]:
        return [seg for path, seg in zip(grad_layout.paths, grad_layout.segments(acc)) if not path.endswith(".shard")]

    def grad_norm(self, grads: Flat) -> float:
        """The global L2 norm of the gradient, each element counted once over data and model ranks."""
        pieces = self._pieces(grads)
        sums = [torch.stack(torch._foreach_norm(group)).double().square().sum() if group
                else torch.zeros((), dtype=torch.float64) for group in pieces]
        data_model, data_only, model_only, local = sums
        if self.n > 1:
            reduced = self.data.all_reduce_(torch.stack([data_model, data_only]))
            data_model, data_only = reduced[0], reduced[1]
        if self.model.size > 1:
            reduced = self.model.all_reduce_(torch.stack([data_model, model_only]))
            data_model, model_only = reduced[0], reduced[1]
        return float((data_model + data_only + model_only + local).sqrt())

    def _pieces(self, grads: Flat) -> NormPieces:
        key = (grads.layout, grads.buffer.data_ptr())
        if key not in self._pieces_for:
            self._pieces_for = {key: self._classify(grads)}
        return self._pieces_for[key]

    def _classify(self, grads: Flat) -> NormPieces:
        layout, buf = self.layout, grads.buffer
        info = layout.info
        pieces = NormPieces([], [], [], [])

        def add(view, partitioned: bool, sliced: bool):
            group = pieces.data_model if partitioned and sliced else pieces.data_only if partitioned \
                else pieces.model_only if sliced else pieces.local
            if view.numel():
                group.append(view)

        if layout.stage in (1, 2):
            p = layout.partition_numel
            lo = self.rank * p
            for path, off, size in zip(layout.local.paths, layout.local.offsets, layout.local.sizes):
                a, b = max(off, lo), min(off + size, lo + p)
                if a < b:
                    add(buf[a - lo: b - lo], self.n > 1, info[path].tp_sharded)
            return pieces
        units = {u.name: u for u in layout.units}
        for path, seg in zip(grads.layout.paths, grads.layout.segments(buf)):
            name = path[: -len(".shard")] if path.endswith(".shard") else None
            if name is None or name not in units:
                add(seg, False, info[path].tp_sharded)
                continue
            unit = units[name]
            lo = self.rank * unit.shard_numel
            for rel, off, size in zip(unit.layout.paths, unit.layout.offsets, unit.layout.sizes):
                a, b = max(off, lo), min(off + size, lo + unit.shard_numel)
                if a < b:
                    full_path = f"{name}.{rel}" if rel else name
                    add(seg[a - lo: b - lo], True, info[full_path].tp_sharded)
        return pieces

    def write_back(self, master: Flat, params: Flat) -> None:
        """Make the compute parameters match the updated masters (cast; all-gather for stages 1-2)."""
        if self.layout.stage in (1, 2):
            p = self.layout.partition_numel
            part = master.buffer if master.dtype == params.dtype else master.buffer.to(params.dtype)
            self.data.all_gather(part, params.buffer[: self.n * p], self.layout.zero.allgather_bucket_size)
        elif master.buffer.data_ptr() != params.buffer.data_ptr():
            params.buffer.copy_(master.buffer)

    def mean_over_data(self, value: float) -> float:
        return self.data.all_reduce_scalar(value) / self.n if self.n > 1 else value


class LocalRuntime:
    """The boundary work of a single process (no plan): nothing to communicate."""

    n = 1

    def reduce(self, acc: torch.Tensor, grad_layout: FlatLayout) -> Flat:
        return Flat(acc, grad_layout)

    def grad_norm(self, grads: Flat) -> float:
        return float(torch.linalg.vector_norm(grads.buffer, dtype=torch.float32))

    def write_back(self, master: Flat, params: Flat) -> None:
        if master.buffer.data_ptr() != params.buffer.data_ptr():
            params.buffer.copy_(master.buffer)

    def mean_over_data(self, value: float) -> float:
        return value


def gather_params(state, mesh) -> PyTree:
    """The full (global, unsharded) parameters of a state, in fp32 where masters exist.

    A collective: every rank must call it. Used for checkpoints, evaluation and tests.
    """
    layout = state.layout
    source = state.master if state.master is not None else state.params
    if layout is None:
        return tree_map(lambda t: t.detach().clone(), source.tree())
    data, model = mesh.comm("data"), mesh.comm("model")
    if layout.stage in (1, 2):
        p = layout.partition_numel
        full = torch.empty(layout.data_size * p, dtype=source.dtype, device=source.device)
        data.all_gather(source.buffer.contiguous(), full)
        local = layout.local.unflatten(full)
    else:
        local = tree_map(lambda u: u.unit.layout.unflatten(data.gathered(u.shard.detach())) if isinstance(u, ShardedUnit) else u,
                         source.tree(), is_leaf=lambda x: isinstance(x, ShardedUnit))
    paths, leaves, treedef = tree_flatten_with_paths(local)
    info = layout.info
    out = []
    for path, leaf in zip(paths, leaves):
        dim = info[path].spec.dim_of("model")
        leaf = leaf.detach()
        if dim is not None and model.size > 1:
            leaf = model.gathered(leaf.movedim(dim, 0).contiguous()).movedim(0, dim)
        out.append(leaf.clone())
    return tree_unflatten(treedef, out)
