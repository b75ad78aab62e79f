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

Mixed precision: `apply(grads, state, params, *, cast_to=None)` also writes the updated params,
cast, into `cast_to` (the bf16/fp16 compute copy, same structure as params). A fused kernel does
it in the same pass over memory; otherwise it is one cast after the update. Either way the bits
are exactly `params.to(dtype)`.

Optimizers that communicate themselves (the 1-bit family, DeepSpeed's `enable_backward_allreduce`
protocol): such a transform sets `gradient_allreduce(state) -> bool`. Before each step the runtime
asks it, with the optimizer state the step will start from, whether this step's gradient must be
all-reduced in full precision over the data axis first (True: warmup, 0/1 Adam's variance steps),
or whether `apply` gets this rank's local gradient (False). Either way the gradient reaching
`apply` is in mean units: the local one is this rank's own mean gradient (not divided by the
data size), and `apply(..., comm=)` receives the data axis' `AxisComm` (None in one process) to
do its compressed all-reduce. Ordinary transforms leave it None: always all-reduced, no `comm`.
In a `chain`, only the last transform may set it.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..flat import Flat, segments
from ..pytree import PyTree, tensor_leaves, tree_leaves, tree_map
from .schedules import Schedule

Params = PyTree
Updates = PyTree
OptState = Any
ScalarOrSchedule = Union[float, Schedule]


class TransformInfo(NamedTuple):
    """What a transform is, for printing and for `train_step`'s fusions.

    `factory(**hparams)` rebuilds the transform (None: it cannot be rebuilt); parameter groups
    use it to make the same optimizer with other hyperparameters (`fspeed.optim.groups`).
    """

    name: str
    hparams: dict
    children: tuple = ()
    factory: Optional[Callable[..., "GradientTransformation"]] = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_show(v)}" for k, v in self.hparams.items())
        inner = ", ".join(repr(c.info) for c in self.children)
        return f"{self.name}({inner}{', ' if inner and args else ''}{args})"


def _show(value: Any) -> str:
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__).split(".<locals>")[0]
    return repr(value)


class Capabilities(NamedTuple):
    """What a transform's math needs, declared so the runtime can check it against a layout
    (instead of recognising optimizers by name).

    elementwise    each element's update depends only on that element (and scalars): it runs on
                   any slice of a flat buffer, a ZeRO partition or a tensor-parallel shard
    whole_tensors  needs whole parameter tensors (per-tensor norms: LAMB's trust ratio)
    communicates   does its own data-parallel communication (`gradient_allreduce`, 1-bit family)
    cpu            has a CPU path (ZeRO-Offload runs it on the host)
    clip_norm      the transform only scales updates to a global L2 norm of at most this value:
                   train_step folds it into the loss-scale unscaling, with the true global norm
    loose_grads    its fused `apply` also takes a `LooseGrads` (one gradient tensor per parameter,
                   as backward made them, with params and state as Flats): one process in fp32 then
                   skips the copy of the whole gradient into a buffer
    sums_grad_squares  its fused `apply` also takes `grad_sq`, a list it appends the sums of the
                   squared gradient elements it read to (each element once): where nothing needs
                   the grad norm before the update, train_step takes the metric from the update's
                   own pass over the gradient instead of a pass of its own
    """

    elementwise: bool = False
    whole_tensors: bool = False
    communicates: bool = False
    cpu: bool = False
    clip_norm: Optional[float] = None
    loose_grads: bool = False
    sums_grad_squares: bool = False


ELEMENTWISE = Capabilities(elementwise=True, cpu=True)


class GradientTransformation(NamedTuple):
    """`init(params) -> state`; `update(updates, state, params) -> (updates, state)`;
    optional fused `apply(grads, state, params, *, cast_to=None) -> (params, state)` (donates its
    arguments; see the module docstring for `cast_to`); optional `gradient_allreduce(state) ->
    bool` for optimizers that do their own data-parallel communication (module docstring);
    `capabilities` (`Capabilities`) say what its math needs. A transform that declares none is
    taken as needing whole, replicated tensors on the device: safe everywhere, refused where a
    layout partitions it."""

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    apply: Optional[Callable[..., tuple[Params, OptState]]] = None
    info: Optional[TransformInfo] = None
    gradient_allreduce: Optional[Callable[[OptState], bool]] = None
    capabilities: Capabilities = Capabilities()

    @property
    def children(self) -> tuple["GradientTransformation", ...]:
        """The transforms a composition (`chain`) applies in order; () for a single transform."""
        return self.info.children if self.info is not None else ()

    @property
    def parts(self) -> tuple["GradientTransformation", ...]:
        """The single transforms this one is made of, compositions flattened."""
        return tuple(p for child in self.children for p in child.parts) if self.children else (self,)

    def lacking(self, capability: str) -> Optional[str]:
        """The name of the first part without `capability` (e.g. "cpu"), or None."""
        for part in self.parts:
            if not getattr(part.capabilities, capability):
                return part.info.name if part.info is not None else repr(part)
        return None

    def having(self, capability: str) -> Optional[str]:
        """The name of the first part with `capability` (e.g. "whole_tensors"), or None."""
        for part in self.parts:
            if getattr(part.capabilities, capability):
                return part.info.name if part.info is not None else repr(part)
        return None

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


def cast_params_into(cast_to: Params, params: Params) -> Params:
    """Write `params`, cast, into the matching tensors of `cast_to` (round to nearest even)."""
    for target, source in zip(cast_targets(cast_to, params), tensor_leaves(params)):
        target.copy_(source)
    return cast_to


def cast_targets(cast_to: Params, params: Params | list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensor leaves of `cast_to`, checked against those of `params` (count and sizes)."""
    sources = params if isinstance(params, list) and all(isinstance(x, torch.Tensor) for x in params) \
        else tensor_leaves(params)
    targets = tensor_leaves(cast_to)
    if len(targets) != len(sources):
        raise ValueError(
            f"cast_to has {len(targets)} tensor leaves but params has {len(sources)}; pass a tree (or Flat) "
            "with the structure of params"
        )
    for i, (t, s) in enumerate(zip(targets, sources)):
        if t.shape != s.shape or not t.is_floating_point():
            raise ValueError(
                f"cast_to leaf {i} is {t.dtype} of shape {list(t.shape)}; expected a floating tensor of "
                f"shape {list(s.shape)} (the matching params leaf)"
            )
    return targets


def _accepts_cast_to(apply: Callable) -> bool:
    try:
        parameters = inspect.signature(apply).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "cast_to" or p.kind is p.VAR_KEYWORD for p in parameters)


def init_state(opt: GradientTransformation, params: Params, data_size: Optional[int] = None) -> OptState:
    """`opt.init(params)`; a transform that communicates itself also gets the size of the data
    axis it will run on (`data_size`: its error buffers are sized for it)."""
    if opt.capabilities.communicates and data_size is not None:
        return opt.init(params, data_size=data_size)
    return opt.init(params)


def needs_full_allreduce(opt: GradientTransformation, state: OptState) -> bool:
    """Whether the runtime must all-reduce this step's gradient before `opt` (module docstring)."""
    return opt.gradient_allreduce is None or bool(opt.gradient_allreduce(state))


def optimizer_step(
    opt: GradientTransformation, grads: Updates, state: OptState, params: Params, *, cast_to: Params = None,
    comm: Any = None, grad_sq: Optional[list] = None,
) -> tuple[Params, OptState]:
    """One optimizer step that may update `params` and `state` in place (donates all arguments).

    With `cast_to`, the updated params are also written, cast, into it: by the transform's `apply`
    (fused) when it takes `cast_to`, otherwise here, after the update. `comm` (the data axis) is
    passed to optimizers that communicate themselves (`gradient_allreduce` set). `grad_sq` (a
    list), for a transform that declares `sums_grad_squares`: it appends the sums of the squared
    gradients it read.
    """
    if grad_sq is not None:
        if not opt.capabilities.sums_grad_squares:
            raise ValueError(f"optimizer_step: grad_sq= needs a transform that sums the squared gradients in its "
                             f"pass (Capabilities.sums_grad_squares); {opt.info.name if opt.info else opt!r} does not")
        return opt.apply(grads, state, params, cast_to=cast_to, grad_sq=grad_sq)
    if opt.gradient_allreduce is not None:
        return opt.apply(grads, state, params, cast_to=cast_to, comm=comm)
    if opt.apply is not None:
        if cast_to is None:
            return opt.apply(grads, state, params)
        if _accepts_cast_to(opt.apply):
            return opt.apply(grads, state, params, cast_to=cast_to)
        params, state = opt.apply(grads, state, params)
    else:
        updates, state = opt.update(grads, state, params)
        params = _apply_updates_in_place(params, updates)
    if cast_to is not None:
        cast_params_into(cast_to, params)
    return params, state


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms in sequence; the state is the tuple of their states."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain() argument {i} is {type(t).__name__}, not a GradientTransformation")

    def init(params, *, data_size=None):
        return tuple(init_state(t, params, data_size) for t in transforms)

    def update(updates, state, params=None):
        _check_state(state, len(transforms))
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def apply(grads, state, params, *, cast_to=None, comm=None):
        _check_state(state, len(transforms))
        if not transforms:
            if cast_to is not None:
                cast_params_into(cast_to, params)
            return params, state
        new_state = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        params, s = optimizer_step(transforms[-1], grads, state[-1], params, cast_to=cast_to, comm=comm)
        new_state.append(s)
        return params, tuple(new_state)

    communicating = [i for i, t in enumerate(transforms) if t.gradient_allreduce is not None]
    if communicating and communicating != [len(transforms) - 1]:
        raise ValueError(f"chain: transform {communicating[0]} ({transforms[communicating[0]].info}) does its own "
                         "data-parallel communication and must be the last transform of the chain")
    allreduce = None
    if communicating:
        last = transforms[-1]

        def allreduce(state):
            return last.gradient_allreduce(state[-1])

    parts = [p.capabilities for t in transforms for p in t.parts]
    caps = Capabilities(elementwise=all(c.elementwise for c in parts), whole_tensors=any(c.whole_tensors for c in parts),
                        communicates=any(c.communicates for c in parts), cpu=all(c.cpu for c in parts),
                        loose_grads=len(parts) == 1 and parts[0].loose_grads)  # `apply` hands it to the one part
    return GradientTransformation(init, update, apply, TransformInfo("chain", {}, tuple(transforms)), allreduce, caps)


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


# --------------------------------------------------------------------------- kernel backends

BACKENDS = ("auto", "torch", "numba")


def check_backend(name: str, backend: str) -> None:
    """`backend` must be one of BACKENDS (checked when the optimizer is built)."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend={backend!r} is not allowed; allowed: {', '.join(map(repr, BACKENDS))}")


def numba_kernel(name: str, backend: str, kernels: dict[str, str], tensors: list[torch.Tensor]) -> Optional[ModuleType]:
    """The `fspeed.kernels` module that runs this update, or None for the torch reference path.

    `kernels` maps a device type to a module name (`{"cpu": "cpu_adam", "cuda": "cuda_adam"}`);
    the module has `is_available()` and `require()` (raises, naming what to install). "torch" is
    always None; "auto" takes the kernel when one exists for the tensors' device and its toolkit
    is there; "numba" demands it and raises a clear error otherwise. Imported lazily: Numba's
    compiler costs ~0.3 s to import and only kernels need it.
    """
    if backend == "torch" or not tensors:
        return None
    devices = {t.device.type for t in tensors}
    device = devices.pop() if len(devices) == 1 else None
    module_name = kernels.get(device) if device is not None else None
    if module_name is None:
        if backend == "numba":
            found = ", ".join(sorted({t.device.type for t in tensors}))
            raise ValueError(
                f"{name}: backend='numba' has kernels for {', '.join(sorted(kernels))} tensors, got {found}; "
                "use backend='auto' or 'torch'"
            )
        return None
    module = importlib.import_module(f"fspeed.kernels.{module_name}")
    if backend == "numba":
        module.require()
        return module
    return module if module.is_available() else None
