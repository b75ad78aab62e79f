"""TrainState: everything a training run carries from step to step, as one pytree.

    params       Flat, compute dtype: what the model sees
    master       Flat fp32 master weights (None in fp32, where params are the master)
    opt_state    the optimizer's state (moments are Flats, so updates are one pass)
    loss_scale   the loss scaler's state (DeepSpeed's DynamicLossScaler fields)
    step         optimizer-step attempts, skipped ones included (DeepSpeed's global_steps)
    skipped_steps, samples
    rng_seed     dropout generators are derived from (rng_seed, step, micro-batch): exact resume
    precision    the precision policy (static: pytree metadata, not a leaf)

`train_step` donates its input state: the returned state reuses its buffers, and reading a field
of the donated state raises `DonatedStateError` instead of returning silently changed tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .flat import Flat
from .loss_scale import LossScaleState, init_loss_scale
from .optim.base import GradientTransformation, learning_rate
from .plan import Layout, Plan, resolve
from .precision import Precision, fp32
from .offload import check_optimizer_for_offload
from .zero import build_param_state
from .pytree import PyTree, register_node

_FIELDS = ("params", "master", "opt_state", "loss_scale", "step", "skipped_steps", "samples", "rng_seed")
_FIELD_SET = frozenset(_FIELDS)


class DonatedStateError(RuntimeError):
    """A TrainState was used after it was donated to train_step."""


class TrainState:
    """The state of a training run (see the module docstring)."""

    __slots__ = _FIELDS + ("precision", "layout", "_donated_at")

    def __init__(
        self,
        params: Flat,
        master: Optional[Flat],
        opt_state: Any,
        loss_scale: LossScaleState,
        step: int = 0,
        skipped_steps: int = 0,
        samples: int = 0,
        rng_seed: int = 0,
        precision: Precision = fp32(),
        layout: Optional[Layout] = None,
    ):
        for name, value in zip(_FIELDS, (params, master, opt_state, loss_scale, step, skipped_steps, samples, rng_seed)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_donated_at", None)

    def __getattribute__(self, name: str):
        if name in _FIELD_SET:
            donated_at = object.__getattribute__(self, "_donated_at")
            if donated_at is not None:
                raise DonatedStateError(
                    f"this TrainState was donated to train_step at step {donated_at}; its buffers now "
                    "belong to the state that call returned. Use the returned state "
                    "(state, metrics = step(state, batch))."
                )
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        raise AttributeError("TrainState is immutable; use state.replace(field=value)")

    def replace(self, **changes: Any) -> "TrainState":
        unknown = set(changes) - _FIELD_SET
        if unknown:
            raise TypeError(f"TrainState has no field(s) {sorted(unknown)}; fields are {list(_FIELDS)}")
        values = {name: changes.get(name, getattr(self, name)) for name in _FIELDS}
        return TrainState(**values, precision=self.precision, layout=self.layout)

    def donate(self) -> None:
        """Mark this state as consumed (train_step calls this before reusing its buffers)."""
        step = self.step
        object.__setattr__(self, "_donated_at", step)

    @property
    def donated(self) -> bool:
        return object.__getattribute__(self, "_donated_at") is not None

    @property
    def master_params(self) -> Flat:
        """The fp32 weights the optimizer updates: the masters (a ZeRO slice or shard), or params in fp32."""
        return self.master if self.master is not None else self.params

    @property
    def lr(self) -> Optional[float]:
        """The learning rate the next optimizer step will use."""
        return learning_rate(self.opt_state)

    def __repr__(self) -> str:
        if self.donated:
            return f"TrainState(<donated at step {object.__getattribute__(self, '_donated_at')}>)"
        return (
            f"TrainState(step={self.step}, skipped_steps={self.skipped_steps}, samples={self.samples}, "
            f"params={self.params!r}, precision={self.precision.name}, loss_scale={self.loss_scale.scale:g})"
        )


register_node(
    TrainState,
    lambda s: (tuple(getattr(s, name) for name in _FIELDS), (s.precision, s.layout)),
    lambda aux, children: TrainState(*children, precision=aux[0], layout=aux[1]),
    child_names=lambda aux: _FIELDS,
)


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

    With a `plan` and a `mesh`, every rank keeps only its part (see `fspeed.zero`): its
    tensor-parallel slice and, by ZeRO stage, its slice or shard of masters, optimizer state and
    parameters. `params` are the full (global) parameters, identical on every rank;
    `logical_axes` (the model's) are needed for tensor slicing.
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be a GradientTransformation, got {type(optimizer).__name__}")
    if (plan is None) != (mesh is None):
        raise ValueError("init_train_state: pass both plan= and mesh= (or neither)")
    if plan is not None:
        layout = resolve(plan, params, mesh.sizes, mesh.coords, logical_axes)
        check_optimizer_for_layout(optimizer, layout)
        compute, master, target = build_param_state(params, layout, precision, device)
        return TrainState(params=compute, master=master, opt_state=optimizer.init(target),
                          loss_scale=init_loss_scale(precision.loss_scale), rng_seed=int(seed),
                          precision=precision, layout=layout)
    master = Flat.from_tree(params, dtype=torch.float32, device=device)
    compute = master.to(precision.param_dtype) if precision.has_master else master
    return TrainState(
        params=compute,
        master=master if precision.has_master else None,
        opt_state=optimizer.init(master),
        loss_scale=init_loss_scale(precision.loss_scale),
        rng_seed=int(seed),
        precision=precision,
    )


def _transform_names(opt: GradientTransformation) -> list[str]:
    info = opt.info
    if info is None:
        return []
    return [info.name] + [n for child in info.children for n in _transform_names(child)]


def check_optimizer_for_layout(optimizer: GradientTransformation, layout: Layout) -> None:
    """Refuse optimizers whose math needs whole tensors on a layout that splits them."""
    if "lamb" in _transform_names(optimizer) and (layout.stage >= 1 or layout.model_size > 1):
        raise ValueError(
            "lamb's per-tensor trust ratio needs whole tensors; it cannot run on ZeRO stage >= 1 slices or "
            "tensor-sliced parameters yet (DeepSpeed likewise rejects LAMB under ZeRO). Use adam/adamw/sgd, "
            "or zero stage 0 without tensor slicing."
        )
    if optimizer.gradient_allreduce is not None:
        check_self_communicating(optimizer, layout)
    check_optimizer_for_offload(_transform_names(optimizer), layout)


def check_self_communicating(optimizer: GradientTransformation, layout) -> None:
    """An optimizer that does its own data-parallel communication (1-bit family) needs whole,
    replicated buffers: ZeRO stage 0 without tensor slicing (DeepSpeed likewise asserts no ZeRO)."""
    if layout is not None and (layout.stage >= 1 or layout.model_size > 1):
        what = f"ZeRO stage {layout.stage}" if layout.stage >= 1 else f"tensor slicing over {layout.model_size} ranks"
        raise ValueError(
            f"{optimizer.info.name if optimizer.info else 'this optimizer'} compresses the data-parallel all-reduce of whole replicated buffers and cannot "
            f"run with {what}; allowed: zero stage 0 without tensor slicing (DeepSpeed's 1-bit optimizers are not "
            "compatible with ZeRO either). Use adam/adamw/lamb for ZeRO >= 1."
        )
