"""The ops a parallel-aware model calls, and their single-device behaviour.

A model names, at each use, the logical axes of what it touches (`out_axis="mlp"`); it never
imports the parallel transforms. `DenseOps` is plain PyTorch. Under a plan, `train_step` passes
an object with the same methods (`fspeed.parallel.ops.UnitOps`, wrapped by each transform) that
slices weights over the `model` axis (Megatron's column/row parallel layers, vocab-parallel
embedding and loss), gathers ZeRO-3 shards just in time and delivers each unit's gradients as
its backward ends. A loss function that accepts an `ops=` keyword is parallel-aware.

Weights are `[out, in]` (`nn.Linear`'s layout); a weight with more dims is `[*out, in]` and is
flattened for the matmul (the fused QKV weight `[3, heads, embed]`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..remat_blocks import checkpointed
from ..torch_internals import func_transforms_active
from .head_loss import head_loss, loss_dtype

BlockFn = Callable[[Any, torch.Tensor, Optional[torch.Generator]], torch.Tensor]
BlockRngs = Optional[torch.Generator | Sequence[Optional[torch.Generator]]]  # one for all blocks, or one each


def block_generators(rng: BlockRngs, count: int) -> list[Optional[torch.Generator]]:
    """The generator each of `count` blocks draws from: `rng` for all, or `rng[i]` for block i."""
    if rng is None or isinstance(rng, torch.Generator):
        return [rng] * count
    rngs = list(rng)
    if len(rngs) != count:
        raise ValueError(f"scan got {len(rngs)} generators for {count} blocks; pass one, or one per block")
    return rngs


def flat_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
                linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """`linear` (`F.linear`, or a variant with its signature) for a weight `[*out, in]` and a bias `[*out]`."""
    if w.dim() > 2:
        w = w.flatten(0, -2)
    if b is not None and b.dim() > 1:
        b = b.flatten()
    return linear(x, w, b)


class DenseOps:
    """Single-device ops: the reference semantics of every parallel implementation."""

    tensor_axes: frozenset = frozenset()  # the logical axes these ops slice (none: nothing is sliced)

    def param(self, p: Any) -> Any:
        """A parameter (or a subtree of them) ready to use."""
        return p

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
               out_axis: Optional[str] = None, in_axis: Optional[str] = None) -> torch.Tensor:
        return flat_linear(x, w, b)

    def embedding(self, ids: torch.Tensor, w: torch.Tensor, *, vocab_axis: Optional[str] = None,
                  padding_idx: Optional[int] = None) -> torch.Tensor:
        return F.embedding(ids, w, padding_idx)

    def gather(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """`x` whole along its last dim (sliced over `axis` under tensor slicing)."""
        return x

    def split(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """This rank's slice of a whole `x` along its last dim (sliced over `axis` under tensor slicing)."""
        return x

    def sum_grads(self, x: torch.Tensor, *, axis: Optional[str] = None) -> torch.Tensor:
        """`x`, whose gradient is summed over the ranks that slice `axis` (a replicated parameter used on
        each rank's own slice, e.g. a norm over each rank's heads)."""
        return x

    def local(self, size: int, axis: str) -> int:
        """How many of `size` items along logical `axis` this rank holds (e.g. attention heads)."""
        return size

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, *,
                      vocab_axis: Optional[str] = None) -> torch.Tensor:
        """Mean cross-entropy over all positions, computed in fp32 (fp64 for fp64 logits)."""
        return F.cross_entropy(logits.to(loss_dtype(logits.dtype)).flatten(0, -2), targets.flatten())

    def head_loss(self, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, *,
                  norm: Callable[..., torch.Tensor] = lambda x: x, norm_params: Sequence[torch.Tensor] = (),
                  vocab_axis: Optional[str] = None, in_axis: Optional[str] = None) -> torch.Tensor:
        """`cross_entropy(linear(norm(x, *norm_params), w), targets)` as one op whose gradient is taken
        in forward, chunk by chunk: the logits are never kept for backward (`fspeed.models.head_loss`)."""
        return head_loss(x, w, targets, norm=norm, norm_params=norm_params)

    def call(self, p: Any, fn: Callable[..., Any], *args: Any, _remat: Any = None, _hint: Optional[int] = None,
             _label: str = "block", **kwargs: Any) -> Any:
        """`fn(params, *args, **kwargs)` with one unit's parameters (the unit of ZeRO-3 gathering,
        recompute and gradient delivery under a plan); `_remat` (`fspeed.remat_blocks.Remat`) checkpoints
        the call when autograd records it, outside `torch.func`'s transforms (they refuse the saved-tensor
        hooks of `torch.utils.checkpoint`: under them the call runs whole, as without remat)."""
        if _remat is not None and torch.is_grad_enabled() and not func_transforms_active():
            return checkpointed(_remat, fn, self.param(p), *args, label=_label, **kwargs)
        return fn(self.param(p), *args, **kwargs)

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor, rng: BlockRngs = None, *,
             first: int = 0, after: Any = None) -> torch.Tensor:
        """x = fn(blocks[i], x, rng_i) for each block in order (the unit of ZeRO-3 gathering); rng_i is
        `rng`, or `rng[i]` when `rng` is a sequence (`block_generators`). `first`: the index of
        `blocks[0]` among the model's blocks, when a model scans them in several calls (what remat's
        `every` counts and its labels name); `after`: then the block that runs next (ZeRO-3
        prefetches it while the last of these runs)."""
        for block, rng_i in zip(blocks, block_generators(rng, len(blocks))):
            x = fn(block, x, rng_i)
        return x


DENSE = DenseOps()
