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
- with `zero.recompute_blocks`, a block keeps only its input and is recomputed in backward.

A model that is not parallel-aware (or whose units are not subtrees, like `functionalize`'s flat
dicts) gets every unit materialised before its forward (`eager_params`): correct, but without
per-layer gathering, and its gradients are delivered only when the whole backward is done.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..models.ops import BlockFn, DenseOps
from ..pytree import PyTree, tree_unflatten
from .comm import AxisComm
from .grads import GradSink, deliver_on_backward
from .layout import Layout, UnitInfo
from .torch_internals import below_functorch, unwrapped


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


class _BlockCall:
    """What a block's forward and backward need besides tensors: the function, the unit, the
    replayable dropout generator, the sink, the prefetcher."""

    def __init__(self, ops: "UnitOps", fn: BlockFn, unit: UnitInfo, index: int, rng: Optional[torch.Generator],
                 prefetch: "_Prefetcher"):
        self.ops, self.fn, self.unit, self.index, self.prefetch = ops, fn, unit, index, prefetch
        self.rng_state = rng.get_state() if rng is not None else None
        self.rng_device = rng.device if rng is not None else None
        self.vjp = self.full = None
        self.nbytes = 0

    def generator(self) -> Optional[torch.Generator]:
        if self.rng_state is None:
            return None
        g = torch.Generator(device=self.rng_device)
        g.set_state(self.rng_state)
        return g

    def run(self, full: Optional[torch.Tensor], x: torch.Tensor, *resident: torch.Tensor) -> torch.Tensor:
        resident = [self.ops.to_device(t) for t in resident]
        tree = tree_unflatten(self.unit.tree, _assemble(self.unit, full, resident))
        return self.fn(tree, x, self.generator())

    def deliver(self, grad_full: Optional[torch.Tensor], grad_resident: Sequence[Optional[torch.Tensor]]) -> None:
        sink = self.ops.sink
        if self.unit.sharded:
            sink.deliver_shard(self.unit.index, grad_full)
        sink.deliver(self.unit.index, list(grad_resident))


class _GatheredUnit(torch.autograd.Function):
    """A block whose sharded weights exist gathered only while it computes.

    Forward gathers the shard and records the block's graph (`torch.func.vjp`), then frees the
    gathered storage: the graph keeps views of it, which hold no memory while it is empty.
    Backward gathers again into that same storage (no version bump: the bits are what the graph
    saw), runs the recorded vjp and delivers the unit's gradients. With recompute, forward keeps
    only the block input and backward recomputes the block (activation checkpointing).
    """

    @staticmethod
    def forward(x, anchor, shard, call: _BlockCall, recompute: bool, *resident):
        full = call.prefetch.take(call.index, shard)
        call.prefetch.start(call.index + 1)
        if recompute:
            with torch.no_grad():
                return call.run(full, x, *resident)
        with torch.enable_grad():
            out, call.vjp = torch.func.vjp(call.run, full, x, *resident)
        call.full, call.nbytes = full, full.untyped_storage().nbytes()
        full.untyped_storage().resize_(0)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, shard, call, recompute, *resident = inputs
        ctx.save_for_backward(x, shard, *resident)
        ctx.call, ctx.recompute = call, recompute

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        x, shard, *resident = ctx.saved_tensors
        full = call.prefetch.take(call.index, shard)
        call.prefetch.start(call.index - 1)
        if ctx.recompute:
            with torch.enable_grad():
                _, vjp = torch.func.vjp(call.run, full, x, *resident)
                grads = vjp(grad_out)
        else:
            storage = call.full.untyped_storage()
            storage.resize_(call.nbytes)
            # a plain memory copy that the graph's saved views (of this very storage) see neither as
            # a mutation nor as a version bump
            with below_functorch():
                call.full.data.copy_(unwrapped(full))
            del full
            grads = call.vjp(grad_out)
            storage.resize_(0)
            call.vjp = call.full = None
        grad_full, grad_x, *grad_resident = grads
        call.deliver(unwrapped(grad_full), [unwrapped(g) for g in grad_resident])
        return (grad_x, torch.zeros(()), None, None, None) + (None,) * len(resident)


class _RecomputedUnit(torch.autograd.Function):
    """A block of whole parameters that keeps only its input and recomputes in backward."""

    @staticmethod
    def forward(x, anchor, call: _BlockCall, *resident):
        with torch.no_grad():
            return call.run(None, x, *resident)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, call, *resident = inputs
        ctx.save_for_backward(x, *resident)
        ctx.call = call

    @staticmethod
    def backward(ctx, grad_out):
        x, *resident = ctx.saved_tensors
        with torch.enable_grad():
            _, vjp = torch.func.vjp(lambda x_, *r: ctx.call.run(None, x_, *r), x, *resident)
            grad_x, *grad_resident = vjp(grad_out)
        ctx.call.deliver(None, [unwrapped(g) for g in grad_resident])
        return (grad_x, torch.zeros(()), None) + (None,) * len(resident)


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
        return (torch.zeros(()), None, None, None) + (None,) * ctx.count


class _Prefetcher:
    """All-gathers of block shards started ahead of their use (one block ahead in each direction)."""

    def __init__(self, ops: "UnitOps", blocks: Sequence[Any], enabled: bool):
        self.ops, self.blocks, self.enabled = ops, blocks, enabled
        self.pending: dict[int, Any] = {}

    def start(self, i: int) -> None:
        if self.enabled and 0 <= i < len(self.blocks) and i not in self.pending \
                and isinstance(self.blocks[i], UnitParams) and self.blocks[i].shard is not None:
            self.pending[i] = self.ops.data.start_gather(self.ops.to_device(self.blocks[i].shard))

    def take(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        handle = self.pending.pop(i, None)
        return handle.wait() if handle is not None else self.ops.data.gathered(self.ops.to_device(shard))


class UnitOps(DenseOps):
    """Dense model ops whose `param` and `scan` take `UnitParams` (module docstring). Bound to
    one micro-batch: the anchor it differentiates, and the sink its gradients go to; without a
    sink (evaluation) units are only gathered."""

    def __init__(self, layout: Layout, data: AxisComm, sink: Optional[GradSink], anchor: Optional[torch.Tensor],
                 device: torch.device, dtype: torch.dtype, to_device: Callable[[torch.Tensor], torch.Tensor]):
        self.layout, self.data, self.sink, self.anchor = layout, data, sink, anchor
        self.device, self.dtype, self.to_device = device, dtype, to_device
        self.recompute = layout.zero.recompute_blocks
        self.prefetch = layout.zero.prefetch
        self._taken: dict[int, list[torch.Tensor]] = {}

    def take(self, p: UnitParams) -> list[torch.Tensor]:
        """The unit's tensors in `unit.params` order, ready to compute with (once per micro-batch)."""
        unit = p.unit
        if unit.index not in self._taken:
            if self.sink is None:
                full = self.data.gathered(self.to_device(p.shard)) if p.shard is not None else None
                tensors = _assemble(unit, full, [self.to_device(t) for t in p.resident])
            elif p.shard is not None:
                tensors = list(_GatheredParams.apply(self.anchor, p.shard, self, unit, *p.resident))
            else:
                tensors = [self.to_device(t) for t in deliver_on_backward(self.anchor, self.sink, unit.index, p.resident)]
            self._taken[unit.index] = tensors
        return self._taken[unit.index]

    def param(self, p: Any) -> Any:
        if not isinstance(p, UnitParams):
            return p
        if p.unit.tree is None:
            raise TypeError(f"unit {p.unit.name!r} is not a subtree of the parameters; it cannot be taken whole")
        return tree_unflatten(p.unit.tree, self.take(p))

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor,
             rng: Optional[torch.Generator] = None) -> torch.Tensor:
        prefetch = _Prefetcher(self, blocks, self.prefetch)
        for i, block in enumerate(blocks):
            if not isinstance(block, UnitParams):
                x = fn(block, x, rng)
            elif self.sink is None:
                x = fn(self.param(block), x, rng)
                self._taken.pop(block.unit.index, None)  # evaluation keeps no gathered layer
            elif block.shard is not None:
                call = _BlockCall(self, fn, block.unit, i, rng, prefetch)
                x = _GatheredUnit.apply(x, self.anchor, block.shard, call, self.recompute, *block.resident)
            elif self.recompute:
                call = _BlockCall(self, fn, block.unit, i, rng, prefetch)
                x = _RecomputedUnit.apply(x, self.anchor, call, *block.resident)
            else:
                x = fn(self.param(block), x, rng)
        return x


def unit_params(layout: Layout, params_flat) -> list[UnitParams]:
    """Every unit's `UnitParams` over the rank's compute buffer (views, no copies)."""
    views = dict(params_flat.items())
    out = []
    for unit in layout.units:
        shard = views[f"{unit.name}.shard"].view(-1) if unit.sharded else None
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


__all__ = ["UnitOps", "UnitParams", "eager_params", "model_view", "replace_units", "unit_params"]
