"""`make_eval_step`: the loss of a batch under a training state, without gradients or dropout.

    eval_step = make_eval_step(model.loss)              # or (model, plan=plan, mesh=mesh)
    val_loss = eval_step(state, batch)

It reads the state and does not donate it, so it runs between training steps on the same state.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .micro_batches import on_device
from .models.model import Model, accepts_keyword
from .parallel.pipeline_runtime import PipelineExecutor
from .parallel.plan import Plan
from .parallel.runtime import ParallelRuntime
from .pytree import PyTree
from .train_state import TrainState

LossFn = Callable[..., torch.Tensor]


def make_eval_step(loss_fn: LossFn | Model, *, plan: Optional[Plan] = None,
                   mesh=None) -> Callable[[TrainState, PyTree], float]:
    """`eval_step(state, batch) -> loss` without gradients or dropout (does not donate).

    A loss that takes `train=` (a functionalized module's) runs its module in eval mode: dropout
    off, BatchNorm on its running statistics, which stay untouched. Under a plan (the state's),
    the forward runs with the plan's ops and the loss is averaged over data ranks: every rank
    must call it. A pipeline plan needs the `Model` (its layers); the batch then goes through the
    stages as one micro-batch and every stage returns the last stage's loss.
    """
    model = loss_fn if isinstance(loss_fn, Model) else None
    loss_fn = model.loss if model is not None else loss_fn
    if plan is not None and plan.find("pipeline") is not None and (model is None or model.layers is None):
        raise ValueError("a pipeline plan needs the model's layer sequence: pass the Model itself "
                         "(make_eval_step(model, plan=plan, mesh=mesh))")
    parallel_aware = accepts_keyword(loss_fn, "ops")
    options = {}
    if accepts_keyword(loss_fn, "train"):
        options["train"] = False
    takes_buffers = accepts_keyword(loss_fn, "buffers")
    runtimes: dict = {}
    executors: dict = {}  # a pipeline's, by the same key

    @torch.no_grad()
    def eval_step(state: TrainState, batch: PyTree) -> float:
        layout = state.layout
        kwargs = dict(options, buffers=state.buffers) if takes_buffers else dict(options)
        if layout.is_local and plan is None:
            return float(loss_fn(state.params.tree(), on_device(batch, state.params.device), rng=None, **kwargs))
        if mesh is None:
            raise ValueError("this state was built with a plan; pass plan= and mesh= to make_eval_step too")
        key = (layout, state.precision)
        if key not in runtimes:
            runtimes.clear()
            runtimes[key] = ParallelRuntime(layout, mesh, state.precision, state.params, train=False)
            executors.clear()
            if layout.pipeline is not None:
                executors[key] = PipelineExecutor(layout, mesh, model.layers, torch.float32)
        runtime = runtimes[key]
        batch = on_device(batch, runtime.compute_device(state.params))
        if layout.pipeline is not None:
            loss = executors[key].eval_loss(state.params, batch, state.buffers)
            return runtime.mean_loss(loss if loss is not None else 0.0)
        ops = runtime.ops(None)
        try:
            params = runtime.view(state.params, ops, parallel_aware)
            loss = loss_fn(params, batch, rng=None, ops=ops, **kwargs) if parallel_aware else \
                loss_fn(params, batch, rng=None, **kwargs)
        finally:
            runtime.close_ops()
        return runtime.mean_over_data(float(loss))

    return eval_step


__all__ = ["make_eval_step"]
