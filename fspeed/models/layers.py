"""A model as a sequence of layers: what the pipeline assigns to stages (DeepSpeed's `PipelineModule`).

    seq = model.layers                      # the reference GPT's: embed, blocks.0 .. blocks.n-1, head
    loss = seq.loss(y, micro_batch, ops=ops) where y = layers[-1](... layers[0](seq.inputs(micro_batch)))
    loss = seq.last_with_loss(params, x, micro_batch, ops=ops) where x = layers[-2](...), when given

A `Layer` is a pure function `fn(params, x, *, rng, ops) -> y` of the model's parameter tree (of which
it reads only the subtrees under its `uses` paths), its input activation and the step's generator.
A layer's output is a tensor or a tuple of tensors (a hidden state and a mask, say): what crosses a
stage boundary, one message per tensor; the floating ones carry gradients back. A layer that gets a
tuple gets it as one argument, as in DeepSpeed's `PipelineModule`. Two layers that use the same path share
that parameter (a tied embedding and output head, DeepSpeed's `TiedLayerSpec`): each stage that holds
one of them keeps a copy, and the pipeline sums their gradients so the copies stay equal.

`fspeed.models.module_sequence.sequential(modules, loss_fn=...)` builds such a sequence from a list of
`nn.Module`s, as DeepSpeed users write a `PipelineModule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..pytree import PyTree
from ..rng import layer_generators
from .ops import DENSE


@dataclass(frozen=True)
class Layer:
    """One layer (module docstring). `kind` is what `partition="type:<regex>"` matches (a class name).
    `linear_via_ops`: every `F.linear` on the layer's parameters goes through `ops.linear` (fspeed's
    own layers), so zero bubble's weight-gradient split needs no torch-function mode on every op.
    A layer with `state` is called with `buffers=` (the model's buffer tree, `Model.init_buffers`),
    whose tensors under those paths its forward updates in place."""

    name: str
    fn: Callable[..., torch.Tensor]
    uses: tuple[str, ...]
    kind: str = ""
    linear_via_ops: bool = False
    state: tuple[str, ...] = ()  # the buffer subtrees it reads and updates (BatchNorm statistics): fn takes buffers=


@dataclass(frozen=True)
class LayerSequence:
    """The layers in order, what the first one gets from a micro-batch, and the loss of the last one's
    output: `loss(y, micro_batch, *, ops) -> scalar`. `last_with_loss(params, x, micro_batch, *, ops)`,
    when given, is the last layer and the loss as one function, run in their place (the GPT's fused
    head and loss, which keeps no logits for backward); the last layer still says what it uses."""

    layers: tuple[Layer, ...]
    inputs: Callable[[PyTree], Any]
    loss: Callable[..., torch.Tensor]
    last_with_loss: Optional[Callable[..., torch.Tensor]] = None

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a LayerSequence needs at least one layer")
        names = [layer.name for layer in self.layers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"layer names must be unique; repeated: {repeated}")

    def __len__(self) -> int:
        return len(self.layers)

    def run(self, params: PyTree, micro_batch: PyTree, *, rng: Optional[torch.Generator] = None,
            ops: Any = DENSE, layer_rng: Optional[Callable[[int], Optional[torch.Generator]]] = None,
            buffers: Optional[PyTree] = None) -> torch.Tensor:
        """The loss of one micro-batch through every layer in order (the one-process reference of a
        pipeline). Layer i draws from `layer_rng(i)` when given, else from generator i of
        `layer_generators(rng, ...)` (what a pipeline stage seeds it with: the same masks); layers
        with state update theirs in `buffers`."""
        x = self.inputs(micro_batch)
        rngs = [layer_rng(i) for i in range(len(self.layers))] if layer_rng is not None else \
            layer_generators(rng, len(self.layers))
        last = len(self.layers) - (self.last_with_loss is not None)
        for layer, rng_i in zip(self.layers[:last], rngs):
            x = layer.fn(params, x, rng=rng_i, ops=ops, **with_state(layer, buffers))
        return self.tail(params, x, micro_batch, ops=ops)

    def tail(self, params: PyTree, x: Any, micro_batch: PyTree, *, ops: Any = DENSE) -> torch.Tensor:
        """The loss from the output of the layer before the last (`last_with_loss`), or from the last one's."""
        if self.last_with_loss is not None:
            return self.last_with_loss(params, x, micro_batch, ops=ops)
        return self.loss(x, micro_batch, ops=ops)


def with_state(layer: Layer, buffers: Optional[PyTree]) -> dict:
    """The keyword arguments that give `layer` its state: `buffers=` for a layer that has some."""
    return {"buffers": buffers} if layer.state else {}
