"""The runtime of a layout on a mesh: how a rank stores its state, and the one boundary train_step calls.

Storage per rank (the tensor-parallel local buffer has Psi elements, N data ranks, P = ceil(Psi/N)):

    stage 0   params Psi (compute dtype), fp32 masters Psi (mixed precision)
    stage 1   params Psi (padded to N*P), masters and optimizer state P (this rank's slice)
    stage 2   as 1
    stage 3   per unit its 1/N flat shard, then the rank's 1/N partition of the persistent
              parameters: masters, gradients and optimizer state; the compute params hold the
              same and every persistent parameter whole (`Layout.param_storage`), all-gathered
              from the partitions after each update

A step, as train_step drives it (`ParallelRuntime`):

    begin_step(reduce, micro_batches)      the gradient sink of the stage, chosen once
    per micro-batch: ops(anchor), view(params, ops), grad_and_value, end_micro()
    finish() -> gradient the optimizer consumes (reduced during backward; offload: on the host;
                one CPU process in fp32: backward's own tensors, `LooseGrads`)
    grad_norm, cast_target, write_back (the gather for stages 1-2; `update_and_gather` runs the update
    with it piece by piece), mean_over_data

With ZeRO-Offload (`zero.offload_optimizer`, `zero.offload_param`) masters and optimizer state live
on CPU, the reduced gradient goes down and the updated parameters come up (`offload.py`).
Gradients are summed over data ranks of a loss pre-divided by the data size: the mean DeepSpeed
computes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from ..flat import Flat, FlatLayout, LooseGrads
from ..precision import Precision
from ..pytree import PyTree, tensor_leaves, tree_map, tree_unflatten
from .comm import AxisComm, GatherInFlight
from .grads import SINKS, AccumulatedGrads, GradSink, PartitionGrads, ShardGrads
from .layout import Layout
from .offload import (
    HostDeviceCopies, check_optimizer_for_offload, compute_device, copy_to, host_buffer, offloads_optimizer,
    offloads_params, to_host,
)
from .ops import UnitOps, UnitParams, UnitTrace, eager_params, model_view, unit_params
from .param_gather import ParamGather
from .specs import shard
from ..torch_internals import foreach_norm


def check_optimizer(optimizer, layout: Layout) -> None:
    """Refuse an optimizer whose declared capabilities (`fspeed.optim.Capabilities`) do not fit
    the layout: partitioned or tensor-sliced state needs elementwise math; a self-communicating
    optimizer needs whole replicated buffers; offload needs a CPU path."""
    split = []
    if layout.stage >= 1:
        split.append(f"ZeRO stage {layout.stage} slices")
    if layout.model_size > 1:
        split.append(f"tensor slicing over {layout.model_size} ranks")
    if split:
        where = " and ".join(split)
        communicating = optimizer.having("communicates")
        if communicating:
            raise ValueError(
                f"{communicating} compresses the data-parallel all-reduce of whole replicated buffers and cannot run "
                f"with {where}; allowed: zero stage 0 without tensor slicing (DeepSpeed's 1-bit optimizers are not "
                "compatible with ZeRO either). Use adam/adamw/lamb for ZeRO >= 1.")
        whole = optimizer.having("whole_tensors")
        if whole:
            raise ValueError(
                f"{whole} needs whole parameter tensors (a per-tensor norm); it cannot run on {where} yet (DeepSpeed "
                "likewise rejects LAMB under ZeRO). Use adam/adamw/sgd, or zero stage 0 without tensor slicing.")
        parts = optimizer.parts
        for i, part in enumerate(parts):
            caps = part.capabilities
            if caps.elementwise or (caps.clip_norm is not None and i == 0):
                continue
            name = part.info.name if part.info is not None else repr(part)
            what = ("clip_by_global_norm must lead the chain there (train_step then clips with the true global "
                    "norm)" if caps.clip_norm is not None else
                    "declare Capabilities(elementwise=True) if its update of each element depends only on that element")
            raise ValueError(f"{name} is not declared elementwise, and {where} give it only part of each buffer; "
                             f"{what}.")
    if layout.pipeline is not None and optimizer.having("communicates"):
        raise ValueError(f"{optimizer.having('communicates')} compresses the data-parallel all-reduce itself and cannot "
                         "run with a pipeline yet; use adam/adamw/lamb/sgd with pipelines")
    check_optimizer_for_offload(optimizer, layout)


def local_params(leaves: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """This rank's tensor-parallel piece of every parameter (flat order)."""
    sizes, coords = dict(layout.mesh_sizes), dict(layout.mesh_coords)
    return [shard(leaf.detach(), info.spec, sizes, coords) for leaf, info in zip(leaves, layout.params)]


def build_param_state(leaves: list[torch.Tensor], layout: Layout, precision: Precision,
                      device: Optional[torch.device | str] = None) -> tuple[Flat, Optional[Flat], Flat]:
    """(compute params, fp32 masters or None, what the optimizer updates) for this rank, from the
    full parameters (`leaves`, in the layout's flat order).

    With `offload_optimizer.device="cpu"` the masters (and so the optimizer state built from
    them) are a CPU copy, pinned where CUDA exists; with `offload_param` too, the stage-3
    compute shards are CPU buffers as well.
    """
    local = local_params(leaves, layout)
    if device is None and local:  # the state lives where the given parameters do (a GPU's, say)
        device = local[0].device
    n, rank = layout.data_size, layout.data_rank
    offload = layout.zero.offload_optimizer
    if layout.stage == 3:
        return _build_stage3(local, layout, precision, device)
    padded = n * layout.partition_numel if layout.stage in (1, 2) else layout.local.numel
    buffer = torch.zeros(padded, dtype=torch.float32, device=local[0].device if local else None)  # params' own
    if local:
        torch.cat([t.reshape(-1).float() for t in local], out=buffer[:layout.local.numel])
    full = Flat(buffer if device is None else buffer.to(device), layout.local)
    compute = full.to(precision.param_dtype) if precision.has_master else full
    if layout.stage == 0:
        return compute, (full if precision.has_master else None), full
    p = layout.partition_numel
    piece = full.buffer[rank * p:(rank + 1) * p]
    if offload.enabled:
        part = Flat(to_host(piece, offload.pin_memory), layout.partition)
    else:  # in fp32 the partition the optimizer updates is the params' own slice: no copy to write back
        part = Flat(piece.clone() if precision.has_master else piece, layout.partition)
    return compute, part, part


def _build_stage3(local: list[torch.Tensor], layout: Layout, precision: Precision,
                  device: Optional[torch.device | str]) -> tuple[Flat, Optional[Flat], Flat]:
    """`build_param_state` of stage 3: the compute parameters on `layout.param_storage`, what the
    optimizer updates on `layout.storage`, its leading part (the units' shards, then the
    persistent partition: layout.py). Where the two share a dtype and a place, the updated buffer
    is that part of the compute buffer itself (as ZeRO-1/2's partition in fp32)."""
    n, rank = layout.data_size, layout.data_rank
    offload = layout.zero.offload_optimizer
    full = torch.zeros(layout.param_storage.numel, dtype=torch.float32)
    views = dict(Flat(full, layout.param_storage).items())  # the persistent parameters' whole copies
    for unit, start in zip(layout.units, layout.shard_starts):
        if unit.sharded:
            flat = torch.cat([local[i].reshape(-1).float() for i in unit.sharded_params])
            flat = torch.cat([flat, flat.new_zeros(unit.shard_numel * n - flat.numel())])
            full[start:start + unit.shard_numel].copy_(flat[rank * unit.shard_numel:(rank + 1) * unit.shard_numel])
        for i in unit.resident_params:
            views[layout.params[i].path].copy_(local[i])
    lo, part = layout.persistent_start, layout.persistent_part
    if layout.persistent:  # this rank's partition of the whole persistent parameters that follow it
        full[lo:lo + part].copy_(full[lo + part + rank * part:lo + part + (rank + 1) * part])
    if device is not None:
        full = full.to(device)
    updated = layout.storage.numel
    if offloads_params(layout):  # everything on the host; the optimizer writes the compute shards
        full = to_host(full, offload.pin_memory)
        if not precision.has_master:  # the compute parameters (their leading part) are what the optimizer updates
            compute = Flat(full, layout.param_storage)
            master = _leading(compute, layout)
            return compute, master, master if master is not None else compute
        compute = Flat(to_host(full.to(precision.param_dtype), layout.zero.offload_param.pin_memory),
                       layout.param_storage)
        master = Flat(full[:updated] if not layout.persistent else to_host(full[:updated], offload.pin_memory),
                      layout.storage)
        return compute, master, master
    if offload.enabled:
        compute = Flat(full.to(precision.param_dtype), layout.param_storage)
        master = Flat(to_host(full[:updated], offload.pin_memory), layout.storage)
        return compute, master, master
    if not precision.has_master:
        compute = Flat(full, layout.param_storage)
        master = _leading(compute, layout)  # None: the compute parameters are the masters
        return compute, master, master if master is not None else compute
    compute = Flat(full.to(precision.param_dtype), layout.param_storage)
    master = Flat(full[:updated].clone() if layout.persistent else full, layout.storage)
    return compute, master, master


def _leading(params: Flat, layout: Layout) -> Optional[Flat]:
    """Stage 3: the leading part of the compute buffer that `layout.storage` describes (the units'
    shards and the persistent partition); None when it is the whole buffer (no persistent ones)."""
    if not layout.persistent:
        return None
    return Flat(params.buffer[:layout.storage.numel], layout.storage)


class NormPieces(NamedTuple):
    """Views of the optimizer's gradient buffer grouped by how their squares must be summed."""

    data_model: list  # partitioned over data and sliced over model
    data_only: list
    model_only: list
    local: list  # replicated everywhere


class ParallelRuntime:
    """The per-step work of a layout on a mesh (module docstring); built once per layout."""

    def __init__(self, layout: Layout, mesh, precision: Precision, params: Flat, train: bool = True,
                 loose_grads: bool = False, norm_in_update: bool = False):
        self.layout = layout
        self.mesh = mesh
        self.data: AxisComm = mesh.comm("data")
        self.model: AxisComm = mesh.comm("model")
        self.pipe: AxisComm = mesh.comm("pipe")
        self.n = layout.data_size
        # the grad norm from the optimizer's own pass (nothing needed it before the update) where that
        # pass sees the whole gradient (one rank; stage 0's all-reduced one) or a ZeRO-1/2 partition
        # (summed over the ranks) or ZeRO-3 shards and persistent partitions (likewise); under a
        # pipeline, where the pass sees the stage's whole gradient (its tied copies are then left out
        # by `tied_copies_sq`). The sink then takes no norms
        self.norm_in_update = norm_in_update and self.model.size == 1 and \
            (self.n == 1 or layout.stage == 3 or layout.stage <= 2 and (self.pipe.size == 1 or layout.stage == 0))
        self.rank = self.data.rank
        self.offload = offloads_optimizer(layout)
        self.offload_params = offloads_params(layout)
        self.device = compute_device(self.data.group) if self.offload_params else params.device
        sink_cls = SINKS[layout.stage]
        self.sink: Optional[GradSink] = None  # evaluation delivers no gradients
        if train and sink_cls is ShardGrads:
            self.sink = ShardGrads(layout, self.data, precision.grad_accum_dtype, params.device, self.device,
                                   on_host=self.offload_params)
        elif train and sink_cls is AccumulatedGrads:
            # an optimizer that takes backward's own gradient tensors gets them where nothing is offloaded
            # or cast (fp32; the sink also needs one data rank), outside a pipeline's own accumulator, on a
            # CPU: there a copy of the whole gradient competes with the compute for memory bandwidth (on a
            # GPU it is one fast launch); the parameters are then autograd leaves, with no delivery per unit
            # (faster also where every tensor is small: 27.5 against 29.0 ms a step of a 1M-parameter GPT-2)
            loose = loose_grads and layout.pipeline is None and not self.offload and \
                params.dtype == precision.grad_accum_dtype and params.device.type == "cpu"
            self.sink = AccumulatedGrads(layout, self.data, precision.grad_accum_dtype, params.device, loose=loose,
                                         take_norms=not self.norm_in_update)
        elif train:
            self.sink = sink_cls(layout, self.data, precision.grad_accum_dtype, params.device)
        self.param_dtype = params.dtype
        self._copies = HostDeviceCopies()
        self._host: dict[str, torch.Tensor] = {}  # offload: host gradient and 16-bit staging buffers
        self._pieces_for: dict = {}
        self._groups: dict = {}  # by gradient layout: `_classify`'s index groups
        self._units_for: tuple = (None, None)  # (the parameter buffer's identity, its units' views)
        self._trace = UnitTrace()  # the order units ran in, for ZeRO-3's prefetch
        self._unit_ops: Optional[UnitOps] = None
        self.param_gather: Optional[GatherInFlight] = None  # ZeRO-1/2's, started by write_back
        offsets, sizes = layout.local.offsets, layout.local.sizes
        self._unit_ranges = {u.index: (min(offsets[i] for i in u.params), max(offsets[i] + sizes[i] for i in u.params))
                             for u in layout.units if u.params and not u.sharded}
        self.gather = ParamGather(layout, self.data, self._unit_ranges)  # ZeRO-1/2's

    # -- forward and backward --------------------------------------------------------------

    def ops(self, anchor: Optional[torch.Tensor]) -> UnitOps:
        """The model ops for one micro-batch (None: evaluation), unit ops wrapped by each transform."""
        to_device = (lambda t: copy_to(t, self.device)) if self.offload_params else (lambda t: t)
        self._unit_ops = UnitOps(self.layout, self.data, self.sink, anchor, self.device, self.param_dtype, to_device,
                                 self._trace, uploads=self.offload_params)
        self._unit_ops.model_comm = self.model
        if self.param_gather is not None and not self.param_gather.done:
            self._unit_ops.param_gather = (self.param_gather, self._unit_ranges)
        ops = self._unit_ops
        for transform in self.layout.plan.ordered():
            ops = transform.wrap_ops(ops, self.mesh, self.layout.tensor_axes)
        return ops

    def view(self, params: Flat, ops, parallel_aware: bool) -> PyTree:
        """What the loss sees: units in place for a parallel-aware loss, else plain tensors."""
        buffer = params.buffer  # updated in place from step to step: its views stay valid, so build them once
        key = (params.layout, buffer.untyped_storage().data_ptr(), buffer.storage_offset(), buffer.shape, buffer.dtype)
        if self._units_for[0] != key:
            units = unit_params(self.layout, params)
            self._units_for = (key, self._as_leaves(units) if self.sink is not None and self.sink.loose else units)
        units = self._units_for[1]
        self._unit_ops.bind(units)
        tree = model_view(self.layout, units) if parallel_aware else None
        return tree if tree is not None else eager_params(self._unit_ops, units)

    def _as_leaves(self, units: list[UnitParams]) -> list[UnitParams]:
        """The loose sink's units: each parameter an autograd leaf viewing the buffer, whose `.grad`
        backward fills (as an eager loop's) and the sink reads (`AccumulatedGrads.hold_leaves`)."""
        out, leaves = [], {}
        for u in units:
            resident = [t.detach().requires_grad_(t.is_floating_point()) for t in u.resident]
            leaves.update(zip(u.unit.resident_params, resident))
            out.append(UnitParams(u.unit, u.shard, resident))
        self.sink.hold_leaves(leaves)
        return out

    def backward_inputs(self, anchor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """What a micro-batch's backward differentiates: the anchor every unit's delivery hangs
        on; None for the loose sink, whose backward is an eager loop's: every leaf the loss reaches
        (its parameter leaves) gets its `.grad`, with no `inputs=` (whose walk of the graph cost 0.35
        ms of a 13 ms backward, a 12-layer GPT-2 of width 64)."""
        return None if self.sink is not None and self.sink.loose else [anchor]

    def close_ops(self) -> None:
        """The end of a forward (and backward): prefetches nobody took are waited for."""
        if self._unit_ops is not None:
            self.gather.saw_forward(self._unit_ops.taken_order)
            self._unit_ops.close()
            self._unit_ops = None

    def begin_step(self, reduce: bool, micro_batches: int) -> None:
        self.sink.begin_step(reduce, micro_batches)

    def begin_micro(self, index: int) -> None:
        self.sink.begin_micro(index)

    def end_micro(self) -> None:
        self.close_ops()
        self.sink.end_micro()

    def summed_grad_buffer(self) -> Optional[torch.Tensor]:
        """Where a gradient summed outside the sink (a pipeline stage's) may be summed directly:
        the sink's own accumulator (stages 0 and 1) or a buffer it lends for the step (stage 2),
        so `deliver_summed` copies nothing; else None."""
        return self.sink.buffer_for_summed() if isinstance(self.sink, (AccumulatedGrads, PartitionGrads)) else None

    def begin_summed(self, reduce: bool) -> Optional[Callable[[Sequence[int]], None]]:
        """Before a gradient is summed in `summed_grad_buffer()`: `final(params)` (local parameter
        indices), which starts the reduction of those parameters' sums as soon as they are final
        (`AccumulatedGrads.begin_summed`); None when there is no such buffer or nothing to reduce."""
        return self.sink.begin_summed(reduce) if self.summed_grad_buffer() is not None else None

    def deliver_summed(self, grads: Flat, reduce: bool) -> None:
        """A gradient summed outside the sink (a pipeline stage's, over its micro-batches), handed to
        the sink as the step's one micro-batch (reduced over `data` by the ZeRO stage)."""
        own = self.summed_grad_buffer()
        if own is not None and own.data_ptr() == grads.buffer.data_ptr() and own.numel() == grads.buffer.numel():
            self.sink.deliver_in_place(reduce)
            return
        self.sink.begin_step(reduce, 1)
        self.sink.begin_micro(0)
        segments = grads.layout.segments(grads.buffer)
        for unit in reversed(self.layout.units):
            self.sink.deliver(unit.index, [segments[i] for i in unit.params])
        self.sink.end_micro()

    def finish(self) -> Flat | LooseGrads:
        """The reduced gradient the optimizer consumes (with offload_optimizer: on the host, in the
        accumulation dtype; backward's own tensors where the sink keeps them, `LooseGrads`)."""
        self.settle_params()  # the optimizer is about to write the slice the gather reads
        grads = self.sink.finish()
        if not self.offload or self.offload_params:
            return grads
        host = self._host_buffer("grads", grads.buffer.numel(), grads.dtype, self.layout.zero.offload_optimizer.pin_memory)
        return Flat(self._copies.download(host, grads.buffer), grads.layout)

    def _host_buffer(self, name: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        buf = self._host.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._host[name] = host_buffer(numel, dtype, pin)
        return buf

    def held_grad_bytes(self) -> dict[str, int]:
        """Bytes of the sink's gradient buffers kept between steps, by where they live
        ("device", "host"); the offload download buffer is in `host_buffer_bytes`."""
        return self.sink.held_bytes() if self.sink is not None else {"device": 0, "host": 0}

    def host_buffer_bytes(self) -> int:
        """Offload: bytes of the host gradient and 16-bit staging buffers (the masters are state)."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

    # -- the boundary ----------------------------------------------------------------------

    def grad_norm(self, grads: Flat | LooseGrads) -> torch.Tensor:
        """The global L2 norm of the gradient, each element counted once over data and model ranks: a
        0-d float64 tensor on the gradient's device (the caller decides when the host reads it)."""
        if isinstance(grads, LooseGrads) and grads.norms is not None:  # taken as backward delivered them
            norms = self._pieces(grads, grads.norms)
        else:
            norms = [foreach_norm(group) if group else [] for group in self._pieces(grads)]
        sums = [torch.stack(group).double().square().sum() if group
                else torch.zeros((), dtype=torch.float64) for group in norms]
        data_model, data_only, model_only, local = sums
        device = self.device if grads.device.type == "cpu" and self.device.type != "cpu" else grads.device
        if self.n > 1:
            reduced = self.data.all_reduce_(torch.stack([data_model, data_only]).to(device)).to(grads.device)
            data_model, data_only = reduced[0], reduced[1]
        if self.model.size > 1:
            reduced = self.model.all_reduce_(torch.stack([data_model, model_only]).to(device)).to(grads.device)
            data_model, model_only = reduced[0], reduced[1]
        total = data_model + data_only + model_only + local
        if self.pipe.size > 1:  # every stage's parameters (a tied copy counted on its first stage only)
            total = self.pipe.all_reduce_(total.reshape(1).to(device)).to(grads.device)[0]
        return total.sqrt()

    def norm_from_update(self, grad_sq: list, tied_copies_sq: float = 0.0) -> float:
        """The global grad norm from the sums of squares the optimizer's pass gave (`norm_in_update`):
        ZeRO-1/2's partitions summed over the data ranks, the whole gradient's as it is; under a
        pipeline, summed over the stages less the tied copies another stage counts (`tied_copies_sq`)."""
        total = math.fsum(grad_sq)
        if self.n > 1 and self.layout.stage >= 1:
            total = self.data.all_reduce_scalar(total, "sum")
        if self.pipe.size > 1:
            total = self.pipe.all_reduce_scalar(total - tied_copies_sq, "sum")
        return math.sqrt(max(total, 0.0))

    def tied_copies_sq(self, grads: Flat | LooseGrads) -> float:
        """The sum of the squares of this stage's gradient of parameters whose first stage is another
        (a tied embedding's later copy): `grad_norm` counts each once. Read before the update."""
        copies = self._tied_copies()
        if not copies:
            return 0.0
        parts = [t for path, t in zip(grads.layout.paths, grads.segments()) if path in copies]
        return math.fsum(float(n.double().square()) for n in foreach_norm(parts)) if parts else 0.0

    def _tied_copies(self) -> set[str]:
        """Paths of the parameters this pipeline stage holds whose first stage is another (a tied
        embedding's later copy): the grad norm counts each on its first stage only."""
        plan = self.layout.pipeline
        return {p for p, stages in plan.tied if stages[0] != plan.stage} if plan is not None else set()

    def _pieces(self, grads: Flat | LooseGrads, per_param: Optional[list] = None) -> NormPieces:
        """The gradient's per-parameter tensors (or `per_param`'s entries), grouped as `_classify` says."""
        if grads.layout not in self._groups:
            self._groups = {grads.layout: self._classify(grads.layout)}
        groups = self._groups[grads.layout]
        if isinstance(grads, LooseGrads):  # new tensors every step
            per_param = per_param if per_param is not None else grads.tensors
            return NormPieces(*([per_param[i] for i in group] for group in groups))
        key = (grads.layout, grads.buffer.data_ptr())
        if key not in self._pieces_for:
            segs = grads.segments()
            self._pieces_for = {key: NormPieces(*([segs[i] for i in group] for group in groups))}
        return self._pieces_for[key]

    def _classify(self, grads_layout: FlatLayout) -> NormPieces:
        """The index of each piece of the gradient, grouped by whether it is partitioned over data (a
        ZeRO slice or shard) and sliced over model (tensor slicing); padding pieces are left out (zeros)."""
        layout, pieces = self.layout, NormPieces([], [], [], [])
        info = layout.info
        sharded = {layout.params[i].path for u in layout.units for i in u.sharded_params} | \
            {layout.params[i].path for i in layout.persistent}  # stage 3: the persistent partitions too
        partitioned_stage = layout.stage in (1, 2) and self.n > 1
        copies = self._tied_copies()
        for i, (path, size) in enumerate(zip(grads_layout.paths, grads_layout.sizes)):
            if path not in info or not size or path in copies:
                continue  # padding, or a tied parameter's copy (its first stage counts it)
            partitioned = partitioned_stage or path in sharded
            sliced = info[path].tp_sharded
            group = pieces.data_model if partitioned and sliced else pieces.data_only if partitioned \
                else pieces.model_only if sliced else pieces.local
            group.append(i)
        return pieces

    def compute_device(self, params: Flat) -> torch.device:
        """Where forward and backward run (params.device unless parameters are offloaded)."""
        return self.device

    def cast_target(self, master: Flat, params: Flat) -> Optional[Flat]:
        """What the optimizer writes the updated masters into, cast, in its own pass (None: nothing).

        Without offload: the compute params when they are the masters' local image. With
        offload_optimizer: a pinned host staging buffer in the compute dtype (the CPU kernel
        never gets a device tensor), or the host compute shards themselves with offload_param.
        """
        leading = self.layout.stage == 3 and bool(self.layout.persistent)  # the masters' image leads the params
        if not self.offload:
            if self.layout.stage in (1, 2) and master.dtype != params.dtype:
                # the cast goes straight into this rank's slice of the compute params (all-gathered in place)
                p = self.layout.partition_numel
                return master.with_buffer(params.buffer[self.rank * p:(self.rank + 1) * p])
            if leading:  # into the shards and the persistent partition, which write_back then all-gathers
                return master.with_buffer(params.buffer[:master.numel]) if master.dtype != params.dtype else None
            return local_image(master, params)
        self._copies.wait_for_uploads()  # the previous step's upload has read the host buffers
        if self.offload_params:
            if leading:
                return master.with_buffer(params.buffer[:master.numel]) if master.dtype != params.dtype else None
            return local_image(master, params)  # the host compute shards (None in fp32: they are the masters)
        if master.dtype == params.dtype:
            return None  # fp32: write_back uploads the masters themselves
        staging = self._host_buffer("staging", master.buffer.numel(), params.dtype,
                                    self.layout.zero.offload_optimizer.pin_memory)
        return master.with_buffer(staging)

    def settle_params(self) -> None:
        """Complete the parameter all-gather still in flight (ZeRO-1/2), if any."""
        if self.param_gather is not None:
            self.param_gather.wait()
            self.param_gather = None

    def write_back(self, master: Flat, params: Flat, cast: Optional[Flat] = None) -> Optional[GatherInFlight]:
        """Make the compute parameters match the updated masters (cast; all-gather for stages 1-2).

        ZeRO-1/2's gather (`gather_pieces`: broadcasts in the forward's order) is started, not
        waited for: it returns in flight (also kept as
        `param_gather`), the next forward waits for each unit's buckets as it reaches the unit
        (overlapping the gather with compute, as Megatron's overlap_param_gather), and any other
        reader of the parameters waits for all of it (`TrainState.params`).

        `cast` is what the optimizer already wrote (see `cast_target`). With offload_optimizer
        the host result (staging, or the fp32 masters when no cast is needed) is uploaded first.
        """
        if self.layout.stage == 3 and self.layout.persistent:
            self._write_back_with_persistent(master, params, cast)
            return None
        if cast is not None and cast.buffer.data_ptr() == params.buffer.data_ptr() and \
                cast.buffer.numel() == params.buffer.numel():
            return  # the optimizer wrote the compute params in its pass
        if self.offload_params:
            return  # the host compute shards are the masters (fp32) or were written as their cast
        source = cast.buffer if cast is not None else master.buffer
        if self.layout.stage in (1, 2):
            p = self.layout.partition_numel
            own = params.buffer[self.rank * p:(self.rank + 1) * p]
            if self.offload:
                self._copies.upload(own, source)
            elif source.data_ptr() != own.data_ptr():
                own.copy_(source)
            gather = self.gather.start(params.buffer[: self.n * p])
            if self.offload:  # (as DeepSpeed: up into this rank's own slice, then gathered, waited)
                gather.wait()
                return None
            self.param_gather = gather
            return gather
        elif self.offload:
            self._copies.upload(params.buffer, source)
        elif source.data_ptr() != params.buffer.data_ptr():
            params.buffer.copy_(source)

    def _write_back_with_persistent(self, master: Flat, params: Flat, cast: Optional[Flat]) -> None:
        """Stage 3 with persistent parameters: the updated shards and persistent partition into the
        compute buffer's leading part (unless the optimizer's pass wrote them there, or the masters
        are that part), then the partitions all-gathered into the whole persistent parameters, as
        DeepSpeed all-gathers its persistent parameters after each step."""
        lead = params.buffer[:self.layout.storage.numel]
        source = cast.buffer if cast is not None else master.buffer
        if source.data_ptr() != lead.data_ptr() or source.device != lead.device:
            if self.offload and not self.offload_params:
                self._copies.upload(lead, source)
            else:
                lead.copy_(source)
        self.gather_persistent(params)

    def gather_persistent(self, params: Flat) -> None:
        """Stage 3: every rank's persistent partition (in the compute buffer) all-gathered into the
        whole persistent parameters that follow it (layout.py); through the compute device when the
        parameters are on the host (offload_param)."""
        layout = self.layout
        lo, part = layout.persistent_start, layout.persistent_part
        own = params.buffer[lo:lo + part]
        whole = params.buffer[lo + part:lo + part + self.n * part]
        bucket = layout.zero.allgather_bucket_size
        if whole.device == self.device:
            self.data.all_gather(own, whole, bucket)
            return
        gathered = torch.empty(whole.numel(), dtype=whole.dtype, device=self.device)
        self.data.all_gather(own.to(self.device), gathered, bucket)
        whole.copy_(gathered)

    def updates_by_piece(self, opt: Any, grads: Flat | LooseGrads, opt_state: Any, master: Flat) -> bool:
        """Whether the update may run piece by piece with the parameter gather (`update_and_gather`):
        ZeRO-1/2 with nothing offloaded, and what `ParamGather.updates_by_piece` asks of the optimizer."""
        return self.layout.stage in (1, 2) and not self.offload and not self.offload_params and \
            self.gather.updates_by_piece(opt, grads, opt_state, master)

    def update_and_gather(self, update: Callable, grads: Flat, opt_state: Any, master: Flat, params: Flat,
                          cast: Optional[Flat], then: Callable[[], None]) -> tuple[Flat, Any, GatherInFlight]:
        """The update and `write_back` in one (`ParamGather.update_and_gather`): the gather of the
        updated pieces starts while the rest is updated. Returns masters, state, the gather in flight."""
        full = params.buffer[: self.n * self.layout.partition_numel]
        master, state, self.param_gather = self.gather.update_and_gather(update, grads, opt_state, master, full, cast,
                                                                         then)
        return master, state, self.param_gather

    def mean_over_data(self, value: float) -> float:
        return self.data.all_reduce_scalar(value) / self.n if self.n > 1 else value

    def mean_loss(self, value: float) -> float:
        """A step's loss averaged over data ranks; under a pipeline, the last stage's, on every stage."""
        value = self.mean_over_data(value)
        plan = self.layout.pipeline
        if plan is not None and self.pipe.size > 1:
            last = (plan.stages * plan.virtual_stages - 1) % plan.stages
            value = self.pipe.all_reduce_scalar(value if plan.stage == last else 0.0)
        return value

    def broadcast_buffers(self, buffers: PyTree) -> None:
        """Module state (BatchNorm statistics) from data rank 0 to the others, in place (DDP's
        broadcast_buffers): each data rank's forward updates its own copy with its own batch."""
        if self.n > 1:
            for t in tensor_leaves(buffers):
                self.data.broadcast_(t, 0)


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
    if layout.is_local:
        return tree_map(lambda t: t.detach().clone(), source.tree())
    data, model = mesh.comm("data"), mesh.comm("model")
    if layout.stage in (1, 2):
        p = layout.partition_numel
        full = torch.empty(layout.data_size * p, dtype=source.dtype, device=source.device)
        data.all_gather(source.buffer.contiguous(), full)
        leaves = [t.view(shape) for t, shape in zip(layout.local.segments(full), layout.local.shapes)]
    elif layout.stage == 3:
        views = dict(source.items())
        leaves = [None] * len(layout.params)
        for unit, start in zip(layout.units, layout.shard_starts):
            if unit.sharded:
                gathered = data.gathered(source.buffer[start:start + unit.shard_numel].detach())
                for i, t in zip(unit.sharded_params, unit.shard_layout.unflatten(gathered)):
                    leaves[i] = t
            if not layout.persistent:
                for i in unit.resident_params:
                    leaves[i] = views[layout.params[i].path]
        if layout.persistent:  # from the partitions (of the masters where they exist)
            lo, part = layout.persistent_start, layout.persistent_part
            gathered = data.gathered(source.buffer[lo:lo + part].detach())
            for i, t in zip(layout.persistent, layout.persistent_layout.unflatten(gathered)):
                leaves[i] = t
    else:
        leaves = [t for _, t in source.items()]
    out = []
    for info, leaf in zip(layout.params, leaves):
        dim = info.spec.dim_of("model")
        leaf = leaf.detach()
        if dim is not None and model.size > 1:
            leaf = model.gathered(leaf.movedim(dim, 0).contiguous()).movedim(0, dim)
        out.append(leaf.clone())
    if layout.pipeline is not None:
        return _gather_stages(layout, mesh.comm("pipe"), dict(zip(layout.local.paths, out)), source.dtype,
                              source.device)
    return tree_unflatten(layout.local.treedef, out)


def _gather_stages(layout: Layout, pipe: AxisComm, held: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: torch.device) -> PyTree:
    """The whole model's tree from every pipeline stage's parameters: one broadcast per stage of
    the parameters it is the first to hold."""
    plan = layout.pipeline
    owned: dict[int, list[int]] = {}
    for i, path in enumerate(plan.global_paths):
        owned.setdefault(plan.stages_holding(path)[0], []).append(i)
    leaves: list = [None] * len(plan.global_paths)
    for stage in range(plan.stages):
        idx = owned.get(stage, [])
        sizes = [math.prod(plan.global_shapes[i]) for i in idx]
        if stage == plan.stage:
            packed = torch.cat([held[plan.global_paths[i]].reshape(-1) for i in idx]) if idx else \
                torch.empty(0, dtype=dtype, device=device)
        else:
            packed = torch.empty(sum(sizes), dtype=dtype, device=device)
        pipe.broadcast_(packed, stage)
        for i, piece in zip(idx, packed.split(sizes)):
            leaves[i] = piece.view(plan.global_shapes[i]).clone()
    return tree_unflatten(plan.global_treedef, leaves)


__all__ = ["NormPieces", "ParallelRuntime", "build_param_state", "check_optimizer", "gather_params", "local_image",
           "local_params"]
