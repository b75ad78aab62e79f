"""The optimizer protocol, Optax's shape: a NamedTuple of pure functions, state as a pytree.

    opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine(3e-4, 1000)))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)     # pure: inputs untouched
    params = apply_updates(params, updates)

`update` is the reference: pure and composable. `apply` is the same step fused for speed: it
writes `params` and the state's buffers in place, in a single pass over memory where the
optimizer has a fused kernel. It *donates* its arguments (grads, state, params): their buffers
are reused by the results. `train_step` uses `apply`; tests check it equals `update` followed by
`apply_updates`. Hyperparameters may be floats or schedules (functions of the step count).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..flat import Flat, segments
from ..pytree import PyTree, tree_leaves, tree_map
from .schedules import Schedule

Params = PyTree
Updates = PyTree
OptState = Any
ScalarOrSchedule = Union[float, Schedule]


class TransformInfo(NamedTuple):
    """What a transform is, for printing and for `train_step`'s fusions."""

    name: str
    hparams: dict
    children: tuple = ()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_show(v)}" for k, v in self.hparams.items())
        inner = ", ".join(repr(c.info) for c in self.children)
        return f"{self.name}({inner}{', ' if inner and args else ''}{args})"


def _show(value: Any) -> str:
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__).split(".<locals>")[0]
    return repr(value)


class GradientTransformation(NamedTuple):
    """`init(params) -> state`; `update(updates, state, params) -> (updates, state)`;
    optional fused `apply(grads, state, params) -> (params, state)` (donates its arguments)."""

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    apply: Optional[Callable[..., tuple[Params, OptState]]] = None
    info: Optional[TransformInfo] = None

    def __repr__(self) -> str:
        return repr(self.info) if self.info is not None else "GradientTransformation(...)"


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def resolve(value: ScalarOrSchedule, count: int) -> float:
    """The value of a hyperparameter at update number `count` (a float or a schedule's value)."""
    return float(value(count)) if callable(value) else float(value)


def apply_updates(params: Params, updates: Updates) -> Params:
    """params + updates, leaf-wise (pure)."""
    return tree_map(lambda p, u: p + u.to(p.dtype), params, updates)


def _apply_updates_in_place(params: Params, updates: Updates) -> Params:
    tree_map(lambda p, u: p.add_(u.to(p.dtype)), params, updates)
    return params


def optimizer_step(
    opt: GradientTransformation, grads: Updates, state: OptState, params: Params
) -> tuple[Params, OptState]:
    """One optimizer step that may update `params` and `state` in place (donates all arguments)."""
    if opt.apply is not None:
        return opt.apply(grads, state, params)
    updates, state = opt.update(grads, state, params)
    return _apply_updates_in_place(params, updates), state


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms in sequence; the state is the tuple of their states."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain() argument {i} is {type(t).__name__}, not a GradientTransformation")

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        _check_state(state, len(transforms))
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def apply(grads, state, params):
        _check_state(state, len(transforms))
        if not transforms:
            return params, state
        new_state = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        params, s = optimizer_step(transforms[-1], grads, state[-1], params)
        new_state.append(s)
        return params, tuple(new_state)

    return GradientTransformation(init, update, apply, TransformInfo("chain", {}, tuple(transforms)))


def _check_state(state: Any, n: int) -> None:
    # A NamedTuple is one transform's state (e.g. AdamState), never a chain's tuple of states.
    is_chain_state = isinstance(state, tuple) and not hasattr(state, "_fields")
    if not is_chain_state or len(state) != n:
        got = f"a tuple of {len(state)} states" if is_chain_state else type(state).__name__
        raise ValueError(
            f"chain of {n} transforms got {got} as its state, expected a tuple of {n} states; "
            "pass the state returned by this optimizer's init/update"
        )


def global_norm(tree: PyTree) -> torch.Tensor:
    """L2 norm over every element of every tensor in `tree`, accumulated in fp32 (a 0-d tensor).

    A Flat is one reduction over its buffer.
    """
    norms = []
    for leaf in _norm_leaves(tree):
        norms.append(torch.linalg.vector_norm(leaf, dtype=torch.float32))
    if not norms:
        return torch.zeros(())
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


def _norm_leaves(tree: PyTree) -> list[torch.Tensor]:
    leaves = tree_leaves(tree, is_leaf=lambda x: isinstance(x, Flat))
    return [x.buffer if isinstance(x, Flat) else x for x in leaves if isinstance(x, (Flat, torch.Tensor))]


def per_tensor_norms(tree: PyTree) -> torch.Tensor:
    """The fp32 L2 norm of each parameter tensor (a Flat contributes one norm per parameter)."""
    segs = segments(tree)
    if not segs:
        return torch.zeros(0)
    norms = torch._foreach_norm([s if s.dtype == torch.float32 else s.float() for s in segs])
    return torch.stack(norms)


def learning_rate(opt_state: OptState) -> Optional[float]:
    """The lr the next update will use: the `lr` field of the first state in `opt_state` that has one."""
    for node in tree_leaves(opt_state, is_leaf=lambda x: hasattr(x, "_fields") and "lr" in x._fields):
        if hasattr(node, "_fields") and "lr" in node._fields:
            return float(node.lr)
    return None
