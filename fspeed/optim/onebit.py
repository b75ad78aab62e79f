"""1-bit Adam and 0/1 Adam: Adam whose data-parallel communication is an error-feedback 1-bit
all-reduce (`fspeed.compressed_allreduce`), with DeepSpeed's phases (OnebitAdam, ZeroOneAdam in
deepspeed/runtime/fp16/onebit/). No bias correction anywhere; weight decay is decoupled
(`p -= lr * (m / (sqrt(v) + eps) + wd * p)`), as in DeepSpeed.

1-bit Adam, update number t (1-based):

    t <= freeze_step   warmup: the runtime all-reduces the gradient in full precision; plain Adam.
    t >  freeze_step   v frozen; m = b1 m + (1-b1) g_local; m = compressed_allreduce(m); same update.

0/1 Adam:

    phase A (t <= var_freeze_step + 1): when t % var_interval == 0 the gradient was all-reduced in
        full precision and both m and v update; otherwise m updates from the 1-bit all-reduced
        local gradient. Every variance update counts; after var_update_scaler of them var_interval
        doubles. After step var_freeze_step + 1 the error buffers are zeroed once.
    phase B (t > var_freeze_step + 1): local steps on the local gradient, accumulating the drift
        acc -= lr * u; every local_step_interval steps the drift is undone, 1-bit all-reduced in
        momentum units and re-applied (m = -acc / sum(lr)). Every local_step_scaler steps the
        interval doubles, up to local_step_clipper.

Deliberate differences from DeepSpeed, all documented in `onebit_adam`'s docstring: no dummy first
step (DeepSpeed's first `step()` only warms communication buffers and discards that gradient, so
its warmup has freeze_step - 1 updates; here it has freeze_step); error buffers are state leaves
and survive checkpoints (DeepSpeed drops them on load); 0/1 Adam in one process uses the local
gradient on non-variance steps (DeepSpeed's world-of-1 path skips the momentum update there).
As in DeepSpeed, a world of one rank does no compression (there is nothing to communicate).
`exp_avg_mask` (DeepSpeed's param-group key) is `exp_avg_mask={path: 0/1 tensor}`: it multiplies
the momentum after each compressed all-reduce (0/1 Adam: whatever was all-reduced, only with
several ranks, as DeepSpeed), so entries whose gradient is always exactly zero (padding rows of
an embedding) stay zero; 1-bit compression cannot represent zero, and without the mask their
error would keep accumulating.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from ..compressed_allreduce import CompressionPlan, compressed_allreduce, padded_numel
from ..flat import Flat, segments
from ..pytree import tree_flatten_with_paths, tree_leaves, tree_map, tree_zeros_like
from .adam import check_hparams
from .base import Capabilities, GradientTransformation, ScalarOrSchedule, TransformInfo, cast_params_into, resolve


class OneBitAdamState(NamedTuple):
    count: int  # updates applied so far
    lr: float  # the lr the next update will use
    mu: Any
    nu: Any  # frozen after freeze_step
    worker_error: torch.Tensor  # [sum of padded segment sizes]: this rank's compression error
    server_error: torch.Tensor  # [that / world]: the error of the chunk this rank serves


class ZeroOneAdamState(NamedTuple):
    count: int
    lr: float
    mu: Any
    nu: Any
    momentum_accumulator: Any  # phase B's local drift (DeepSpeed's comm buffer)
    lrs: float  # sum of the lrs of the local steps since the last sync
    var_interval: int
    var_counter: int
    local_step_interval: int
    local_step_counter: int
    worker_error: torch.Tensor
    server_error: torch.Tensor


# ------------------------------------------------------------------------------ shared helpers


def resolve_world(world_size: Optional[int], name: str, data_size: Optional[int] = None) -> int:
    """The data-parallel size the error buffers are sized for: `world_size` when given, else the
    mesh's data axis size that `init_train_state` passes to `init(params, data_size=)`, else 1."""
    if world_size is None:
        return 1 if data_size is None else int(data_size)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{name}: world_size={world_size!r} must be a positive integer or None")
    if data_size is not None and data_size != world_size:
        raise ValueError(f"{name}: world_size={world_size} does not match the mesh's data axis of {data_size} ranks")
    return world_size


def error_buffers(sizes: list[int], world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker_error, server_error) for segments of `sizes` on `world` ranks."""
    total = sum(padded_numel(s, world) for s in sizes)
    return torch.zeros(total, device=device), torch.zeros(total // world, device=device)


def state_world(worker_error: torch.Tensor, server_error: torch.Tensor) -> int:
    return worker_error.numel() // server_error.numel() if server_error.numel() else 1


def check_comm(name: str, world: int, comm) -> int:
    """The axis size, checked against the world the state was built for."""
    size = 1 if comm is None else comm.size
    if size != world:
        raise ValueError(
            f"{name}: the optimizer state was built for a data-parallel size of {world} (its error buffers), "
            f"but this step runs on {size} rank(s){'' if comm is not None else ' (no comm= given)'}; build the "
            "state with world_size= matching the mesh's data axis"
        )
    return size


class FlatView(NamedTuple):
    """A tree's parameter segments as one 1-D tensor: a view of its buffer when the tree is one Flat,
    otherwise a copy that `write_back` returns into the tree."""

    flat: torch.Tensor
    tree: Any
    is_view: bool

    def write_back(self) -> None:
        if not self.is_view:
            segs = segments(self.tree)
            torch._foreach_copy_(segs, [s.view_as(t) for s, t in zip(self.flat.split([t.numel() for t in segs]), segs)])


def flat_view(tree: Any) -> FlatView:
    leaves = tree_leaves(tree, is_leaf=lambda x: isinstance(x, Flat))
    if len(leaves) == 1 and isinstance(leaves[0], Flat):
        return FlatView(leaves[0].buffer.narrow(0, 0, leaves[0].numel), tree, True)
    segs = segments(tree)
    flat = torch.cat([s.reshape(-1) for s in segs]) if segs else torch.zeros(0)
    return FlatView(flat, tree, False)


def segment_sizes(tree: Any) -> list[int]:
    return [s.numel() for s in segments(tree)]


def onebit_allreduce(flat: torch.Tensor, state_errors: tuple[torch.Tensor, torch.Tensor], plan: CompressionPlan,
                     comm) -> torch.Tensor:
    """`flat` (unpadded segments back to back) replaced in place by its 1-bit all-reduced mean."""
    padded = compressed_allreduce(plan.pad(flat), state_errors[0], state_errors[1], plan, comm)
    return flat.copy_(plan.unpad(padded))


def plan_cache() -> Callable[[tuple[int, ...], int], CompressionPlan]:
    """A per-optimizer memo of compression plans (their index tensors are built once)."""
    plans: dict = {}

    def plan_for(sizes: tuple[int, ...], world: int) -> CompressionPlan:
        key = (sizes, world)
        if key not in plans:
            plans.clear()
            plans[key] = CompressionPlan(sizes, world)
        return plans[key]

    return plan_for


def momentum_mask(name: str, exp_avg_mask: Optional[dict]) -> Callable[[Any, torch.Tensor], None]:
    """`exp_avg_mask` ({parameter path: 0/1 tensor broadcastable to its shape}) as an in-place
    `mask_(params, flat_momentum)`: multiplies by the flat mask (ones where no mask is given),
    built once per layout; does nothing without masks."""
    if not exp_avg_mask:
        return lambda params, flat: None
    if not isinstance(exp_avg_mask, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                     for k, v in exp_avg_mask.items()):
        raise TypeError(f"{name}: exp_avg_mask must be a dict {{parameter path: tensor}}, got "
                        f"{type(exp_avg_mask).__name__}")
    built: dict = {}

    def flat_mask(paths: tuple, shapes: tuple, like: torch.Tensor) -> torch.Tensor:
        unknown = sorted(set(exp_avg_mask) - set(paths))
        if unknown:
            raise ValueError(f"{name}: exp_avg_mask names parameters that do not exist: {unknown[:4]}; "
                             f"parameter paths look like {list(paths[:4])}")
        pieces = []
        for path, shape in zip(paths, shapes):
            mask = exp_avg_mask.get(path)
            if mask is None:
                pieces.append(torch.ones(shape, dtype=like.dtype, device=like.device).reshape(-1))
                continue
            try:
                pieces.append(torch.broadcast_to(mask.to(like), shape).reshape(-1))
            except RuntimeError:
                raise ValueError(f"{name}: exp_avg_mask[{path!r}] has shape {list(mask.shape)}, which does "
                                 f"not broadcast to the parameter's {list(shape)}") from None
        return torch.cat(pieces)

    def mask_(params: Any, flat: torch.Tensor) -> None:
        if isinstance(params, Flat):
            paths, shapes = params.layout.paths, params.layout.shapes
        else:
            paths, leaves, _ = tree_flatten_with_paths(params)
            shapes = tuple(tuple(x.shape) for x in leaves)
        key = (tuple(paths), tuple(shapes), flat.dtype, flat.device)
        if key not in built:
            built.clear()
            built[key] = flat_mask(tuple(paths), tuple(shapes), flat)
        flat.mul_(built[key])

    return mask_


def pure_update(apply: Callable) -> Callable:
    """The pure `update` of an optimizer whose implementation is its in-place `apply`: runs it on
    copies and returns params' change as the updates."""

    def update(grads, state, params=None, *, comm=None):
        if params is None:
            raise ValueError("the 1-bit optimizers need params in update()")
        copy = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
        new_params, new_state = apply(tree_map(copy, grads), tree_map(copy, state), tree_map(copy, params), comm=comm)
        return tree_map(lambda n, p: n - p, new_params, params), new_state

    return update


def check_step_count(name: str, key: str, value: Any, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: {key}={value!r} must be an integer >= {minimum}")


def _adam_denominator(nu: torch.Tensor, eps: float) -> torch.Tensor:
    return nu.sqrt().add_(eps)


def _adamw_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, eps: float, wd: float) -> None:
    """p -= lr * (m / (sqrt(v) + eps) + wd * p), with the op order of fspeed's adamw (bias_correction=False)."""
    denom = _adam_denominator(v, eps)
    if wd:
        p.mul_(1.0 - lr * wd)
    p.addcdiv_(m, denom, value=-lr)


# ------------------------------------------------------------------------------ 1-bit Adam


def onebit_adam(
    lr: ScalarOrSchedule = 1e-3,
    freeze_step: int = 100000,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    world_size: Optional[int] = None,
    exp_avg_mask: Optional[dict] = None,
) -> GradientTransformation:
    """1-bit Adam (DeepSpeed OnebitAdam): `freeze_step` warmup updates of plain Adam (no bias
    correction, full-precision all-reduce), then frozen variance and a 1-bit error-feedback
    all-reduce of the momentum, per parameter tensor.

    `world_size`: the data-parallel size the error buffers are sized for (default: the mesh's
    data axis, which `init_train_state` passes to `init`; 1 without a mesh). `exp_avg_mask`:
    {parameter path: 0/1 tensor}, multiplied into the momentum after each compressed all-reduce
    (DeepSpeed's param-group key). See the module docstring for what differs from DeepSpeed.
    """
    name = "onebit_adam"
    check_hparams(name, lr=lr, b2=b2, eps=eps, weight_decay=weight_decay)
    _check_b1(name, b1)
    check_step_count(name, "freeze_step", freeze_step)
    plan_for = plan_cache()
    mask_momentum = momentum_mask(name, exp_avg_mask)

    def init(params, *, data_size=None):
        world = resolve_world(world_size, name, data_size)
        worker, server = error_buffers(segment_sizes(params), world, _device(params))
        return OneBitAdamState(0, resolve(lr, 0), tree_zeros_like(params), tree_zeros_like(params), worker, server)

    def gradient_allreduce(state: OneBitAdamState) -> bool:
        return state.count < freeze_step

    def apply(grads, state: OneBitAdamState, params, *, cast_to=None, comm=None):
        world = check_comm(name, state_world(state.worker_error, state.server_error), comm)
        lr_t, t = resolve(lr, state.count), state.count + 1
        p, g, m, v = (flat_view(x) for x in (params, grads, state.mu, state.nu))
        grad = g.flat if g.flat.dtype == m.flat.dtype else g.flat.to(m.flat.dtype)
        m.flat.lerp_(grad, 1.0 - b1)
        if t <= freeze_step:
            v.flat.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        else:
            if world > 1:
                plan = plan_for(tuple(segment_sizes(params)), world)
                onebit_allreduce(m.flat, (state.worker_error, state.server_error), plan, comm)
            mask_momentum(params, m.flat)
        _adamw_update(p.flat, m.flat, v.flat, lr_t, eps, weight_decay)
        for view in (p, m, v):
            view.write_back()
        if cast_to is not None:
            cast_params_into(cast_to, params)
        return params, state._replace(count=t, lr=resolve(lr, t))

    info = TransformInfo(name, dict(lr=lr, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                    **masked_paths(exp_avg_mask)))
    return GradientTransformation(init, pure_update(apply), apply, info, gradient_allreduce,
                                  Capabilities(elementwise=True, communicates=True))


def masked_paths(exp_avg_mask: Optional[dict]) -> dict:
    """For TransformInfo: the masked parameter paths (not the tensors), only when there are some."""
    return {"exp_avg_mask": sorted(exp_avg_mask)} if exp_avg_mask else {}


# ------------------------------------------------------------------------------ 0/1 Adam


def zero_one_adam(
    lr: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    world_size: Optional[int] = None,
    exp_avg_mask: Optional[dict] = None,
) -> GradientTransformation:
    """0/1 Adam (DeepSpeed ZeroOneAdam): variance updated on an exponentially sparser schedule
    until `var_freeze_step`, 1-bit all-reduced gradients in between, then local steps with a 1-bit
    synchronisation every `local_step_interval` steps (module docstring). DeepSpeed's defaults,
    including local_step_scaler=32678 (sic). `exp_avg_mask` multiplies the result of every 1-bit
    all-reduce (the gradient in phase A, the momentum drift in phase B), as DeepSpeed does."""
    name = "zero_one_adam"
    check_hparams(name, lr=lr, b2=b2, eps=eps, weight_decay=weight_decay)
    _check_b1(name, b1)
    check_step_count(name, "var_freeze_step", var_freeze_step)
    for key, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                       ("local_step_clipper", local_step_clipper)):
        check_step_count(name, key, value, minimum=1)
    plan_for = plan_cache()
    mask_momentum = momentum_mask(name, exp_avg_mask)

    def init(params, *, data_size=None):
        world = resolve_world(world_size, name, data_size)
        worker, server = error_buffers(segment_sizes(params), world, _device(params))
        return ZeroOneAdamState(0, resolve(lr, 0), tree_zeros_like(params), tree_zeros_like(params),
                                tree_zeros_like(params), 0.0, 1, 0, 1, 0, worker, server)

    def gradient_allreduce(state: ZeroOneAdamState) -> bool:
        return zero_one_full_allreduce(state, var_freeze_step)

    def apply(grads, state: ZeroOneAdamState, params, *, cast_to=None, comm=None):
        world = check_comm(name, state_world(state.worker_error, state.server_error), comm)
        errors = (state.worker_error, state.server_error)
        lr_t, t = resolve(lr, state.count), state.count + 1
        p, g, m, v, acc = (flat_view(x) for x in (params, grads, state.mu, state.nu, state.momentum_accumulator))
        grad = g.flat if g.flat.dtype == m.flat.dtype else g.flat.to(m.flat.dtype)

        def allreduced(flat: torch.Tensor) -> torch.Tensor:
            if world > 1:
                onebit_allreduce(flat, errors, plan_for(tuple(segment_sizes(params)), world), comm)
                mask_momentum(params, flat)
            return flat

        lrs = state.lrs
        if t <= var_freeze_step + 1:  # phase A
            if t % state.var_interval == 0:
                v.flat.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                m.flat.lerp_(grad, 1.0 - b1)
            else:
                m.flat.lerp_(allreduced(grad.clone()), 1.0 - b1)
            _adamw_update(p.flat, m.flat, v.flat, lr_t, eps, weight_decay)
        else:  # phase B: local steps
            m.flat.lerp_(grad, 1.0 - b1)
            lrs += lr_t
            denom = _adam_denominator(v.flat, eps)
            u = m.flat / denom
            if weight_decay:
                u.add_(p.flat, alpha=weight_decay)
            p.flat.add_(u, alpha=-lr_t)
            acc.flat.add_(u, alpha=-lr_t)
            if t % state.local_step_interval == 0:
                p.flat.sub_(acc.flat)
                allreduced(acc.flat.mul_(denom))
                torch.div(acc.flat, -lrs, out=m.flat)
                p.flat.add_(acc.flat / denom)
                acc.flat.zero_()
                lrs = 0.0
        counters = zero_one_counters(state, t, var_freeze_step, var_update_scaler, local_step_scaler,
                                     local_step_clipper)
        if t == var_freeze_step + 1:  # the last phase-A step: errors will now compress momentum drift
            for e in errors:
                e.zero_()
        for view in (p, m, v, acc):
            view.write_back()
        if cast_to is not None:
            cast_params_into(cast_to, params)
        return params, state._replace(count=t, lr=resolve(lr, t), lrs=lrs, **counters)

    info = TransformInfo(name, dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                    var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                                    local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper,
                                    **masked_paths(exp_avg_mask)))
    return GradientTransformation(init, pure_update(apply), apply, info, gradient_allreduce,
                                  Capabilities(elementwise=True, communicates=True))


def zero_one_full_allreduce(state: ZeroOneAdamState, var_freeze_step: int) -> bool:
    """Whether 0/1 Adam's next step (count + 1) updates the variance from a full-precision all-reduce."""
    t = state.count + 1
    return t <= var_freeze_step + 1 and t % state.var_interval == 0


def zero_one_counters(state: ZeroOneAdamState, t: int, var_freeze_step: int, var_update_scaler: int,
                      local_step_scaler: int, local_step_clipper: int) -> dict[str, int]:
    """0/1 Adam's interval bookkeeping at the end of step t (DeepSpeed ZeroOneAdam.step)."""
    var_interval, var_counter = state.var_interval, state.var_counter
    local_interval, local_counter = state.local_step_interval, state.local_step_counter
    if t <= var_freeze_step + 1:
        if t % var_interval == 0:
            var_counter += 1
            if var_counter == var_update_scaler:
                var_counter, var_interval = 0, var_interval * 2
    else:
        local_counter += 1
        if local_counter == local_step_scaler:
            local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    return dict(var_interval=var_interval, var_counter=var_counter, local_step_interval=local_interval,
                local_step_counter=local_counter)


def _check_b1(name: str, b1: Any) -> None:
    if callable(b1):
        raise TypeError(f"{name}: b1 must be a number (the 1-bit optimizers take no beta1 schedule)")
    check_hparams(name, b1=b1)


def _device(tree: Any) -> torch.device:
    segs = segments(tree)
    return segs[0].device if segs else torch.device("cpu")


__all__ = ["OneBitAdamState", "ZeroOneAdamState", "onebit_adam", "zero_one_adam"]
