"""Pipeline stages balanced by measured time: each layer's forward and backward timed on an example
micro-batch, then cut so the slowest stage is as fast as it can be.

    counts = fs.parallel.balanced_partition(model, example_micro_batch, pieces=2)   # e.g. [6, 3]
    plan = fs.zero(1) | fs.pipeline(8, partition=counts)
    plan = fs.parallel.profiled_partition(fs.pipeline(8, partition="profile"), model, example, stages=2)  # the same

DeepSpeed's methods balance layer counts (`uniform`), parameter counts (`parameters`) or layers of a
kind (`type:`); none sees that a language model's last layer (the head and the loss over a large
vocabulary) or first (the embeddings) costs more or less than a block. Times are medians over
`repeats` runs after a warm-up, on the device the parameters live on, with the layer's generator as
a training step passes it; the last layer's time includes the loss. Every rank gets rank 0's counts.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ..micro_batches import on_device
from ..models.layers import with_state
from ..pytree import PyTree, tree_leaves, tree_map
from .pipeline_transform import balanced_bounds
from .plan import Plan


def layer_costs(model: Any, example: Any, params: Optional[PyTree] = None, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each of `model.layers`' layers on `example` (one micro-batch)."""
    seq = model.layers
    if seq is None:
        raise ValueError(f"layer_costs: {model.name} has no layer sequence (Model.layers)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"layer_costs(repeats={repeats!r}) must be a positive integer")
    params = model.init(torch.Generator().manual_seed(0)) if params is None else params
    leaves = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), params)
    buffers = model.init_buffers() if model.init_buffers is not None else None  # a copy these forwards update
    device = tree_leaves(leaves)[0].device
    sync = (lambda: None) if device.type == "cpu" else (lambda: torch.get_device_module(device).synchronize())
    n, fused = len(seq), seq.last_with_loss is not None
    times: list[list[float]] = [[] for _ in range(n)]
    for run in range(repeats + 1):  # the first run warms up
        x = seq.inputs(example)
        for i in range(n):
            x = _detached(x)
            rng = torch.Generator(device=device).manual_seed(i)
            sync()
            start = time.perf_counter()
            if fused and i == n - 1:  # the fused tail runs the last layer with the loss
                y = out = seq.last_with_loss(leaves, x, example)
            else:
                y = seq.layers[i].fn(leaves, x, rng=rng, **with_state(seq.layers[i], buffers))
                out = seq.loss(y, example) if i == n - 1 else sum(t.float().sum() for t in _floats(y))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.backward()
            sync()
            if run:
                times[i].append(time.perf_counter() - start)
            x = y
    return [statistics.median(t) for t in times]


def balanced_partition(model: Any, example: Any, pieces: int, params: Optional[PyTree] = None,
                       repeats: int = 3) -> list[int]:
    """Layer counts per piece (stage x virtual stage) minimising the slowest piece's measured time:
    `fs.pipeline(..., partition=counts)`. Under a process group every rank gets rank 0's counts
    (timings differ from rank to rank; the stages must not)."""
    if not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"balanced_partition(pieces={pieces!r}) must be a positive integer")
    if model.layers is not None and pieces > len(model.layers):
        raise ValueError(f"balanced_partition: {pieces} pieces for {len(model.layers)} layers")
    costs = layer_costs(model, example, params, repeats)
    bounds = balanced_bounds(costs, pieces)
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    if dist.is_available() and dist.is_initialized():
        shared = [counts]
        dist.broadcast_object_list(shared, src=0)
        counts = shared[0]
    return counts


def profiled_partition(plan: Plan, model: Any, example: Union[Any, Callable[[], Any]], stages: int,
                       device: Optional[torch.device] = None) -> Plan:
    """`plan` with a pipeline partition of "profile" replaced by the layer counts `balanced_partition`
    measures on `example` (a micro-batch, or a function giving one: called only when needed) for
    `stages` x the pipeline's virtual stages pieces, on `device` (None: where `model.init` puts the
    parameters); any other plan as it is."""
    pipe = plan.find("pipeline")
    if pipe is None or not isinstance(pipe.partition, str) or pipe.partition.lower() != "profile":
        return plan
    example = example() if callable(example) else example
    params = None
    if device is not None:
        params = tree_map(lambda t: t.to(device), model.init(torch.Generator().manual_seed(0)))
        example = on_device(example, device)
    counts = balanced_partition(model, example, stages * pipe.virtual_stages, params)
    profiled = dataclasses.replace(pipe, partition=tuple(counts))
    return Plan(tuple(profiled if t is pipe else t for t in plan.transforms))


def _floats(x: Any) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _detached(x: Any) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.is_floating_point())
        return t
    return tuple(one(t) for t in x) if isinstance(x, tuple) else one(x)


__all__ = ["balanced_partition", "layer_costs", "profiled_partition"]
