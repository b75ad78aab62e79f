"""`Model`: a pure function of a parameter pytree, plus what the parallel transforms need to know.

A Model holds `init(generator) -> params`, `apply(params, inputs, *, rng=None) -> outputs`,
`loss(params, batch, *, rng=None) -> scalar`, and the logical axis names of each parameter
(`{"blocks.0.mlp.w_in": ("embed", "mlp")}`), which sharding rules map onto mesh axes. Models never
import the parallel transforms.

`functionalize(module)` turns any `nn.Module` into a Model through `torch.func.functional_call`, so
existing torch models train through `train_step` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..pytree import PyTree, tree_flatten_with_paths

LogicalAxes = dict[str, tuple[Optional[str], ...]]


@dataclass(frozen=True)
class Model:
    """A model as pure functions of its parameters (see module docstring)."""

    init: Callable[[torch.Generator], PyTree]
    apply: Callable[..., Any]
    loss: Callable[..., torch.Tensor]
    logical_axes: LogicalAxes = field(default_factory=dict)
    name: str = "model"

    def describe(self, params: PyTree) -> str:
        """A table of parameter path, shape and logical axes, and the total count."""
        paths, leaves, _ = tree_flatten_with_paths(params)
        width = max((len(p) for p in paths), default=10)
        lines = [f"{'parameter':<{width}}  {'shape':<18} axes"]
        for path, leaf in zip(paths, leaves):
            axes = self.logical_axes.get(path, ())
            lines.append(f"{path:<{width}}  {str(list(leaf.shape)):<18} {axes}")
        total = sum(leaf.numel() for leaf in leaves)
        lines.append(f"{self.name}: {total:,} parameters")
        return "\n".join(lines)


def count_params(params: PyTree) -> int:
    return sum(leaf.numel() for leaf in tree_flatten_with_paths(params)[1])


class ModuleLoss:
    """`loss` of a functionalized module.

    `buffers` (BatchNorm running statistics, ...) are updated in place by the module. Under a
    torch.func transform, a tensor may only be mutated if it is an input of the transformed
    function, so `train_step` passes `loss.buffers` in as an input (`buffers=` keyword).
    """

    def __init__(self, apply_fn, loss_fn, buffers: dict[str, torch.Tensor], name: str):
        self.apply_fn, self.loss_fn, self.buffers, self.name = apply_fn, loss_fn, buffers, name

    def __call__(self, params, batch, *, rng=None, buffers=None) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError(
                f"functionalize({self.name}) was given no loss_fn; pass "
                "functionalize(module, loss_fn=lambda outputs, batch: ...)"
            )
        if isinstance(batch, dict):
            inputs = {k: v for k, v in batch.items() if k != "targets"}
        else:
            inputs = batch[0]
        return self.loss_fn(self.apply_fn(params, inputs, rng=rng, buffers=buffers), batch)


def functionalize(
    module: nn.Module,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    *,
    logical_axes: Optional[LogicalAxes] = None,
) -> Model:
    """A Model backed by `module` through `torch.func.functional_call`.

    Parameters are keyed by `module.named_parameters()` names (`layers.0.weight`), the same as the
    module's state_dict. Buffers are the module's own and are passed to every call, so running
    statistics (BatchNorm) keep updating in place as they would in eager PyTorch.

    `init(generator)` returns detached copies of the module's current parameters (the module's own
    initialization already ran when it was built). `apply(params, inputs)` calls the module with
    `inputs` (a tuple is unpacked into positional arguments, a dict into keyword arguments).
    `loss(params, batch)` needs `loss_fn(outputs, batch)`; the module is called on `batch[0]`, or
    on a dict batch minus its "targets" key.
    """
    module_buffers = dict(module.named_buffers())
    if not any(True for _ in module.parameters()):
        raise ValueError(f"functionalize: {type(module).__name__} has no parameters")

    def init(generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in module.named_parameters()}

    def apply(params, inputs, *, rng: Optional[torch.Generator] = None, buffers=None):
        tensors = (params, module_buffers if buffers is None else buffers)
        if isinstance(inputs, dict):
            return torch.func.functional_call(module, tensors, args=(), kwargs=inputs)
        return torch.func.functional_call(module, tensors, args=inputs if isinstance(inputs, tuple) else (inputs,))

    name = type(module).__name__
    loss = ModuleLoss(apply, loss_fn, module_buffers, name)
    return Model(init, apply, loss, dict(logical_axes or {}), name=name)
