"""`Model`: a pure function of a parameter pytree, plus what the parallel transforms need to know.

A Model holds `init(generator) -> params`, `apply(params, inputs, *, rng=None) -> outputs`,
`loss(params, batch, *, rng=None) -> scalar`, and the logical axis names of each parameter
(`{"blocks.0.mlp.w_in": ("embed", "mlp")}`), which sharding rules map onto mesh axes. Models never
import the parallel transforms.

`functionalize(module)` (`fspeed.models.module`) turns any `nn.Module` into a Model through
`torch.func.functional_call`, so existing torch models train through `train_step` unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..pytree import PyTree, tree_flatten_with_paths

LogicalAxes = dict[str, tuple[Optional[str], ...]]


@dataclass(frozen=True)
class Model:
    """A model as pure functions of its parameters (see module docstring).

    `units` (parameter path -> unit name; None: `blocks.3` / top-level entry) says what the
    parallel runtime gathers, recomputes and delivers gradients by; `init_buffers()` returns the
    module state a TrainState carries (BatchNorm statistics), None when there is none; `layers` (a
    `LayerSequence`) is the model as layers in order, which a pipeline assigns to stages.
    """

    init: Callable[..., PyTree]
    apply: Callable[..., Any]
    loss: Callable[..., torch.Tensor]
    logical_axes: LogicalAxes = field(default_factory=dict)
    name: str = "model"
    units: Optional[dict[str, str]] = None
    init_buffers: Optional[Callable[[], PyTree]] = None
    layers: Optional[Any] = None  # a `fspeed.models.layers.LayerSequence`: what pipeline stages split

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


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` takes the keyword `name` (by name or through **kwargs): how the step learns which
    of a loss's optional keywords (`ops=`, `buffers=`, `train=`) it may pass."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
