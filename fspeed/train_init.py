"""`init_train_state`: a fresh TrainState from full parameters, an optimizer and (optionally) a plan.

    state = fs.init_train_state(params, opt, precision=fs.precision.bf16())
    state = fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes)
"""

from __future__ import annotations

from typing import Optional

import torch

from .flat import Flat
from .loss_scale import init_loss_scale
from .optim.base import GradientTransformation, init_state
from .parallel.layout import resolve_flat
from .parallel.plan import Plan
from .parallel.runtime import build_param_state, check_optimizer
from .precision import Precision, fp32
from .pytree import PyTree, tree_flatten_with_paths
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
) -> TrainState:
    """A fresh TrainState: params copied into flat buffers, fp32 masters, optimizer state, scaler.

    With a `plan` and a `mesh`, every rank keeps only its part (`fspeed.parallel.runtime`): its
    tensor-parallel slice and, by ZeRO stage, its slice or shard of masters, optimizer state and
    parameters. `params` are the full (global) parameters, identical on every rank;
    `logical_axes` (the model's) are needed for tensor slicing.
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be a GradientTransformation, got {type(optimizer).__name__}")
    if (plan is None) != (mesh is None):
        raise ValueError("init_train_state: pass both plan= and mesh= (or neither)")
    scaler = init_loss_scale(precision.loss_scale)
    if plan is not None:
        paths, leaves, treedef = tree_flatten_with_paths(params)  # the one flattening of the tree
        layout = resolve_flat(plan, paths, leaves, treedef, mesh.sizes, mesh.coords, logical_axes)
        check_optimizer(optimizer, layout)
        compute, master, target = build_param_state(leaves, layout, precision, device)
        return TrainState(params=compute, master=master, opt_state=init_state(optimizer, target, layout.data_size),
                          loss_scale=scaler, rng_seed=int(seed), precision=precision, layout=layout)
    master = Flat.from_tree(params, dtype=torch.float32, device=device)
    compute = master.to(precision.param_dtype) if precision.has_master else master
    return TrainState(
        params=compute,
        master=master if precision.has_master else None,
        opt_state=init_state(optimizer, master),
        loss_scale=scaler,
        rng_seed=int(seed),
        precision=precision,
    )


__all__ = ["init_train_state"]
