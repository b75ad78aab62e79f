"""`ShardedOps`: the model ops under a plan: tensor slicing over `model`, ZeRO-3 gathering over `data`.

Tensor slicing (Megatron): a linear whose output axis is sharded is column-parallel (its input
goes through `copy_to_group`: identity forward, all-reduce of the gradient); one whose input axis
is sharded is row-parallel (partial outputs summed by `reduce_in_group`, bias added after). The
vocabulary-parallel embedding masks ids outside the local slice and sums over the group; the
vocabulary-parallel cross-entropy combines per-rank max, sum of exponentials and target logit,
so full logits never exist on one rank.

ZeRO-3: `param` gathers a sharded unit with `gather_shards` (all-gather forward, reduce-scatter
backward). `scan` runs each sharded block unit through `_GatheredUnit`: forward gathers the unit,
records the block's graph and frees the gathered weights (the graph keeps empty views of them);
backward gathers them again into the same storage, runs the recorded backward and
reduce-scatters the weight gradient to the shard. Nothing is recomputed, as in DeepSpeed
(`zero.recompute_blocks=true` trades a third more compute for keeping only each block's input).
While one unit computes, the next one's all-gather is already in flight (forward: next block;
backward: previous block).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .comm import AxisComm, copy_to_group, gather_shards, reduce_in_group, unwrapped
from .models.ops import BlockFn, DenseOps, flat_linear
from .plan import Layout, ShardedUnit


class _AllReduceMax(torch.autograd.Function):
    """Max over the group, not differentiated (the stabilizing max of the vocab-parallel softmax)."""

    @staticmethod
    def forward(x, comm):
        return funcol.all_reduce(x.contiguous(), "max", comm.group).wait()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None


class ShardedOps(DenseOps):
    """Ops under a resolved layout, on a mesh (see module docstring)."""

    def __init__(self, layout: Layout, mesh, tensor_axes: Sequence[str] = ()):
        self.layout = layout
        self.model: AxisComm = mesh.comm("model")
        self.data: AxisComm = mesh.comm("data")
        self.tensor_axes = frozenset(tensor_axes) if self.model.size > 1 else frozenset()
        self.recompute = layout.zero.recompute_blocks

    # -- ZeRO-3 -------------------------------------------------------------------------

    def param(self, p: Any) -> Any:
        if isinstance(p, ShardedUnit):
            full = gather_shards(p.shard, self.data)
            return p.unit.layout.unflatten(full)
        return p

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor,
             rng: Optional[torch.Generator] = None) -> torch.Tensor:
        if not any(isinstance(b, ShardedUnit) for b in blocks):
            return super().scan(fn, blocks, x, rng)
        prefetch = _Prefetcher(blocks, self.data, self.layout.zero.prefetch)
        for i, block in enumerate(blocks):
            if isinstance(block, ShardedUnit):
                call = _UnitCall(fn, block.unit, self.data, prefetch, i, rng, self.recompute)
                x = _GatheredUnit.apply(x, block.shard, call)
            else:
                x = fn(block, x, rng)
        return x

    # -- tensor slicing -----------------------------------------------------------------

    def local(self, size: int, axis: str) -> int:
        return size // self.model.size if axis in self.tensor_axes else size

    def linear(self, x, w, b=None, *, out_axis=None, in_axis=None):
        if out_axis in self.tensor_axes:  # column-parallel
            return flat_linear(copy_to_group(x, self.model), w, b)
        if in_axis in self.tensor_axes:  # row-parallel
            y = reduce_in_group(flat_linear(x, w), self.model)
            return y if b is None else y + b
        return flat_linear(x, w, b)

    def embedding(self, ids, w, *, vocab_axis=None):
        if vocab_axis not in self.tensor_axes:
            return F.embedding(ids, w)
        rows = w.shape[0]
        lo = self.model.rank * rows
        inside = (ids >= lo) & (ids < lo + rows)
        local = F.embedding((ids - lo).clamp(0, rows - 1), w) * inside.unsqueeze(-1).to(w.dtype)
        return reduce_in_group(local, self.model)

    def cross_entropy(self, logits, targets, *, vocab_axis=None):
        if vocab_axis not in self.tensor_axes:
            return super().cross_entropy(logits, targets)
        logits = logits.float()
        rows = logits.shape[-1]
        lo = self.model.rank * rows
        peak = logits.detach().amax(-1)
        peak = _AllReduceMax.apply(peak, self.model) if self.model.size > 1 else peak
        shifted = logits - peak.unsqueeze(-1)
        sum_exp = reduce_in_group(shifted.exp().sum(-1), self.model)
        inside = (targets >= lo) & (targets < lo + rows)
        picked = shifted.gather(-1, (targets - lo).clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = reduce_in_group(picked * inside.to(picked.dtype), self.model)
        return (sum_exp.log() - target_logit).mean()


# --------------------------------------------------------------------- ZeRO-3 block calls


class _Prefetcher:
    """All-gathers of block units started ahead of their use (one unit ahead in each direction)."""

    def __init__(self, blocks: Sequence[Any], comm: AxisComm, enabled: bool):
        self.blocks, self.comm, self.enabled = blocks, comm, enabled
        self.pending: dict[int, Any] = {}

    def start(self, i: int) -> None:
        if self.enabled and 0 <= i < len(self.blocks) and i not in self.pending \
                and isinstance(self.blocks[i], ShardedUnit):
            self.pending[i] = self.comm.start_gather(self.blocks[i].shard)

    def take(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        handle = self.pending.pop(i, None)
        return handle.wait() if handle is not None else self.comm.gathered(shard)


class _UnitCall:
    """Everything a block unit's forward and backward need, besides the tensors."""

    def __init__(self, fn: BlockFn, unit, comm: AxisComm, prefetch: _Prefetcher, index: int,
                 rng: Optional[torch.Generator], recompute: bool):
        self.fn, self.unit, self.comm, self.prefetch, self.index = fn, unit, comm, prefetch, index
        self.recompute = recompute
        self.vjp = self.full = None
        self.nbytes = 0
        self.rng_state = rng.get_state() if rng is not None else None
        self.rng_device = rng.device if rng is not None else None

    def generator(self) -> Optional[torch.Generator]:
        if self.rng_state is None:
            return None
        g = torch.Generator(device=self.rng_device)
        g.set_state(self.rng_state)
        return g

    def run(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.unit.layout.unflatten(full), x, self.generator())


class _GatheredUnit(torch.autograd.Function):
    """A block unit whose weights exist gathered only while it computes (forward, then backward).

    Forward gathers the unit and records the block's graph (`torch.func.vjp`), then frees the
    gathered storage: the graph keeps views of it, which hold no memory while it is empty.
    Backward gathers again into that same storage (no version bump: the bits are what the graph
    saw) and runs the recorded vjp, so no activations are recomputed. With `recompute=True` the
    forward keeps nothing but the block input and backward recomputes the block (activation
    checkpointing: less memory, a third more compute).
    """

    @staticmethod
    def forward(x, shard, call: _UnitCall):
        full = call.prefetch.take(call.index, shard)
        call.prefetch.start(call.index + 1)
        if call.recompute:
            with torch.no_grad():
                return call.run(full, x)
        with torch.enable_grad():
            out, call.vjp = torch.func.vjp(call.run, full, x)
        call.full, call.nbytes = full, full.untyped_storage().nbytes()
        full.untyped_storage().resize_(0)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, shard, call = inputs
        ctx.save_for_backward(x, shard) if call.recompute else ctx.save_for_backward(shard)
        ctx.call = call

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        shard = ctx.saved_tensors[-1]
        full = call.prefetch.take(call.index, shard)
        call.prefetch.start(call.index - 1)
        if call.recompute:
            with torch.enable_grad():
                _, vjp = torch.func.vjp(call.run, full, ctx.saved_tensors[0])
                grad_full, grad_x = vjp(grad_out)
        else:
            storage = call.full.untyped_storage()
            storage.resize_(call.nbytes)
            # Below torch.func and through .data: a plain memory copy that the graph's saved views
            # (of this very storage) neither see as a mutation nor as a version bump.
            with torch._C._DisableFuncTorch(), torch.no_grad():
                call.full.data.copy_(unwrapped(full))
            del full
            grad_full, grad_x = call.vjp(grad_out)
            storage.resize_(0)
            call.vjp = call.full = None
        return grad_x, call.comm.reduce_scattered(grad_full), None
