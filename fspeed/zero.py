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
With ZeRO-Offload (`zero.offload_optimizer`, `zero.offload_param`) masters and optimizer state
live on CPU and the reduced gradient goes down / the updated parameters come up (`fspeed.offload`).
Gradients are summed over data ranks; the loss is pre-divided by the data size, so the sum is the
mean DeepSpeed computes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .flat import Flat, FlatLayout
from .offload import HostDeviceCopies, compute_device, host_buffer, offloads_optimizer, offloads_params, to_host
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
    """(compute params, fp32 masters or None, what the optimizer updates) for this rank.

    With `offload_optimizer.device="cpu"` the masters (and so the optimizer state built from
    them) are a CPU copy, pinned where CUDA exists; with `offload_param` too, the stage-3
    compute shards are CPU buffers as well.
    """
    local = local_params(params, layout)
    n, rank = layout.data_size, dict(layout.mesh_coords).get("data", 0)
    offload = layout.zero.offload_optimizer
    if layout.stage == 3:
        shards = {}
        for unit in layout.sharded_units:
            flat = unit.layout.flatten(subtree(local, unit.name), dtype=torch.float32)
            flat = torch.cat([flat, flat.new_zeros(unit.shard_numel * n - flat.numel())])
            shards[unit.name] = ShardedUnit(flat[rank * unit.shard_numel:(rank + 1) * unit.shard_numel].clone(), unit)
        storage = Flat.from_tree(replace_units(local, shards), dtype=torch.float32, device=device)
        if offloads_params(layout):  # everything on the host; the optimizer writes the compute shards
            storage = storage.with_buffer(to_host(storage.buffer, offload.pin_memory))
            if not precision.has_master:
                return storage, None, storage
            pin = layout.zero.offload_param.pin_memory
            compute = storage.with_buffer(to_host(storage.buffer.to(precision.param_dtype), pin))
            return compute, storage, storage
        if offload.enabled:
            compute = storage.to(precision.param_dtype)
            master = storage.with_buffer(to_host(storage.buffer, offload.pin_memory))
            return compute, master, master
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
    piece = full.buffer[rank * p:(rank + 1) * p]
    part = Flat(to_host(piece, offload.pin_memory) if offload.enabled else piece.clone(), partition_layout(p))
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
        self.offload = offloads_optimizer(layout)
        self.offload_params = offloads_params(layout)
        self._copies = HostDeviceCopies()
        self._host: dict[str, torch.Tensor] = {}  # offload: host gradient and 16-bit staging buffers
        self._comm_device: Optional[torch.device] = None  # where the last reduction ran

    # -- the boundary ----------------------------------------------------------------------

    def reduce(self, acc: torch.Tensor, grad_layout: FlatLayout) -> Flat:
        """Sum the accumulated local gradient over data ranks; returns what the optimizer consumes
        (with offload_optimizer: in a host buffer, in the accumulation dtype)."""
        self._comm_device = acc.device
        if self.offload_params:  # the gradient is already on the host; only resident units reduce
            return self._reduce_on_device(acc, grad_layout)
        grads = self._reduce_on_device(acc, grad_layout)
        if not self.offload:
            return grads
        host = self._host_buffer("grads", grads.buffer.numel(), grads.dtype, self.layout.zero.offload_optimizer.pin_memory)
        return Flat(self._copies.download(host, grads.buffer), grads.layout)

    def _host_buffer(self, name: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        buf = self._host.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._host[name] = host_buffer(numel, dtype, pin)
        return buf

    def _reduce_on_device(self, acc: torch.Tensor, grad_layout: FlatLayout) -> Flat:
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
            if self.offload_params:  # host gradients: reduce where the collectives run
                device = compute_device(self.data.group)
                self._comm_device = device
                packed = self.data.all_reduce_(packed.to(device)).to(acc.device)
            else:
                self.data.all_reduce_(packed)
            torch._foreach_copy_(resident, list(packed.split([seg.numel() for seg in resident])))
        return Flat(acc, grad_layout)

    def partition_bytes(self) -> int:
        return 0 if self._partition is None else self._partition.numel() * self._partition.element_size()

    def host_buffer_bytes(self) -> int:
        """Offload: bytes of the host gradient and 16-bit staging buffers (the masters are state)."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

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
        device = self._comm_device or grads.device  # offload: host sums, reduced where the collectives run
        if self.n > 1:
            reduced = self.data.all_reduce_(torch.stack([data_model, data_only]).to(device)).to(grads.device)
            data_model, data_only = reduced[0], reduced[1]
        if self.model.size > 1:
            reduced = self.model.all_reduce_(torch.stack([data_model, model_only]).to(device)).to(grads.device)
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

    def compute_device(self, params: Flat) -> torch.device:
        """Where forward and backward run (params.device unless parameters are offloaded)."""
        return compute_device(self.data.group) if self.offload_params else params.device

    def cast_target(self, master: Flat, params: Flat) -> Optional[Flat]:
        """What the optimizer writes the updated masters into, cast, in its own pass (None: nothing).

        Without offload: the compute params when they are the masters' local image. With
        offload_optimizer: a pinned host staging buffer in the compute dtype (the CPU kernel
        never gets a device tensor), or the host compute shards themselves with offload_param.
        """
        if not self.offload:
            return local_image(master, params)
        self._copies.wait_for_uploads()  # the previous step's upload has read the host buffers
        if self.offload_params:
            return local_image(master, params)  # the host compute shards (None in fp32: they are the masters)
        if master.dtype == params.dtype:
            return None  # fp32: write_back uploads the masters themselves
        staging = self._host_buffer("staging", master.buffer.numel(), params.dtype,
                                    self.layout.zero.offload_optimizer.pin_memory)
        return master.with_buffer(staging)

    def write_back(self, master: Flat, params: Flat, cast: Optional[Flat] = None) -> None:
        """Make the compute parameters match the updated masters (cast; all-gather for stages 1-2).

        `cast` is what the optimizer already wrote (see `cast_target`). With offload_optimizer
        the host result (staging, or the fp32 masters when no cast is needed) is uploaded first.
        """
        if cast is not None and cast.buffer.data_ptr() == params.buffer.data_ptr():
            return  # the optimizer wrote the compute params in its pass
        if self.offload_params:
            return  # the host compute shards are the masters (fp32) or were written as their cast
        source = cast.buffer if cast is not None else master.buffer
        if self.layout.stage in (1, 2):
            p = self.layout.partition_numel
            if self.offload:  # up into this rank's own slice, then an in-place all-gather (as DeepSpeed)
                part = self._copies.upload(params.buffer[self.rank * p:(self.rank + 1) * p], source)
            else:
                part = source if source.dtype == params.dtype else source.to(params.dtype)
            self.data.all_gather(part, params.buffer[: self.n * p], self.layout.zero.allgather_bucket_size)
        elif self.offload:
            self._copies.upload(params.buffer, source)
        elif source.data_ptr() != params.buffer.data_ptr():
            params.buffer.copy_(source)

    def mean_over_data(self, value: float) -> float:
        return self.data.all_reduce_scalar(value) / self.n if self.n > 1 else value


class LocalRuntime:
    """The boundary work of a single process (no plan): nothing to communicate."""

    n = 1

    def reduce(self, acc: torch.Tensor, grad_layout: FlatLayout) -> Flat:
        return Flat(acc, grad_layout)

    def grad_norm(self, grads: Flat) -> float:
        return float(torch.linalg.vector_norm(grads.buffer, dtype=torch.float32))

    def compute_device(self, params: Flat) -> torch.device:
        return params.device

    def cast_target(self, master: Flat, params: Flat) -> Optional[Flat]:
        return local_image(master, params)

    def write_back(self, master: Flat, params: Flat, cast: Optional[Flat] = None) -> None:
        if cast is not None:
            return
        if master.buffer.data_ptr() != params.buffer.data_ptr():
            params.buffer.copy_(master.buffer)

    def mean_over_data(self, value: float) -> float:
        return value


def local_image(master: Flat, params: Flat) -> Optional[Flat]:
    """`params` when it is a separate, same-layout copy of `master` on the same device (then the
    optimizer writes it, cast, in its update pass); None when there is nothing to cast (fp32) or
    when the runtime must write it back itself (ZeRO-1/2 all-gather the updated partitions)."""
    same = master.buffer.data_ptr() == params.buffer.data_ptr()
    return params if not same and master.layout == params.layout and master.buffer.shape == params.buffer.shape \
        and master.device == params.device else None


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
