"""Activation checkpointing (remat): a block keeps only what its policy saves; backward recomputes the rest.

    model = fs.remat(model, policy=fs.remat_policies.save_matmuls, every=2)   # any Model
    model = fs.remat(fs.functionalize(hf_model, loss_fn), where=["transformer.h.*"])  # by submodule path

One mechanism for every model and plan: a unit's call (`ops.call`, `ops.scan`'s blocks) runs
under `checkpointed`, which is `torch.utils.checkpoint` (non-reentrant; the step differentiates
with plain autograd) with torch's selective-checkpoint contexts for the policies, as JAX's
`checkpoint_policies`:

- `full`: save only the block's inputs (and parameters); recompute everything;
- `save_matmuls`: also save the outputs of matmuls (mm, addmm, bmm, linear, attention), so the
  recompute redoes only the cheap elementwise ops;
- `save_named(*names)`: save the tensors tagged `fs.remat_name(x, "name")`.

`every=k` checkpoints every k-th block (DeepSpeed's interval), the others keep their activations.
`offload=True` (DeepSpeed's `cpu_checkpointing`) keeps the saved block inputs in host memory
(`fspeed.host_copies`: pinned, copied on a side stream and back one block ahead, on CUDA).
Randomness replays: torch's generators by `preserve_rng_state`, an explicit `torch.Generator`
argument (the reference GPT's dropout) by its saved state. Under ZeRO-3 the recompute runs inside
the unit's gather (`fspeed.parallel.ops`), so its weights are gathered again for it and freed after.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import torch

from .models.model import Model
from .models.ops import DENSE, BlockFn, BlockRngs, block_generators
from .remat_blocks import (
    ContiguousArena, Remat, RematPolicy, RematProfile, checkpointed, remat_name, remat_policies,
)


class RematOps:
    """Ops whose `scan` checkpoints every `remat.every`-th block; everything else goes to `inner`."""

    def __init__(self, inner: Any, remat: Remat):
        self.inner, self.remat = inner, remat

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def head_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The fused head and loss; with `partition`, a vocab-sliced head keeps 1/t of the gradient it
        holds for backward, as the checkpointed block inputs do."""
        if self.remat.partition and self._sliced(kwargs.get("vocab_axis")):
            kwargs["partition"] = True
        return self.inner.head_loss(*args, **kwargs)

    def _sliced(self, axis: Any) -> bool:
        return axis is not None and axis in getattr(self.inner, "tensor_axes", ())

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor, rng: BlockRngs = None, *,
             first: int = 0, after: Any = None) -> torch.Tensor:
        for i, (block, rng_i) in enumerate(zip(blocks, block_generators(rng, len(blocks)))):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else after
            hint = getattr(getattr(nxt, "unit", None), "index", None)
            index = first + i  # the block's index in the model
            remat = self.remat if self.remat.chosen(index) else None
            x = self.inner.call(block, fn, x, rng_i, _hint=hint, _remat=remat, _label=f"blocks.{index}")
        return x


def remat(model: Model, policy: Any = "full", every: int = 1, *, offload: bool = False, partition: bool = False,
          profile: Optional[RematProfile] = None, contiguous: bool = False,
          where: Optional[Sequence[str]] = None, synchronize: bool = False) -> Model:
    """`model` whose blocks are activation-checkpointed (module docstring).

    A `functionalize`d module checkpoints its repeated blocks (or the submodules matching the
    `where` path patterns); any other model checkpoints the blocks it runs through `ops.scan`.
    """
    config = Remat(policy, every, offload, partition, profile, ContiguousArena() if contiguous else None, synchronize)
    return apply_remat(model, config, where)


def apply_remat(model: Model, config: Remat, where: Optional[Sequence[str]] = None) -> Model:
    """`remat` with its settings as one `Remat` (what a run's config builds)."""
    with_remat = getattr(model.loss, "with_remat", None)  # a functionalize()d module's loss
    if with_remat is not None:
        loss = with_remat(config, where)
        return dataclasses.replace(model, loss=loss, apply=loss.apply)
    if where is not None:
        raise ValueError(f"remat(where={where!r}): path patterns apply to functionalize()d modules; "
                         f"{model.name} checkpoints the blocks it runs through ops.scan")

    def wrapped(fn):
        @functools.wraps(fn)  # its signature: the step passes only the keywords `fn` takes
        def call(params, *args, ops=DENSE, **kwargs):
            return fn(params, *args, ops=RematOps(ops, config), **kwargs)
        return call
    return dataclasses.replace(model, loss=wrapped(model.loss), apply=wrapped(model.apply))


__all__ = ["ContiguousArena", "Remat", "RematOps", "RematPolicy", "RematProfile", "apply_remat", "remat_name",
           "checkpointed", "remat", "remat_policies"]
