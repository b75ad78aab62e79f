"""Any elementwise `torch.optim.Optimizer` as a GradientTransformation over fspeed's flat buffers.

    opt = from_torch(torch.optim.Adagrad, lr=1e-2)
    opt = chain(clip_by_global_norm(1.0), from_torch(torch.optim.AdamW, lr=3e-4, fused=True))

How it runs: the torch optimizer steps each tensor leaf of the params as one parameter, and a
Flat (the fp32 masters, a ZeRO rank's partition) is one leaf, its whole buffer, with the matching
gradient buffer as `.grad`. An elementwise optimizer does not care where parameters begin and end
in a buffer, so this is one foreach/fused launch per buffer, as fspeed's own fused path is.

Its state lives in the optimizer state pytree (`TorchOptimizerState`): per-element entries
(`exp_avg`, `sum`, `momentum_buffer`) as trees like the params (a Flat for a Flat: checkpoints
name them by parameter path), and 0-d entries (`step`, NAdam's `mu_product`) as tensors, one per
leaf. Each step hands those tensors to the torch optimizer as its `state`, steps it, and keeps
what it wrote, so a checkpoint of the TrainState resumes bit-exact. The entries are found once per
device and dtype by stepping the class on a 2-element probe. On the first step only, entries the
constructor does not create are left to torch to create as it does (SGD's momentum buffer starts
as the gradient), then copied into the state: that step briefly holds them twice.

Only optimizers whose update of each element depends on that element alone can run on a buffer
or a ZeRO partition: Adadelta, Adagrad, Adam, AdamW, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop,
SGD. LBFGS, SparseAdam, Adafactor and Muon are refused (named reasons below); another class needs
`elementwise=True`, the caller's word that it is elementwise.

Cost against fspeed's fused path (`benchmarks/torch_optimizers.py`: one AdamW step on a 10M
parameter GPT's flat buffer, fp32, 2 CPU threads, medians; this machine is shared, +-30%):

    fspeed adamw (Numba kernel, one pass)       6.0 ms   1.00
    from_torch(AdamW, fused=True)               6.3 ms   1.05   same single pass (torch's kernel)
    from_torch(AdamW, foreach=True)            30.4 ms   5.1    one pass per elementwise op
    eager loop, AdamW(fused) on 124 tensors     7.3 ms   1.22
    eager loop, AdamW(foreach) on 124 tensors  22.6 ms   3.8

The adapter's own cost is a constant per step: ~35 us (installing the state, torch's `step()`
machinery) over the same kernel launched by fspeed. Under parameter groups it is one `step()`
per group of equal settings, over the list of that group's runs. Gradients in another dtype than
the parameters (bf16 accumulation) are converted to a full-size copy each step (fspeed's CPU
kernel reads them as they are), and precision's `cast_to` is a separate pass after the step
(fspeed's kernel writes it in the same pass).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple, Optional

import torch

from ..pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .base import Capabilities, GradientTransformation, TransformInfo, resolve
from .masks import Mask, masked_weight_decay

ELEMENTWISE_OPTIMIZERS = ("Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
                          "Rprop", "SGD")
REFUSED_OPTIMIZERS = {
    "LBFGS": "needs a closure that re-evaluates the loss and a line search over all parameters",
    "SparseAdam": "takes sparse gradients only",
    "Adafactor": "factors its second moment per matrix (row and column statistics of whole tensors)",
    "Muon": "orthogonalises each whole matrix's update",
}
_PROBE = 2  # elements of the probe parameter: per-element state has this shape, scalar state none


class TorchOptimizerState(NamedTuple):
    count: int  # updates applied so far
    lr: float  # the lr the next update will use
    elementwise: dict  # torch state key -> tree like params (a Flat for a Flat)
    scalars: dict  # torch state key -> tuple of 0-d tensors, one per tensor leaf of params


class _StateSpec(NamedTuple):
    """What the torch optimizer keeps per parameter, found on a probe (module docstring)."""

    constructed: frozenset  # keys its constructor creates (the rest appear in the first step)
    elementwise: tuple  # keys of per-element entries
    scalars: tuple  # ((key, dtype, device), ...) of 0-d entries


def from_torch(optimizer_class: type, *, elementwise: Optional[bool] = None, mask: Optional[Mask] = None,
               **hyperparameters: Any) -> GradientTransformation:
    """`optimizer_class` (a torch.optim.Optimizer subclass) with `hyperparameters` as a
    GradientTransformation (module docstring). `lr` may be a schedule; `mask(path)` says which
    parameters get its weight decay; `elementwise=True` vouches for a class fspeed does not know."""
    name = _class_name(optimizer_class)
    _check_elementwise(optimizer_class, name, elementwise)
    hparams = _bind(optimizer_class, name, hyperparameters)
    if mask is not None:
        return masked_weight_decay(from_torch(optimizer_class, elementwise=elementwise, **hyperparameters), mask)
    lr = hparams["lr"]
    fixed = {k: v for k, v in hparams.items() if k != "lr"}
    _validate(optimizer_class, name, fixed, resolve(lr, 0))
    specs: dict = {}
    optimizers: dict = {}

    def spec_for(device: torch.device, dtype: torch.dtype) -> _StateSpec:
        if (device, dtype) not in specs:
            specs[device, dtype] = _probe(optimizer_class, name, fixed, resolve(lr, 0), device, dtype)
        return specs[device, dtype]

    def optimizer_for(device: torch.device, dtype: torch.dtype) -> torch.optim.Optimizer:
        """One torch optimizer per device and dtype, built over a placeholder; each step points
        its group at the real buffers and its state at ours, then back."""
        if (device, dtype) not in optimizers:
            placeholder = torch.zeros(_PROBE, device=device, dtype=dtype)
            optimizers[device, dtype] = (optimizer_class([placeholder], lr=resolve(lr, 0), **fixed), placeholder)
        return optimizers[device, dtype]

    def init(params):
        leaves, treedef = _tensor_leaves(params, name)
        if not leaves:
            return TorchOptimizerState(0, resolve(lr, 0), {}, {})
        spec = spec_for(leaves[0].device, leaves[0].dtype)
        constructed = optimizer_class(leaves, lr=resolve(lr, 0), **fixed).state if spec.constructed else {}
        per_leaf = [constructed.get(p, {}) for p in leaves]
        elementwise_state = {
            key: tree_unflatten(treedef, [s[key] if key in s else torch.zeros_like(p)
                                          for p, s in zip(leaves, per_leaf)])
            for key in spec.elementwise
        }
        scalars = {key: tuple(s[key] if key in s else torch.zeros((), dtype=dtype, device=device) for s in per_leaf)
                   for key, dtype, device in spec.scalars}
        return TorchOptimizerState(0, resolve(lr, 0), elementwise_state, scalars)

    def apply(grads, state: TorchOptimizerState, params):
        leaves, _ = _tensor_leaves(params, name)
        grad_leaves, _ = _tensor_leaves(grads, name)
        if [g.shape for g in grad_leaves] != [p.shape for p in leaves]:
            raise ValueError(f"{name}: grads do not match params (shapes {[list(g.shape) for g in grad_leaves]} "
                             f"vs {[list(p.shape) for p in leaves]})")
        if leaves:
            spec = spec_for(leaves[0].device, leaves[0].dtype)
            per_key = {**{k: tree_leaves(t) for k, t in state.elementwise.items()}, **state.scalars}
            ours = [{k: values[i] for k, values in per_key.items()} for i in range(len(leaves))]
            # the first step leaves entries the constructor does not make to torch, as torch does
            installed = spec.constructed if state.count == 0 else frozenset(per_key)
            _step(optimizer_for(leaves[0].device, leaves[0].dtype), name, leaves, grad_leaves, ours, installed,
                  resolve(lr, state.count))
        return params, TorchOptimizerState(state.count + 1, resolve(lr, state.count + 1), state.elementwise,
                                           state.scalars)

    def update(grads, state: TorchOptimizerState, params=None):
        if params is None:
            raise ValueError(f"{name} needs params in update() (torch optimizers update parameters in place)")
        copy = tree_map(torch.clone, params)
        copy, new_state = apply(grads, tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state),
                                copy)
        return tree_map(torch.sub, copy, params), new_state

    info = TransformInfo(name, hparams, factory=functools.partial(from_torch, optimizer_class, elementwise=elementwise))
    return GradientTransformation(init, update, apply, info, capabilities=Capabilities(elementwise=True, cpu=True))


def _step(pair: tuple, name: str, leaves: list, grads: list, ours: list[dict], installed: frozenset,
          lr: float) -> None:
    """One torch step with our tensors as its state; lazily created entries are copied into ours."""
    optimizer, placeholder = pair
    group = optimizer.param_groups[0]
    group["params"], group["lr"] = leaves, lr
    optimizer.state.clear()
    try:
        for p, g, mine in zip(leaves, grads, ours):
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
            optimizer.state[p] = {k: v for k, v in mine.items() if k in installed}
        optimizer.step()
        for p, mine in zip(leaves, ours):
            written = {k: v for k, v in optimizer.state[p].items() if v is not None}
            extra = sorted(set(written) - set(mine))
            if extra:
                raise RuntimeError(f"{name} created state {extra} after its first step; from_torch keeps only the "
                                   "entries found on the first step")
            for key, value in written.items():
                if value is not mine[key]:
                    mine[key].copy_(value)
    finally:
        for p in leaves:
            p.grad = None
        optimizer.state.clear()
        group["params"] = [placeholder]


def _tensor_leaves(tree: Any, name: str) -> tuple[list[torch.Tensor], Any]:
    leaves, treedef = tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name}: params, grads and state trees must hold tensors only, got {type(leaf).__name__}")
    return leaves, treedef


def _class_name(optimizer_class: Any) -> str:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"from_torch takes a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), got "
                        f"{optimizer_class!r}")
    short = optimizer_class.__name__
    if getattr(torch.optim, short, None) is optimizer_class:
        return f"torch.optim.{short}"
    return f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"


def _check_elementwise(optimizer_class: type, name: str, elementwise: Optional[bool]) -> None:
    short = optimizer_class.__name__
    known = getattr(torch.optim, short, None) is optimizer_class
    if known and short in REFUSED_OPTIMIZERS:
        raise ValueError(f"from_torch: {name} {REFUSED_OPTIMIZERS[short]}; from_torch runs elementwise optimizers on "
                         f"flat buffers and ZeRO partitions: {', '.join(ELEMENTWISE_OPTIMIZERS)}")
    if elementwise is not None and not isinstance(elementwise, bool):
        raise TypeError(f"from_torch: elementwise={elementwise!r} must be True, False or None")
    if known and short in ELEMENTWISE_OPTIMIZERS:
        if elementwise is False:
            raise ValueError(f"from_torch: {name} is elementwise; elementwise=False contradicts it (leave it None)")
        return
    if elementwise is not True:
        raise ValueError(f"from_torch: fspeed does not know whether {name} updates each element from that element "
                         "alone; pass elementwise=True if it does (an Adam or SGD variant). Optimizers with "
                         "per-tensor math are not supported")


def _bind(optimizer_class: type, name: str, hyperparameters: dict) -> dict:
    """Every constructor argument but `params`, defaults filled in (so groups can override any)."""
    if "params" in hyperparameters:
        raise TypeError(f"from_torch: params are not given to {name} (fspeed passes its flat buffers)")
    for key, value in hyperparameters.items():
        if callable(value) and key != "lr":
            raise TypeError(f"from_torch: {key} is a schedule; only lr may be one")
    signature = inspect.signature(optimizer_class)
    accepted = [p for p in signature.parameters if p not in ("self", "params")]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    unknown = sorted(set(hyperparameters) - set(accepted)) if not takes_any else []
    if unknown:
        raise TypeError(f"from_torch: {name} takes no {', '.join(map(repr, unknown))}; allowed: {', '.join(accepted)}")
    bound = signature.bind_partial(None, **hyperparameters)
    bound.apply_defaults()
    values = {k: v for k, v in bound.arguments.items() if k != "params"}
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            values.update(values.pop(p.name, {}))
    if "lr" not in values or values["lr"] is inspect.Parameter.empty:
        raise TypeError(f"from_torch: {name} has no lr argument with a value; pass lr=")
    return values


def _validate(optimizer_class: type, name: str, fixed: dict, lr: float) -> None:
    """Fail when the optimizer is built, not at the first step: the constructor checks the values
    (device-specific switches are left to the first step)."""
    portable = {k: v for k, v in fixed.items() if k not in ("fused", "foreach", "capturable")}
    try:
        optimizer_class([torch.zeros(_PROBE)], lr=lr, **portable)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"from_torch: {name} rejects these hyperparameters: {e}") from None


def _probe(optimizer_class: type, name: str, fixed: dict, lr: float, device: torch.device,
           dtype: torch.dtype) -> _StateSpec:
    """The optimizer's per-parameter state, found by one step on a 2-element probe."""
    p = torch.zeros(_PROBE, device=device, dtype=dtype)
    optimizer = optimizer_class([p], lr=lr, **fixed)
    constructed = frozenset(optimizer.state[p]) if p in optimizer.state else frozenset()
    p.grad = torch.zeros_like(p)
    optimizer.step()
    elementwise, scalars = [], []
    for key, value in optimizer.state[p].items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"from_torch: {name} keeps {key}={value!r} ({type(value).__name__}) per parameter; "
                             "only tensor state can live in fspeed's optimizer state")
        if value.shape == p.shape:
            elementwise.append(key)
        elif value.dim() == 0:
            scalars.append((key, value.dtype, value.device))
        else:
            raise ValueError(f"from_torch: {name}'s state {key!r} has shape {list(value.shape)} for a parameter of "
                             f"{_PROBE} elements; only per-element and scalar state is supported")
    return _StateSpec(constructed, tuple(elementwise), tuple(scalars))


__all__ = ["ELEMENTWISE_OPTIMIZERS", "REFUSED_OPTIMIZERS", "TorchOptimizerState", "from_torch"]
