"""`init_train_state`: a fresh TrainState from full parameters, an optimizer and (optionally) a plan.

    state = fs.init_train_state(params, opt, precision=fs.precision.bf16())
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
"""

from __future__ import annotations

from typing import Optional

import torch

from .loss_scale import init_loss_scale
from .optim.base import GradientTransformation, init_state
from .optim.groups import check_param_groups
from .parallel.layout import LOCAL_MESH, resolve_flat
from .parallel.plan import Plan
from .parallel.runtime import build_param_state, check_optimizer
from .precision import Precision, fp32
from .models.model import Model
from .pytree import PyTree, tree_flatten_with_paths, tree_map
from .train_state import TrainState


def init_train_state(
    params: PyTree,
    optimizer: GradientTransformation,
    *,
    precision: Precision = fp32(),
    seed: int = 0,
    device: Optional[torch.device | str] = None,
    plan: Optional[Plan] = None,
    mesh=None,
    logical_axes: Optional[dict] = None,
    model: Optional[Model] = None,
    buffers: Optional[PyTree] = None,
) -> TrainState:
    """A fresh TrainState: params copied into flat buffers, fp32 masters, optimizer state, scaler.

    With a `plan` and a `mesh`, every rank keeps only its part (`fspeed.parallel.runtime`): its
    tensor-parallel slice and, by ZeRO stage, its slice or shard of masters, optimizer state and
    parameters. `params` are the full (global) parameters, identical on every rank. `model`
    supplies what the plan needs of it: its logical axes (tensor slicing), its units (what ZeRO-3
    gathers: a functionalized module's layers) and its module state (`buffers`, e.g. BatchNorm
    statistics; else `model.init_buffers()`).
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be a GradientTransformation, got {type(optimizer).__name__}")
    if (plan is None) != (mesh is None):
        raise ValueError("init_train_state: pass both plan= and mesh= (or neither)")
    scaler = init_loss_scale(precision.loss_scale)
    if model is not None:
        logical_axes = model.logical_axes if logical_axes is None else logical_axes
        if buffers is None and model.init_buffers is not None:
            buffers = model.init_buffers()
    buffers = tree_map(lambda t: t.detach().clone() if device is None else t.detach().to(device, copy=True),
                       buffers if buffers is not None else {})
    local = plan is None
    paths, leaves, treedef = tree_flatten_with_paths(params)  # the one flattening of the tree
    check_param_groups(optimizer, paths)  # against every path: a ZeRO rank's slice may hold none of a group
    layout = resolve_flat(Plan() if local else plan, paths, leaves, treedef, LOCAL_MESH if local else mesh.sizes,
                          {a: 0 for a in LOCAL_MESH} if local else mesh.coords, logical_axes,
                          model.units if model is not None else None, model.layers if model is not None else None)
    check_optimizer(optimizer, layout)
    if layout.pipeline is not None:  # this stage's parameters only
        leaves = [leaf for path, leaf in zip(paths, leaves) if layout.pipeline.holds(path)]
    compute, master, target = build_param_state(leaves, layout, precision, device)
    # without a plan the optimizer state is sized as it would be (a 1-bit optimizer's world_size wins)
    return TrainState(params=compute, master=master,
                      opt_state=init_state(optimizer, target, None if local else layout.data_size),
                      loss_scale=scaler, rng_seed=int(seed), precision=precision, layout=layout, buffers=buffers)


__all__ = ["init_train_state"]
