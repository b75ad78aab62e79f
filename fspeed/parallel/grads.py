"""Gradients leave backward as it produces them: delivered by unit, reduced by ZeRO stage, in buckets.

Under `torch.func` there are no gradient hooks. `train_step` differentiates each micro-batch's
loss with respect to a 0-d `anchor` only; every unit's parameters enter the model through
`deliver_on_backward(anchor, sink, unit, tensors)`, an identity whose backward hands the unit's
gradients to the sink (ZeRO-3's gather does the same for its shards). The autograd engine runs
that backward as soon as the unit's gradients are complete, which is right after the layer's
backward when the identity is applied where the layer is used (`fspeed.parallel.ops` does so in
`ops.param` and `ops.scan`). What each stage does with a delivered gradient:

    stage 0   copy/add into the full accumulation buffer; on the last micro-batch, all-reduce
              each bucket (`reduce_bucket_size`, parameter-aligned ranges of the buffer) as soon
              as every gradient in it has arrived; one CPU process (nothing to reduce) whose
              optimizer takes them keeps backward's own tensors instead (`LooseGrads`: no copy):
              there the parameters are plain autograd leaves and backward fills their `.grad`
              as an eager loop's does (no delivery identity per unit)
    stage 1   the same buffer; its buckets are cut at partition boundaries and reduced onto the
              rank that owns them (DeepSpeed's reduce_scatter=true); the partition is a view
    stage 2   no full buffer: gradients are copied into a bucket as they arrive (DeepSpeed's IPG
              buckets); a full bucket is reduced onto each piece's owner rank, which adds it into
              its fp32 partition accumulator; every micro-batch, as DeepSpeed's stage 2
    stage 3   the gathered unit's gradient is reduce-scattered into the unit's shard; persistent
              parameters' gradients are reduced in packed buckets onto the owners of their
              partition; every micro-batch, as DeepSpeed's stage 3

With `overlap_comm` the bucket collectives run asynchronously while backward goes on (stage 2
and the packed buckets keep two buffers, as DeepSpeed's double buffering) and are waited for at
`finish`; without it each one is waited for as it is launched. Every collective is issued in the
same order on every rank because the engine delivers units in the same order (same graph).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch

from ..flat import Flat, LooseGrads
from .comm import AxisComm, Pending
from .layout import Layout
from ..torch_internals import apply_function, below_functorch, unwrapped


class _DeliverGrads(torch.autograd.Function):
    """Identity on a unit's parameters; backward delivers their gradients to the sink."""

    @staticmethod
    def forward(anchor, sink, unit, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.sink, ctx.unit, ctx.count = inputs[1], inputs[2], len(inputs) - 3
        ctx.anchor_device = inputs[0].device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        ctx.sink.deliver(ctx.unit, grads)
        # on the anchor's device: a CPU zero for a CUDA anchor costs a blocking copy per unit
        return (torch.zeros((), device=ctx.anchor_device), None, None) + (None,) * ctx.count


def deliver_on_backward(anchor: torch.Tensor, sink: "GradSink", unit: int,
                        tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`tensors` (a unit's parameters, in `sink.order(unit)`), whose gradients reach `sink`."""
    if not tensors:
        return ()
    return apply_function(_DeliverGrads, anchor, sink, unit, *tensors)


class GradSink:
    """Receives gradients during backward and reduces them over `data` (module docstring).

    Per step: `begin_step(reduce, micro_batches)`, then per micro-batch `begin_micro(i)`,
    deliveries, `end_micro()`; `finish()` returns what the optimizer consumes. `reduce=False`
    (1-bit optimizers' compressed steps) keeps the local gradient.
    """

    def __init__(self, layout: Layout, comm: AxisComm, dtype: torch.dtype, device: torch.device):
        self.layout, self.comm, self.dtype, self.device = layout, comm, dtype, device
        self.overlap = layout.zero.overlaps
        self.bucket = layout.zero.reduce_bucket_size
        self.reduce, self.micro, self.last = True, 0, True
        self.delivered: set[int] = set()
        self.loose = False  # whether the parameters are autograd leaves whose .grad the sink reads (`hold_leaves`)

    def order(self, unit: int) -> tuple[int, ...]:
        """The parameters (indices into layout.params) `deliver(unit, ...)` takes, in order."""
        return self.layout.units[unit].params

    def begin_step(self, reduce: bool, micro_batches: int) -> None:
        self.reduce, self.micro_batches = reduce, micro_batches

    def begin_micro(self, index: int) -> None:
        self.micro, self.last = index, index == self.micro_batches - 1
        self.delivered = set()

    def deliver(self, unit: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """The gradients of a unit's parameters (`order(unit)`; None: unused), from backward."""
        if not torch._C._are_functorch_transforms_active() and not torch.is_grad_enabled():
            self._deliver(unit, grads)  # plain autograd's backward (the train step's): nothing to step below
            return
        with below_functorch():
            self._deliver(unit, [None if g is None else unwrapped(g) for g in grads])

    def deliver_shard(self, unit: int, grad_full: torch.Tensor) -> None:
        """Stage 3: the gradient of a unit's gathered (sharded) parameters, flat, to reduce-scatter."""
        with below_functorch():
            self._deliver_shard(unit, unwrapped(grad_full))

    def _deliver(self, unit: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        raise NotImplementedError

    def _deliver_shard(self, unit: int, grad_full: torch.Tensor) -> None:
        raise TypeError(f"{type(self).__name__} has no sharded units (ZeRO stage {self.layout.stage})")

    def _first_delivery(self, unit: int) -> None:
        if unit in self.delivered:
            raise RuntimeError(f"the gradient of unit {self.layout.units[unit].name!r} was delivered twice in one "
                               "micro-batch; a unit must enter the model once (ops.param caches it)")
        self.delivered.add(unit)

    def end_micro(self) -> None:
        for unit in range(len(self.layout.units)):
            if unit not in self.delivered:  # unused this micro-batch: no gradient reached it
                self._deliver(unit, [None] * len(self.order(unit)))

    def finish(self) -> Flat:
        raise NotImplementedError

    def held_bytes(self) -> dict[str, int]:
        """Bytes of gradient buffers kept between steps, by where they live ("device", "host")."""
        raise NotImplementedError


def _bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _by_place(buffers: Sequence[torch.Tensor], host: Optional[bool] = None) -> dict[str, int]:
    """Bytes of `buffers` by place; with `host=True` the first one (an offloaded accumulator) is
    on the host whatever its device (on a machine without CUDA, host and device are both CPU)."""
    out = {"device": 0, "host": 0}
    for k, t in enumerate(buffers):
        out["host" if (host and k == 0) else "device"] += _bytes(t)
    return out


class _InPlaceBuckets:
    """Static, parameter-aligned buckets over a flat buffer: each is launched (`launch(lo, hi,
    owner)`) once every parameter overlapping it has arrived; `flush` launches the rest in order."""

    def __init__(self, ranges: list[tuple[int, int, int]], params_of: list[list[int]], launch, overlap: bool):
        self.ranges, self.launch, self.overlap = ranges, launch, overlap
        self.buckets_of: dict[int, list[int]] = {}
        self.count = [len(p) for p in params_of]
        for b, params in enumerate(params_of):
            for p in params:
                self.buckets_of.setdefault(p, []).append(b)
        self.remaining: list[int] = []
        self.launched: list[bool] = []
        self.pending: list[Pending] = []

    def reset(self) -> None:
        self.remaining = list(self.count)
        self.launched = [False] * len(self.ranges)
        self.pending = []

    def arrived(self, params: Sequence[int]) -> None:
        for p in params:
            for b in self.buckets_of.get(p, ()):
                self.remaining[b] -= 1
                if self.remaining[b] == 0:
                    self._launch(b)

    def _launch(self, b: int) -> None:
        self.launched[b] = True
        pending = self.launch(*self.ranges[b])
        if self.overlap:
            self.pending.append(pending)
        else:
            pending.wait()

    def flush(self) -> None:
        for b, done in enumerate(self.launched):
            if not done:
                self._launch(b)
        for pending in self.pending:
            pending.wait()
        self.pending = []


def _aligned_ranges(offsets: Sequence[int], sizes: Sequence[int], bucket: int,
                    cuts: Sequence[int] = ()) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Ranges of at most `bucket` elements covering the parameters: whole parameters merged
    while they fit, never across a point of `cuts`, a parameter larger than a bucket split into
    bucket-size pieces. Also, per range, the parameters overlapping it."""
    end = max((o + s for o, s in zip(offsets, sizes)), default=0)
    cut_set = {c for c in cuts if 0 < c < end}
    points = sorted({0, end} | {o for o in offsets if o < end} | {o + s for o, s in zip(offsets, sizes)} | cut_set)
    ranges: list[tuple[int, int]] = []
    lo = hi = None
    for a, b in zip(points, points[1:]):
        if lo is not None and (a in cut_set or b - lo > bucket):
            ranges.append((lo, hi))
            lo = None
        if b - a > bucket:
            ranges.extend((x, min(b, x + bucket)) for x in range(a, b, bucket))
            continue
        lo = a if lo is None else lo
        hi = b
    if lo is not None:
        ranges.append((lo, hi))
    order = sorted(range(len(offsets)), key=lambda i: offsets[i])
    members, k = [], 0
    for a, b in ranges:
        while k < len(order) and offsets[order[k]] + sizes[order[k]] <= a:
            k += 1
        j, inside = k, []
        while j < len(order) and offsets[order[j]] < b:
            if sizes[order[j]]:
                inside.append(order[j])
            j += 1
        members.append(inside)
    return ranges, members


class _SummedInPlace:
    """For the sinks that reduce a pipeline stage's gradient where the stage summed it, in a buffer
    of theirs (`buffer_for_summed`; stages 0-2): the summed step's start, its `final` and the
    delivery of every unit. `summed_buckets`: their in-place buckets over that buffer."""

    summed_buckets: _InPlaceBuckets

    def begin_summed(self, reduce: bool) -> Optional[Callable[[Sequence[int]], None]]:
        """Begin a step whose gradient is summed in `buffer_for_summed()` (a pipeline stage's, over
        its micro-batches). Returns `final(params)`, for the summing to call as parameters' sums
        become final: their buckets are reduced while the rest is still being summed. None when
        nothing is reduced (one data rank, or a step that keeps the local gradient) or without
        `overlap_comm` (DeepSpeed's reduction after backward: a reduction waited for as it starts
        would hold up what the stage runs next)."""
        self.begin_step(reduce, 1)
        self.begin_micro(0)
        self.summed_buckets.reset()
        self.summing, self.final = True, set()
        return self._final if self.reduce and self.comm.size > 1 and self.overlap else None

    def _final(self, params: Sequence[int]) -> None:
        new = [p for p in params if p not in self.final]
        self.final.update(new)
        self.summed_buckets.arrived(new)

    def _deliver_summed(self, reduce: bool) -> None:
        """Every unit delivered (last unit first, as backward would) and its buckets launched; those
        `final` launched already are not launched again."""
        if not self.summing:
            self.begin_summed(reduce)
        self.summing = False
        for unit in reversed(self.layout.units):
            self._first_delivery(unit.index)
            if self.reduce and self.comm.size > 1:
                self._final(self.order(unit.index))


class AccumulatedGrads(_SummedInPlace, GradSink):
    """Stages 0 and 1: one full accumulation buffer; buckets of it are all-reduced (stage 0) or
    reduced onto their owner (stage 1) on the last micro-batch, as gradients complete them.

    `loose` (stage 0 on one data rank, for an optimizer that takes `LooseGrads`): no buffer; the
    parameters are autograd leaves (`hold_leaves`, views of the parameter buffer) and backward
    accumulates into their `.grad` as in an eager loop (the first gradient kept as backward made
    it, later micro-batches added in place, a tensor that is not its own copied, all by autograd);
    `finish` hands those tensors over. A hook takes each parameter's gradient norm as the last
    micro-batch completes it (in cache), unless `take_norms` is off (the optimizer's pass gives it)."""

    def __init__(self, layout: Layout, comm: AxisComm, dtype: torch.dtype, device: torch.device,
                 loose: bool = False, take_norms: bool = True):
        super().__init__(layout, comm, dtype, device)
        self.take_norms = take_norms
        self.stage1 = layout.stage == 1
        n, local = comm.size, layout.local
        self.loose = loose and not self.stage1 and n == 1
        self.leaves: list[Optional[torch.Tensor]] = [None] * len(local.paths)
        self.norms: list[Optional[torch.Tensor]] = [None] * len(local.paths)  # of the final gradients
        self.part = layout.partition_numel if self.stage1 else local.numel
        self.acc = None if self.loose else \
            torch.zeros(n * self.part if self.stage1 else local.numel, dtype=dtype, device=device)
        self.segments = [] if self.loose else local.segments(self.acc)
        cuts = [k * self.part for k in range(1, n)] if self.stage1 else []
        ranges, members = _aligned_ranges(local.offsets, local.sizes, self.bucket, cuts)
        owned = [(a, b, a // self.part if self.stage1 else -1) for a, b in ranges]
        self.buckets = _InPlaceBuckets(owned, members, self._launch, self.overlap)
        self.summed_buckets = self.buckets  # a summed step's too: the stage sums in the accumulator
        self.summing, self.final = False, set()  # a summed step begun (`begin_summed`); its final parameters

    def _launch(self, lo: int, hi: int, owner: int) -> Pending:
        piece = self.acc[lo:hi]
        return self.comm.start_reduce(piece, owner) if owner >= 0 else self.comm.start_all_reduce(piece)

    def hold_leaves(self, leaves: dict[int, torch.Tensor]) -> None:
        """The loose sink's parameters (index in layout.params -> autograd leaf), whose `.grad`
        backward fills; with `take_norms`, each gets a hook taking its norm on the last micro-batch."""
        self.leaves = [leaves.get(i) for i in range(len(self.leaves))]
        if self.take_norms:
            for i, leaf in leaves.items():
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(functools.partial(self._take_norm, i))

    def _take_norm(self, i: int, leaf: torch.Tensor) -> None:
        if self.last:  # the gradient is final, and in cache
            self.norms[i] = torch.linalg.vector_norm(leaf.grad)

    def begin_step(self, reduce: bool, micro_batches: int) -> None:
        super().begin_step(reduce, micro_batches)
        self.buckets.reset()
        if self.loose:  # (a step that failed part-way left its gradients)
            self._forget_grads()

    def _forget_grads(self) -> None:
        for leaf in self.leaves:
            if leaf is not None:
                leaf.grad = None
        self.norms = [None] * len(self.norms)

    def end_micro(self) -> None:
        if not self.loose:  # (the loose sink's gradients are in the leaves: nothing is delivered)
            super().end_micro()

    def _deliver(self, unit: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if self.loose:
            raise RuntimeError("the loose gradient sink's parameters are autograd leaves (hold_leaves): backward fills "
                               "their .grad; nothing is delivered to it")
        self._first_delivery(unit)
        params = self.order(unit)
        first = self.micro == 0
        segs, flat = [], []
        for i, g in zip(params, grads):
            if g is not None:
                segs.append(self.segments[i])
                flat.append(g.reshape(-1))
            elif first:
                self.segments[i].zero_()
        if segs:  # one multi-tensor launch per unit on CUDA, not one per parameter
            (torch._foreach_copy_ if first else torch._foreach_add_)(segs, flat)
        if self.last and self.reduce and self.comm.size > 1:
            self.buckets.arrived(params)

    def buffer_for_summed(self) -> Optional[torch.Tensor]:
        """The accumulator's local-order part, for a gradient summed outside the sink (a pipeline
        stage's) to be written straight into (then `deliver_in_place`); None for the loose sink."""
        return None if self.loose else self.acc[:self.layout.local.numel]

    def deliver_in_place(self, reduce: bool) -> None:
        """The step's gradient, summed in `buffer_for_summed()` already, as its one micro-batch:
        reduced where it lies, no copy."""
        self._deliver_summed(reduce)

    def finish(self) -> Flat | LooseGrads:
        if self.loose:
            local = self.layout.local
            grads = [leaf.grad if leaf is not None else None for leaf in self.leaves]
            tensors = [g.reshape(-1) if g is not None else torch.zeros(n, dtype=self.dtype, device=self.device)
                       for g, n in zip(grads, local.sizes)]  # unused parameters: zero gradients
            norms = None
            if self.take_norms:
                late = [i for i, n in enumerate(self.norms) if n is None and grads[i] is not None]
                for i, norm in zip(late, torch._foreach_norm([tensors[i] for i in late]) if late else ()):
                    self.norms[i] = norm  # a gradient from an earlier micro-batch only (a layer dropped on the last)
                norms = [n if n is not None else torch.zeros((), dtype=self.dtype, device=self.device)
                         for n in self.norms]
            self._forget_grads()
            return LooseGrads(tensors, local, norms)
        if self.reduce and self.comm.size > 1:
            self.buckets.flush()
        if self.stage1:
            rank = self.comm.rank
            return Flat(self.acc[rank * self.part:(rank + 1) * self.part], self.layout.partition)
        return Flat(self.acc, self.layout.local)

    def held_bytes(self) -> dict[str, int]:
        return _by_place([self.acc])


class _PackedBuckets:
    """Gradient pieces copied, in arrival order, into one of two (overlap) or one bucket
    buffers of `size` elements (DeepSpeed's IPG buckets). Each piece is labelled `(owner rank,
    offset in the owner's partition)`; a full bucket is reduced onto the owners, one collective per
    run of pieces with the same owner, and once done this rank adds its own pieces into
    `partition()` (the sink's accumulator, read at that moment)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, overlap: bool, comm: AxisComm,
                 partition: Callable[[], torch.Tensor]):
        self.size, self.dtype, self.device, self.overlap = size, dtype, device, overlap
        self.comm, self.partition = comm, partition
        self.buffers: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []
        self.in_flight: deque = deque()
        self.current: Optional[torch.Tensor] = None
        self.fill = 0
        self.records: list[tuple] = []

    def _buffer(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        if len(self.buffers) < (2 if self.overlap else 1):
            self.buffers.append(torch.empty(self.size, dtype=self.dtype, device=self.device))
            return self.buffers[-1]
        self._complete(self.in_flight.popleft())
        return self.free.pop()

    def add(self, source: torch.Tensor, key: Any) -> None:
        """Copy the 1-D `source` into buckets; `key(offset)` labels the piece starting at
        `offset` of source (records are `(label, bucket offset, count)`)."""
        done, total = 0, source.numel()
        while done < total:
            if self.current is None:
                self.current, self.fill = self._buffer(), 0
            take = min(total - done, self.size - self.fill)
            self.current[self.fill:self.fill + take].copy_(source[done:done + take])
            self.records.append((key(done), self.fill, take))
            self.fill += take
            done += take
            if self.fill == self.size:
                self.flush()

    def launch(self, buf: torch.Tensor, records: list) -> list[Pending]:
        pendings, start = [], 0
        for k in range(1, len(records) + 1):  # one reduce per run of pieces with the same owner
            if k == len(records) or records[k][0][0] != records[start][0][0]:
                lo, hi = records[start][1], records[k - 1][1] + records[k - 1][2]
                pendings.append(self.comm.start_reduce(buf[lo:hi], records[start][0][0]))
                start = k
        return pendings

    def apply(self, buf: torch.Tensor, records: list) -> None:
        partition, rank = self.partition(), self.comm.rank
        for (owner, at), lo, count in records:
            if owner == rank:
                partition[at:at + count].add_(buf[lo:lo + count].to(partition.device))

    def flush(self) -> None:
        if self.current is None or not self.records:
            return
        buf, records = self.current, self.records
        self.current, self.records, self.fill = None, [], 0
        entry = (buf, records, self.launch(buf, records))
        if self.overlap:
            self.in_flight.append(entry)
        else:
            self._complete(entry)

    def _complete(self, entry) -> None:
        buf, records, pendings = entry
        for pending in pendings:
            pending.wait()
        self.apply(buf, records)
        self.free.append(buf)

    def drain(self) -> None:
        self.flush()
        while self.in_flight:
            self._complete(self.in_flight.popleft())


class PartitionGrads(_SummedInPlace, GradSink):
    """Stage 2: gradients go through packed buckets straight to their owners' partitions; only
    this rank's fp32 partition accumulator and the buckets exist (module docstring).

    A pipeline stage sums its micro-batches' gradients itself, in a full local-order buffer the
    sink lends for the step (`buffer_for_summed`); its partition-aligned buckets are then reduced
    onto their owners in place, as ZeRO-1's are, with overlap_comm while the schedule goes on."""

    def __init__(self, layout: Layout, comm: AxisComm, dtype: torch.dtype, device: torch.device):
        super().__init__(layout, comm, dtype, device)
        self.part = layout.partition_numel
        self.acc = torch.zeros(self.part, dtype=dtype, device=device)
        size = max(1, min(self.bucket, layout.local.numel))
        self.buckets = _PackedBuckets(size, dtype, device, self.overlap, comm, lambda: self.acc)
        local = layout.local
        ranges, members = _aligned_ranges(local.offsets, local.sizes, self.bucket,
                                          [k * self.part for k in range(1, comm.size)])
        self.summed_buckets = _InPlaceBuckets([(a, b, a // self.part) for a, b in ranges], members,
                                              self._launch_summed, self.overlap)
        self.summed: Optional[torch.Tensor] = None  # the step's lent buffer, while a summed step runs
        self.summing, self.final = False, set()

    def buffer_for_summed(self) -> torch.Tensor:
        """A local-order buffer for this step's gradient, summed outside the sink (a pipeline
        stage's), then `deliver_in_place`; the same one until then, dropped after it."""
        if self.summed is None:
            self.summed = torch.empty(self.layout.local.numel, dtype=self.dtype, device=self.device)
        return self.summed

    def _launch_summed(self, lo: int, hi: int, owner: int) -> Pending:
        return self.comm.start_reduce(self.summed[lo:hi], owner)

    def deliver_in_place(self, reduce: bool) -> None:
        """The step's gradient, summed in `buffer_for_summed()`: the buckets `final` did not launch
        are reduced, then this rank's partition of the sums is its accumulator."""
        self._deliver_summed(reduce)
        self.summed_buckets.flush()
        lo = min(self.comm.rank * self.part, self.summed.numel())
        hi = min(lo + self.part, self.summed.numel())
        self.acc[:hi - lo].copy_(self.summed[lo:hi])  # past the local numel: padding, zero since begin_step
        self.summed = None

    def begin_step(self, reduce: bool, micro_batches: int) -> None:
        super().begin_step(reduce, micro_batches)
        self.acc.zero_()

    def _deliver(self, unit: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        self._first_delivery(unit)
        local = self.layout.local
        for i, g in zip(self.order(unit), grads):
            if g is None:
                continue  # the accumulator started at zero
            flat, offset = g.reshape(-1), local.offsets[i]
            lo = 0
            while lo < flat.numel():  # split at partition boundaries
                owner = (offset + lo) // self.part
                hi = min(flat.numel(), (owner + 1) * self.part - offset)
                self.buckets.add(flat[lo:hi], lambda d, o=owner, at=offset + lo - owner * self.part: (o, at + d))
                lo = hi

    def end_micro(self) -> None:
        super().end_micro()
        self.buckets.drain()  # every micro-batch's gradient is in the partitions before the next

    def finish(self) -> Flat:
        self.buckets.drain()
        return Flat(self.acc, self.layout.partition)

    def held_bytes(self) -> dict[str, int]:
        return _by_place([self.acc, *self.buckets.buffers])


class ShardGrads(GradSink):
    """Stage 3: each gathered unit's gradient is reduce-scattered into its shard of the
    accumulator; persistent parameters' gradients go through packed buckets to the owners of
    their partition (one reduce per run of pieces with the same owner, as stage 2's), which add
    them into the accumulator's persistent partition: every micro-batch, as DeepSpeed's stage 3.
    On one data rank (nothing sharded or persistent) gradients are added where they belong.
    `device` is where the storage lives (the host with offload_param); collectives run on
    `comm_device`."""

    def __init__(self, layout: Layout, comm: AxisComm, dtype: torch.dtype, device: torch.device,
                 comm_device: Optional[torch.device] = None, on_host: bool = False):
        super().__init__(layout, comm, dtype, device)
        self.comm_device = comm_device or device
        self.on_host = on_host  # the accumulator is offloaded (offload_param)
        storage = layout.storage
        self.acc = torch.zeros(storage.numel, dtype=dtype, device=device)
        self.shard_seg = {u.index: self.acc[start:start + u.shard_numel]
                          for u, start in zip(layout.units, layout.shard_starts) if u.sharded}
        self.in_flight: deque = deque()
        self.param_seg: dict[int, torch.Tensor] = {}  # one data rank: each whole parameter's accumulator
        self.persistent_at: dict[int, int] = {}  # several: each persistent parameter's offset in their flat buffer
        self.buckets: Optional[_PackedBuckets] = None
        if layout.persistent:
            persistent = layout.persistent_layout
            self.persistent_at = dict(zip(layout.persistent, persistent.offsets))
            self.part, lo = layout.persistent_part, layout.persistent_start
            self.partition = self.acc[lo:lo + self.part]
            self.buckets = _PackedBuckets(max(1, min(self.bucket, persistent.numel)), dtype, self.comm_device,
                                          self.overlap, comm, lambda: self.partition)
        else:
            segments = dict(zip(storage.paths, storage.segments(self.acc)))
            self.param_seg = {i: segments[layout.params[i].path] for u in layout.units for i in u.resident_params}

    def order(self, unit: int) -> tuple[int, ...]:
        return self.layout.units[unit].resident_params

    def begin_step(self, reduce: bool, micro_batches: int) -> None:
        super().begin_step(reduce, micro_batches)
        self.acc.zero_()

    def _deliver_shard(self, unit: int, grad_full: torch.Tensor) -> None:
        info = self.layout.units[unit]
        n, shard = self.comm.size, info.shard_numel
        if grad_full.numel() == n * shard and grad_full.is_contiguous():
            padded = grad_full.reshape(-1)
        else:  # the unit's numel is not a multiple of N: pad with zeros
            padded = torch.empty(n * shard, dtype=grad_full.dtype, device=grad_full.device)
            padded[:grad_full.numel()].copy_(grad_full.reshape(-1))
            padded[grad_full.numel():].zero_()
        out = torch.empty(shard, dtype=grad_full.dtype, device=grad_full.device)
        self.in_flight.append((unit, out, self.comm.start_reduce_scatter(padded, out)))
        if not self.overlap or len(self.in_flight) > 2:
            self._complete_shard()

    def _complete_shard(self) -> None:
        unit, out, pending = self.in_flight.popleft()
        pending.wait()
        seg = self.shard_seg[unit]
        seg.add_(out.to(seg.device))

    def _deliver(self, unit: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        self._first_delivery(unit)
        for i, g in zip(self.order(unit), grads):
            if g is None:
                continue  # the accumulator started at zero
            if self.buckets is None:
                seg = self.param_seg[i]
                seg.add_(g.reshape(-1).to(seg.device))
                continue
            flat, offset = g.reshape(-1).to(self.comm_device), self.persistent_at[i]
            lo = 0
            while lo < flat.numel():  # split at partition boundaries
                owner = (offset + lo) // self.part
                hi = min(flat.numel(), (owner + 1) * self.part - offset)
                self.buckets.add(flat[lo:hi], lambda d, o=owner, at=offset + lo - owner * self.part: (o, at + d))
                lo = hi

    def end_micro(self) -> None:
        super().end_micro()
        while self.in_flight:
            self._complete_shard()
        if self.buckets is not None:
            self.buckets.drain()  # every micro-batch's gradient is in the partitions before the next

    def finish(self) -> Flat:
        while self.in_flight:
            self._complete_shard()
        if self.buckets is not None:
            self.buckets.drain()
        return Flat(self.acc, self.layout.storage)

    def held_bytes(self) -> dict[str, int]:
        return _by_place([self.acc, *(self.buckets.buffers if self.buckets is not None else ())], host=self.on_host)


SINKS = {0: AccumulatedGrads, 1: AccumulatedGrads, 2: PartitionGrads, 3: ShardGrads}


__all__ = ["AccumulatedGrads", "GradSink", "PartitionGrads", "SINKS", "ShardGrads", "deliver_on_backward"]
