"""Unit ops: how a model's parameters enter its forward under a plan, one unit at a time.

A parallel-aware model (a loss that accepts `ops=`) receives, for each unit that is a subtree of
its parameters, a `UnitParams` at that subtree's place, and hands it to `ops.param(...)` (a
top-level entry such as `wte`) or `ops.scan(fn, blocks, x)` (the layer stack). There the unit
becomes tensors, right where the model uses it:

- its parameters pass through `deliver_on_backward`, so their gradients reach the gradient sink
  (`fspeed.parallel.grads`) as soon as the unit's backward is done, and bucketed reduction
  overlaps the backward of the layers below;
- a ZeRO-3 sharded unit is gathered just in time (`_GatheredUnit`): its all-gather starts one
  unit ahead (`prefetch`), its gathered weights are freed after its forward and gathered again
  for its backward, whose gradient is reduce-scattered into the shard;
- a call with remat (`fspeed.rematerialization`, or `zero.recompute_blocks`) keeps only what its policy saves and
  is recomputed in backward (inside the unit's second gather under ZeRO-3).

A model that is not parallel-aware (or whose units are not subtrees, like `functionalize`'s flat
dicts) gets every unit materialised before its forward (`eager_params`): correct, but without
per-layer gathering, and its gradients are delivered only when the whole backward is done.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from ..models.ops import BlockFn, BlockRngs, DenseOps, block_generators
from ..pytree import PyTree, tree_flatten, tree_unflatten
from ..remat_blocks import Remat, checkpointed
from ..torch_internals import apply_function, below_functorch, unwrapped
from .comm import AxisComm
from .grads import GradSink, deliver_on_backward
from .layout import Layout, UnitInfo


class UnitParams:
    """What a model sees of one unit under a plan: pass it to `ops.param` or `ops.scan`.

    `shard` is this rank's flat shard of the unit's sharded parameters (ZeRO-3, else None);
    `resident` its whole parameters, in `unit.resident_params` order.
    """

    __slots__ = ("unit", "shard", "resident")

    def __getitem__(self, key: Any):
        raise TypeError(f"{self!r} is one unit of parameters under a plan: pass it to ops.param(...) (or the "
                        "list of blocks to ops.scan(...)) to get its tensors, then index those")

    def __init__(self, unit: UnitInfo, shard: Optional[torch.Tensor], resident: Sequence[torch.Tensor]):
        self.unit, self.shard, self.resident = unit, shard, tuple(resident)

    def __repr__(self) -> str:
        if self.shard is None:
            return f"UnitParams({self.unit.name!r}, {len(self.resident)} whole tensors)"
        return (f"UnitParams({self.unit.name!r}, shard of {self.shard.numel():,} of {self.unit.numel:,} elements, "
                f"{len(self.resident)} whole tensors)")


def _assemble(unit: UnitInfo, full: Optional[torch.Tensor], resident: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unit's tensors in `unit.params` order, from its gathered flat shard and its whole ones."""
    sharded = dict(zip(unit.sharded_params, unit.shard_layout.unflatten(full))) if full is not None else {}
    whole = dict(zip(unit.resident_params, resident))
    return [sharded[i] if i in sharded else whole[i] for i in unit.params]


class _UnitCall:
    """One call of a sharded unit's function: everything its forward and backward need besides the
    tensors (the function, the unit, the non-tensor arguments) and the structure of its arguments
    and results. Tensors cross the autograd Function flat."""

    def __init__(self, ops: "UnitOps", fn: Callable, unit: UnitInfo, args: tuple, kwargs: dict):
        self.ops, self.fn, self.unit = ops, fn, unit
        leaves, self.in_spec = tree_flatten((args, kwargs))
        # floating tensors are the differentiable inputs; anything else (ids, masks, generators) is carried as is
        self.is_tensor = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]
        self.static = [None if t else x for x, t in zip(leaves, self.is_tensor)]
        self.tensors = [x for x, t in zip(leaves, self.is_tensor) if t]
        self.out_spec = self.out_static = None
        self.vjp = self.full = None
        self.nbytes = 0
        self.hint: Optional[int] = None  # the unit expected next in forward (scan knows it)

    def run(self, full: torch.Tensor, tensors: Sequence[torch.Tensor],
            resident: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unit's function on these tensors."""
        it = iter(tensors)
        leaves = [next(it) if is_tensor else static for is_tensor, static in zip(self.is_tensor, self.static)]
        args, kwargs = tree_unflatten(self.in_spec, leaves)
        tree = tree_unflatten(self.unit.tree, _assemble(self.unit, full, [self.ops.to_device(t) for t in resident]))
        out = self.fn(tree, *args, **kwargs)
        out_leaves, self.out_spec = tree_flatten(out)
        self.out_static = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return tuple(x for x in out_leaves if isinstance(x, torch.Tensor))

    def result(self, outputs: Sequence[torch.Tensor]) -> Any:
        """The function's result (its structure) with these output tensors."""
        it = iter(outputs)
        leaves = [next(it) if static is None else static for static in self.out_static]
        return tree_unflatten(self.out_spec, leaves)

    def deliver(self, grad_full: Optional[torch.Tensor], grad_resident: Sequence[Optional[torch.Tensor]]) -> None:
        sink = self.ops.sink
        if self.unit.sharded:
            sink.deliver_shard(self.unit.index, grad_full)
        sink.deliver(self.unit.index, list(grad_resident))


def autograd_vjp(fn: Callable, *primals) -> tuple[Any, Callable]:
    """`torch.func.vjp(fn, *primals)` on plain autograd: the step differentiates with plain autograd
    (train_step), under which a unit's graph is recorded on detached copies of its inputs, as
    activation checkpointing does; `vjp(cotangents)` gives zeros for inputs the outputs do not use."""
    leaves, spec = tree_flatten(primals)
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
    with torch.enable_grad():
        outputs = fn(*tree_unflatten(spec, leaves))

    def vjp(cotangents: Sequence[torch.Tensor]):
        used = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        wanted = [x for x in leaves if x.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in used], wanted, [c for _, c in used], allow_unused=True)
                     if used and wanted else [None] * len(wanted))
        result = [next(grads) if x.requires_grad else None for x in leaves]
        return tree_unflatten(spec, [torch.zeros_like(x) if g is None else g for g, x in zip(result, leaves)])
    return outputs, vjp


def _cotangents(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> tuple:
    """Gradients for every output (zeros where autograd gave none)."""
    return tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads))


class _GatheredUnit(torch.autograd.Function):
    """A unit whose sharded weights exist gathered only while it computes.

    Forward gathers the shard and records the unit's graph (`autograd_vjp`), then frees the
    gathered storage: the graph keeps views of it, which hold no memory while it is empty.
    Backward gathers again into that same storage (no version bump: the bits are what the graph
    saw), runs the recorded vjp and delivers the unit's gradients. With remat the recorded graph
    is a checkpoint's (`fspeed.rematerialization`): the vjp recomputes inside that same gather.
    """

    @staticmethod
    def forward(anchor, shard, call: _UnitCall, n_inputs: int, *tensors):
        inputs, resident = tensors[:n_inputs], tensors[n_inputs:]
        full = call.ops.gathered(call.unit, shard, forward=True, hint=call.hint)
        outputs, call.vjp = autograd_vjp(lambda f, ins, res: call.run(f, ins, res),
                                         full, tuple(inputs), tuple(resident))
        call.full, call.nbytes = full, full.untyped_storage().nbytes()
        call.outputs_like = [torch.empty_like(o, device="meta") for o in outputs]
        full.untyped_storage().resize_(0)
        return tuple(o.detach() for o in outputs)  # the unit's own graph stays the vjp's, not this Function's

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, shard, call, n_inputs, *tensors = inputs
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])
        ctx.save_for_backward(shard)
        ctx.call, ctx.n_inputs, ctx.count = call, n_inputs, len(tensors)
        ctx.anchor_device = inputs[0].device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        (shard,) = ctx.saved_tensors
        full = call.ops.gathered(call.unit, shard, forward=False)
        storage = call.full.untyped_storage()
        storage.resize_(call.nbytes)
        # a plain memory copy that the graph's saved views (of this very storage) see neither as a
        # mutation nor as a version bump
        with below_functorch():
            call.full.data.copy_(unwrapped(full))
        del full
        cotangents = tuple(g if g is not None else torch.zeros(o.shape, dtype=o.dtype, device=call.ops.device)
                           for o, g in zip(call.outputs_like, grads))
        grad_full, grad_inputs, grad_resident = call.vjp(cotangents)
        storage.resize_(0)
        call.vjp = call.full = None
        call.deliver(unwrapped(grad_full), [unwrapped(g) for g in grad_resident])
        anchor_grad = torch.zeros((), device=ctx.anchor_device)  # on its device: no blocking copy
        return (anchor_grad, None, None, None) + tuple(grad_inputs) + (None,) * (ctx.count - ctx.n_inputs)


class _GatheredParams(torch.autograd.Function):
    """A sharded unit taken whole (`ops.param`, or a model that is not parallel-aware): forward
    gathers it; backward reassembles the flat gradient and delivers it with the whole ones'."""

    @staticmethod
    def forward(anchor, shard, ops: "UnitOps", unit: UnitInfo, *resident):
        full = ops.data.gathered(ops.to_device(shard))
        return tuple(t.view_as(t) for t in _assemble(unit, full, [ops.to_device(t) for t in resident]))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ops, ctx.unit, ctx.count = inputs[2], inputs[3], len(inputs) - 4
        ctx.anchor_device = inputs[0].device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        unit, ops = ctx.unit, ctx.ops
        by_param = dict(zip(unit.params, grads))
        pieces = []
        for i in unit.sharded_params:
            g = by_param[i]
            pieces.append(unwrapped(g).reshape(-1) if g is not None else None)
        like = next((p for p in pieces if p is not None), None)
        if like is None:
            like = torch.zeros((), dtype=ops.dtype, device=ops.device)
        grad_full = torch.cat([p if p is not None else like.new_zeros(s)
                               for p, s in zip(pieces, unit.shard_layout.sizes)])
        ops.sink.deliver_shard(unit.index, grad_full)
        ops.sink.deliver(unit.index, [None if by_param[i] is None else unwrapped(by_param[i])
                                      for i in unit.resident_params])
        return (torch.zeros((), device=ctx.anchor_device), None, None, None) + (None,) * ctx.count


class UnitTrace:
    """The order in which units ran, kept from one micro-batch to the next: ZeRO-3 prefetches the
    unit that ran after (forward) or before (backward) the current one last time, as DeepSpeed's
    trace does."""

    def __init__(self):
        self.previous: list[int] = []
        self.current: list[int] = []

    def ran(self, unit: int) -> None:
        self.current.append(unit)

    def neighbour(self, unit: int, forward: bool) -> Optional[int]:
        """The unit after `unit` in the last micro-batch's forward, or the one before it in this
        micro-batch's forward (backward runs in reverse)."""
        order = self.previous if forward else self.current
        if unit not in order:
            return None
        at = order.index(unit) + (1 if forward else -1)
        return order[at] if 0 <= at < len(order) else None

    def next_micro_batch(self) -> None:
        if self.current:
            self.previous, self.current = self.current, []


class UnitOps(DenseOps):
    """Dense model ops whose `param`, `call` and `scan` take `UnitParams` (module docstring).
    Bound to one micro-batch: the anchor it differentiates, and the sink its gradients go to;
    without a sink (evaluation) units are only gathered."""

    def __init__(self, layout: Layout, data: AxisComm, sink: Optional[GradSink], anchor: Optional[torch.Tensor],
                 device: torch.device, dtype: torch.dtype, to_device: Callable[[torch.Tensor], torch.Tensor],
                 trace: Optional[UnitTrace] = None, uploads: bool = False):
        self.layout, self.data, self.sink, self.anchor = layout, data, sink, anchor
        self.device, self.dtype, self.to_device = device, dtype, to_device
        self.uploads = uploads  # whether `to_device` copies (offload_param): each unit is uploaded as it runs
        self.recompute = Remat() if layout.zero.recompute_blocks else None  # ZeRO-3's own switch: full remat
        self.model_comm: Optional[AxisComm] = None  # the tensor-slicing axis (remat's partitioned inputs)
        self.prefetch = layout.zero.prefetch
        self.trace = trace if trace is not None else UnitTrace()
        self.units: dict[int, UnitParams] = {}
        self._taken: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, Any] = {}
        # ZeRO-1/2: the previous step's parameter all-gather, still in flight, and each unit's flat
        # range; a unit waits for its buckets when the forward first takes it
        self.param_gather: Optional[tuple[Any, dict[int, tuple[int, int]]]] = None

    @property
    def taken_order(self) -> list[int]:
        """The units in the order this micro-batch took them (ZeRO-1/2 gather in that order)."""
        return list(self._taken)

    def bind(self, units: Sequence[UnitParams]) -> None:
        """The units of this micro-batch's parameters (for prefetching by index)."""
        self.units = {u.unit.index: u for u in units}

    # -- gathering ---------------------------------------------------------------------------

    def gathered(self, unit: UnitInfo, shard: torch.Tensor, forward: bool, hint: Optional[int] = None) -> torch.Tensor:
        """A sharded unit's full flat parameters (from its prefetch when one is in flight), and the
        prefetch of the unit expected next (`hint`, else the trace)."""
        pending = self._pending.pop(unit.index, None)
        full = pending.wait() if pending is not None else self.data.gathered(self.to_device(shard))
        if forward:
            self.trace.ran(unit.index)
        neighbour = hint if hint is not None else self.trace.neighbour(unit.index, forward)
        nxt = self.units.get(neighbour) if neighbour is not None else None
        if self.prefetch and nxt is not None and nxt.shard is not None and neighbour not in self._pending:
            self._pending[neighbour] = self.data.start_gather(self.to_device(nxt.shard))
        return full

    def close(self) -> None:
        """End of the micro-batch: wait for prefetches nobody took (every rank issued them)."""
        for pending in self._pending.values():
            pending.wait()
        self._pending.clear()
        self.trace.next_micro_batch()

    # -- the ops -----------------------------------------------------------------------------

    def take(self, p: UnitParams) -> list[torch.Tensor]:
        """The unit's tensors in `unit.params` order, ready to compute with (once per micro-batch)."""
        unit = p.unit
        if unit.index not in self._taken:
            if self.param_gather is not None and unit.index in self.param_gather[1]:
                self.param_gather[0].wait_range(*self.param_gather[1][unit.index])
            if self.sink is None:
                full = self.gathered(unit, p.shard, forward=True) if p.shard is not None else None
                tensors = _assemble(unit, full, [self.to_device(t) for t in p.resident])
            elif p.shard is not None:
                tensors = list(apply_function(_GatheredParams, self.anchor, p.shard, self, unit, *p.resident))
            elif self.sink.loose:  # autograd leaves: backward fills their .grad, which the sink reads
                tensors = list(p.resident)
            else:
                tensors = [self.to_device(t) for t in deliver_on_backward(self.anchor, self.sink, unit.index, p.resident)]
            self._taken[unit.index] = tensors
        return self._taken[unit.index]

    def direct(self, p: Any) -> bool:
        """Whether `call(p, fn, ...)` is `fn(param(p), ...)` alone: no gather (whole parameters, one
        data rank, nothing uploaded, no gather of the last update in flight) and no remat. A caller
        may then take such units up front instead of routing a call through each."""
        return (isinstance(p, UnitParams) and p.shard is None and self.recompute is None and self.data.size == 1
                and self.param_gather is None and not self.uploads)

    def param(self, p: Any) -> Any:
        if not isinstance(p, UnitParams):
            return p
        if p.unit.tree is None:
            raise TypeError(f"unit {p.unit.name!r} is not a subtree of the parameters; it cannot be taken whole")
        return tree_unflatten(p.unit.tree, self.take(p))

    def call(self, p: Any, fn: Callable, *args: Any, _hint: Optional[int] = None, _remat: Any = None,
             _label: Optional[str] = None, **kwargs: Any) -> Any:
        """`fn(params, *args, **kwargs)` with the unit's parameters: a sharded unit is gathered
        for this call only (and again for its backward); with remat (`_remat`, else
        `zero.recompute_blocks`) the call is checkpointed; a unit taken whole is taken once per
        micro-batch."""
        remat = _remat if _remat is not None else self.recompute
        if self.sink is None or not torch.is_grad_enabled():
            remat = None  # evaluation: nothing is kept for a backward
        if remat is not None:
            label = p.unit.name if isinstance(p, UnitParams) else (_label or "block")
            fn = functools.partial(checkpointed, remat, fn, model_comm=self.model_comm, label=label)
        if not isinstance(p, UnitParams) or self.sink is None or p.unit.index in self._taken or p.shard is None:
            out = fn(self.param(p), *args, **kwargs)
            if self.sink is None and isinstance(p, UnitParams):
                self._taken.pop(p.unit.index, None)  # evaluation keeps no gathered unit
            return out
        call = _UnitCall(self, fn, p.unit, args, kwargs)
        call.hint = _hint
        inputs = call.tensors
        outputs = apply_function(_GatheredUnit, self.anchor, p.shard, call, len(inputs), *inputs, *p.resident)
        return call.result(outputs)

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor, rng: BlockRngs = None, *,
             first: int = 0, after: Any = None) -> torch.Tensor:
        for i, (block, rng_i) in enumerate(zip(blocks, block_generators(rng, len(blocks)))):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else after
            hint = nxt.unit.index if isinstance(nxt, UnitParams) else None
            x = self.call(block, fn, x, rng_i, _hint=hint)
        return x


def unit_params(layout: Layout, params_flat) -> list[UnitParams]:
    """Every unit's `UnitParams` over the rank's compute buffer (views, no copies)."""
    views = dict(params_flat.items())
    out = []
    for unit, start in zip(layout.units, layout.shard_starts):
        shard = params_flat.buffer[start:start + unit.shard_numel] if unit.sharded else None
        resident = [views[layout.params[i].path] for i in unit.resident_params]
        out.append(UnitParams(unit, shard, resident))
    return out


def model_view(layout: Layout, units: Sequence[UnitParams]) -> Optional[PyTree]:
    """The parameter tree with a `UnitParams` at each unit's place, or None when a unit is not a
    subtree (then the model gets `eager_params`)."""
    if any(u.unit.tree is None for u in units):
        return None
    leaves: list[Any] = [None] * len(layout.params)
    tree = tree_unflatten(layout.local.treedef, leaves)
    return replace_units(tree, {u.unit.name: u for u in units})


def eager_params(ops: UnitOps, units: Sequence[UnitParams]) -> PyTree:
    """The plain parameter tree, every unit taken before the forward."""
    leaves: list[Any] = [None] * len(ops.layout.params)
    for u in units:
        for i, t in zip(u.unit.params, ops.take(u)):
            leaves[i] = t
    return tree_unflatten(ops.layout.local.treedef, leaves)


def replace_units(tree: PyTree, replacements: dict, prefix: str = "") -> PyTree:
    """A copy of the nested dict/list `tree` with the subtrees at the given paths replaced."""
    if prefix in replacements:
        return replacements[prefix]
    if isinstance(tree, dict):
        return {k: replace_units(v, replacements, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [replace_units(v, replacements, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(tree)]
        return type(tree)(items)
    return tree


__all__ = ["UnitOps", "UnitParams", "UnitTrace", "eager_params", "model_view", "replace_units", "unit_params"]
