"""Activation checkpointing (remat): a block keeps only what its policy saves; backward recomputes the rest.

    model = fs.remat(model, policy=fs.remat_policies.save_matmuls, every=2)   # any Model
    model = fs.functionalize(hf_model, loss_fn, remat="transformer.h.*")       # by submodule path

One mechanism for every model and plan: a unit's call (`ops.call`, `ops.scan`'s blocks) runs
under `checkpointed`, which is `torch.utils.checkpoint` (non-reentrant; the step differentiates
with plain autograd) with torch's selective-checkpoint contexts for the policies, as JAX's
`checkpoint_policies`:

- `full`: save only the block's inputs (and parameters); recompute everything;
- `save_matmuls`: also save the outputs of matmuls (mm, addmm, bmm, linear, attention), so the
  recompute redoes only the cheap elementwise ops;
- `save_named(*names)`: save the tensors tagged `fs.checkpoint_name(x, "name")`.

`every=k` checkpoints every k-th block (DeepSpeed's interval), the others keep their activations.
`offload=True` (DeepSpeed's `cpu_checkpointing`) keeps the saved block inputs in host memory
(pinned where CUDA exists). Randomness replays: torch's generators by `preserve_rng_state`, an
explicit `torch.Generator` argument (the reference GPT's dropout) by its saved state. Under ZeRO-3
the recompute runs inside the unit's gather (`fspeed.parallel.ops`), so its weights are gathered
again for it and freed after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import fnmatch
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .models.model import Model
from .models.ops import DENSE, BlockFn

aten = torch.ops.aten
MATMUL_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
})


@torch.library.custom_op("fspeed::checkpoint_name", mutates_args=())
def _name_op(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_name_op.register_fake
def _(x, name):
    return torch.empty_like(x)


_name_op.register_autograd(lambda ctx, grad: (grad, None))


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x`, tagged `name` for `remat_policies.save_named(name)` (JAX's `checkpoint_name`); outside
    a remat block it is only a copy."""
    return _name_op(x, name)


@dataclass(frozen=True)
class RematPolicy:
    """Which tensors a checkpointed block saves: `full` none but its inputs, else the outputs of
    `saved_ops`, or of the `checkpoint_name` tags in `names`."""

    name: str
    saved_ops: frozenset = frozenset()
    names: tuple[str, ...] = ()

    def context_fn(self) -> Optional[Callable]:
        if not self.saved_ops and not self.names:
            return None
        saved, names = self.saved_ops, set(self.names)

        def policy(ctx, op, *args, **kwargs):
            if op in saved or (op is torch.ops.fspeed.checkpoint_name.default and args[1] in names):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return lambda: create_selective_checkpoint_contexts(policy)

    def __repr__(self) -> str:
        return f"remat_policies.{self.name}" + (f"{self.names}" if self.names else "")


def save_named(*names: str) -> RematPolicy:
    """Save the tensors tagged with `checkpoint_name(x, name)` for one of `names`; recompute the rest."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"save_named needs one or more non-empty tag names, got {names!r}")
    return RematPolicy("save_named", names=tuple(names))


remat_policies = SimpleNamespace(
    full=RematPolicy("full"),
    save_matmuls=RematPolicy("save_matmuls", MATMUL_OPS),
    save_named=save_named,
)
POLICIES = {"full": remat_policies.full, "save_matmuls": remat_policies.save_matmuls}


@dataclass(frozen=True)
class Remat:
    """How checkpointed blocks run: the policy, every k-th block, saved inputs on the host."""

    policy: RematPolicy = remat_policies.full
    every: int = 1
    offload: bool = False

    def __post_init__(self):
        if isinstance(self.policy, str):
            if self.policy not in POLICIES:
                raise ValueError(f"remat policy {self.policy!r} is not one of {sorted(POLICIES)} (or save_named(...))")
            object.__setattr__(self, "policy", POLICIES[self.policy])
        if not isinstance(self.policy, RematPolicy):
            raise TypeError(f"remat policy must be a RematPolicy (fs.remat_policies.*) or its name, got {self.policy!r}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"remat every={self.every!r}: checkpoint every k-th block needs an integer k >= 1")

    def chosen(self, index: int) -> bool:
        """Whether the block at `index` (0-based, in forward order) is checkpointed."""
        return index % self.every == 0


def checkpointed(remat: Remat, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` keeping only what `remat.policy` saves (module docstring). Every
    tensor `fn` computes with must come in through its arguments: a recompute in backward sees
    nothing else of the forward's context."""
    states = {i: a.get_state() for i, a in enumerate(args) if isinstance(a, torch.Generator)}
    runs = [0]

    def replayed(*a, **kw):
        if runs[0] and states:  # the recompute: fresh generators in the state of the first run
            a = list(a)
            for i, state in states.items():
                g = torch.Generator(device=a[i].device)
                g.set_state(state)
                a[i] = g
        runs[0] += 1
        return fn(*a, **kw)

    context_fn = remat.policy.context_fn()
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if remat.offload \
        else contextlib.nullcontext()
    with offload:
        return checkpoint(replayed, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


class RematOps:
    """Ops whose `scan` checkpoints every `remat.every`-th block; everything else goes to `inner`."""

    def __init__(self, inner: Any, remat: Remat):
        self.inner, self.remat = inner, remat

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def scan(self, fn: BlockFn, blocks: Sequence[Any], x: torch.Tensor,
             rng: Optional[torch.Generator] = None) -> torch.Tensor:
        for i, block in enumerate(blocks):
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            hint = getattr(getattr(after, "unit", None), "index", None)
            x = self.inner.call(block, fn, x, rng, _hint=hint, _remat=self.remat if self.remat.chosen(i) else None)
        return x


def remat(model: Model, policy: Any = "full", every: int = 1, *, offload: bool = False,
          where: Optional[Sequence[str]] = None) -> Model:
    """`model` whose blocks are activation-checkpointed (module docstring).

    A `functionalize`d module checkpoints its repeated blocks (or the submodules matching the
    `where` path patterns); any other model checkpoints the blocks it runs through `ops.scan`.
    """
    config = Remat(policy, every, offload)
    module_loss = getattr(model.loss, "with_remat", None)
    if module_loss is not None:
        loss = model.loss.with_remat(config, where)
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


def matching(paths: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The paths matching any of the fnmatch `patterns`, in order."""
    return [p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]


__all__ = ["Remat", "RematOps", "RematPolicy", "checkpoint_name", "checkpointed", "remat", "remat_policies"]
