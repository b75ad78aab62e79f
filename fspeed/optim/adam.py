"""Adam and AdamW with DeepSpeed FusedAdam's semantics.

    L2 mode (adam_w_mode=False):  g += wd*p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
                                  p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
    AdamW mode (adam_w_mode=True): m, v as above without wd in g;
                                  p -= lr * ((m/bc1) / (sqrt(v/bc2) + eps) + wd*p)

with bc1 = 1 - b1^t, bc2 = 1 - b2^t, or 1 when `bias_correction=False`. When b1 is a schedule
(1Cycle momentum), bc1 uses the current b1, as FusedAdam does with its param group's betas.

`apply` is the fused path, one pass over memory per flat buffer (the CPU kernel takes many fp32
buffers in one pass: a parameter group's runs, or backward's own gradient tensors, `LooseGrads`,
which a parameter group hands on by runs too). `backend` picks its kernel:

    "auto"   Numba kernels where they exist (fspeed.kernels.cpu_adam on CPU tensors,
             fspeed.kernels.cuda_adam on CUDA tensors when numba-cuda is installed), torch elsewhere
    "numba"  the Numba kernel, or a clear error when it cannot run these tensors
    "torch"  one `torch._fused_adam(w)_` call over all buffers when bias correction is on;
             otherwise an in-place torch sequence

The CPU kernel reads bf16/fp16 gradients directly and writes `cast_to` in the same pass; the torch
path converts the gradients and casts after the update. `update` is the pure reference whatever
the backend.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import torch

from ..flat import LooseGrads, flat_list, is_loose, segments
from ..pytree import tensor_leaves, tree_map, tree_zeros_like
from .base import (
    ELEMENTWISE,
    GradientTransformation,
    ScalarOrSchedule,
    TransformInfo,
    cast_targets,
    check_backend,
    numba_kernel,
    resolve,
)
from .masks import Mask, masked_weight_decay


class AdamState(NamedTuple):
    count: int  # updates applied so far
    lr: float  # the lr the next update will use
    mu: Any  # first moment, same structure as params
    nu: Any  # second moment


_SCHEDULABLE = ("lr", "b1", "momentum")
_KERNELS = {"cpu": "cpu_adam", "cuda": "cuda_adam"}


def check_hparams(name: str, **values: Any) -> None:
    """Eager validation of the float hyperparameters shared by the Adam family.

    Only lr, b1 and momentum may be schedules; the others are used as numbers at every step.
    """
    for key, value in values.items():
        if value is None:
            continue
        schedulable = key in _SCHEDULABLE
        if callable(value):
            if not schedulable:
                raise TypeError(f"{name}: {key} must be a number, not a schedule (only lr, b1, momentum)")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            allowed = "a finite number or a schedule" if schedulable else "a finite number"
            raise TypeError(f"{name}: {key}={value!r} must be {allowed}")
        if key in ("b1", "b2", "momentum") and not 0.0 <= value < 1.0:
            raise ValueError(f"{name}: {key}={value} must be in [0, 1)")
        if key in ("lr", "weight_decay", "eps", "dampening") and value < 0:
            raise ValueError(f"{name}: {key}={value} must be >= 0")


def adam(
    lr: ScalarOrSchedule = 1e-3,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    adam_w_mode: bool = False,
    backend: str = "auto",
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """Adam; `adam_w_mode=True` makes weight decay decoupled (AdamW). `backend`: "auto", "numba"
    or "torch" (see the module docstring). `mask(path)`: which parameters get weight decay
    (`fspeed.optim.masks`; e.g. `no_decay("bias", "norm")`).

    DeepSpeed gotcha: its config type "Adam" defaults to adam_w_mode=True (AdamW). fspeed's `adam`
    defaults to classic L2 Adam; the DeepSpeed-config translator applies DeepSpeed's default.
    """
    name = "adamw" if adam_w_mode else "adam"
    check_hparams(name, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    check_backend(name, backend)
    if mask is not None:
        unmasked = adam(lr, b1, b2, eps, weight_decay, bias_correction=bias_correction, adam_w_mode=adam_w_mode,
                        backend=backend)
        return masked_weight_decay(unmasked, mask)

    def init(params):
        return AdamState(0, resolve(lr, 0), tree_zeros_like(params), tree_zeros_like(params))

    def hparams(count: int) -> tuple[float, float, float, float]:
        lr_t, b1_t = resolve(lr, count), resolve(b1, count)
        t = count + 1
        bc1 = 1.0 - b1_t**t if bias_correction else 1.0
        bc2 = 1.0 - b2**t if bias_correction else 1.0
        return lr_t, b1_t, bc1, bc2

    def update(grads, state: AdamState, params=None):
        lr_t, b1_t, bc1, bc2 = hparams(state.count)
        if weight_decay and params is None:
            raise ValueError(f"{name} with weight_decay needs params in update()")
        if weight_decay and not adam_w_mode:
            grads = tree_map(lambda g, p: g + weight_decay * p, grads, params)
        mu = tree_map(lambda m, g: m.lerp(g.to(m.dtype), 1.0 - b1_t), state.mu, grads)
        nu = tree_map(lambda v, g: v * b2 + (1.0 - b2) * g.to(v.dtype).square(), state.nu, grads)

        def direction(m, v, p):
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            if weight_decay and adam_w_mode:
                u = u + weight_decay * p
            return -lr_t * u

        if params is None:
            updates = tree_map(lambda m, v: direction(m, v, None), mu, nu)
        else:
            updates = tree_map(direction, mu, nu, params)
        return updates, AdamState(state.count + 1, resolve(lr, state.count + 1), mu, nu)

    def apply(grads, state: AdamState, params, *, cast_to=None, grad_sq=None):
        lr_t, b1_t, bc1, bc2 = hparams(state.count)
        hp = dict(lr=lr_t, beta1=b1_t, beta2=b2, eps=eps, weight_decay=weight_decay, step=state.count + 1,
                  adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        _fused_step(name, backend, grads, params, state.mu, state.nu, hp, bc1, bc2, cast_to, grad_sq)
        return params, AdamState(state.count + 1, resolve(lr, state.count + 1), state.mu, state.nu)

    info = TransformInfo(
        name,
        dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
             backend=backend),
        factory=functools.partial(adam, adam_w_mode=adam_w_mode),
    )
    return GradientTransformation(init, update, apply, info,
                                  capabilities=ELEMENTWISE._replace(loose_grads=True, sums_grad_squares=True))


def _fused_step(name: str, backend: str, grads: Any, params: Any, mu: Any, nu: Any, hp: dict, bc1: float,
                bc2: float, cast_to: Any, grad_sq: Optional[list]) -> None:
    """One Adam step in place over `params`, `mu` and `nu` (flat buffers, a group's runs of them, or
    with backward's own gradient tensors): the Numba kernels where they take the tensors, torch's
    path for the rest (module docstring). `hp`: the kernels' hyperparameters for this step."""
    loose = is_loose(grads)
    if loose and cast_to is None and _loose_in_one_pass(name, backend, grads, params, mu, nu, hp, grad_sq):
        return
    if loose:  # backward's own tensors: the buffers' per-parameter views match them
        p, g, m, v = segments(params), segments(grads), segments(mu), segments(nu)
        c = segments(cast_to) if cast_to is not None else [None] * len(p)
    else:
        p, g, m, v = (tensor_leaves(x) for x in (params, grads, mu, nu))
        c = cast_targets(cast_to, p) if cast_to is not None else [None] * len(p)
    # many tensors (a group's runs, loose gradients): the CPU kernel takes them in one pass
    # (adam_step_runs: as fast as torch's multi-tensor launch; 8.3 against 8.7 ms alone on a
    # GPT-2's 76 tensors, the same within noise in its training step)
    kernel = numba_kernel(name, backend, _KERNELS, p)
    rest = []  # (p, g, m, v, cast) groups for the torch path
    runs = []  # fp32 groups the kernel takes in one pass (a group's runs, loose gradients)
    cpu_kernel = hasattr(kernel, "adam_step_runs")  # (the CUDA kernel has no runs pass)
    many = len(p) > 1 and cpu_kernel
    # grad_sq: the CPU kernels sum the squared gradients in the update's own pass; the other
    # paths take the sum separately
    sums = grad_sq is not None and cpu_kernel
    squared = dict(grad_sq=grad_sq) if sums else {}
    unsummed = []  # gradients whose squares no kernel sums (the CUDA kernel, torch's path)
    for group in zip(p, g, m, v, c):
        if many and group[4] is None and kernel.supports_runs(*group[:4]):
            runs.append(group[:4])
        elif kernel is not None and (backend == "numba" or kernel.supports(*group)):
            kernel.adam_step(*group[:4], **hp, cast_out=group[4], **squared)
            if not sums:
                unsummed.append(group[1])
        else:
            rest.append(group)
            unsummed.append(group[1])
    if grad_sq is not None and unsummed:  # read before torch's path below (which may cast them)
        grad_sq.extend(float(n.double().square()) for n in torch._foreach_norm(unsummed))
    if len(runs) == 1:
        kernel.adam_step(*runs[0], **hp, **squared)
    elif runs:
        kernel.adam_step_runs(*map(list, zip(*runs)), **hp, checked=True, **squared)
    if rest:
        _torch_adam(*map(list, zip(*rest)), hp["step"], hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
                    hp["weight_decay"], hp["adam_w_mode"], hp["bias_correction"], bc1, bc2)


def _loose_in_one_pass(name: str, backend: str, grads: Any, params: Any, mu: Any, nu: Any, hp: dict,
                       grad_sq: Optional[list]) -> bool:
    """Loose gradients over flat buffers (or a group's runs of them) in the CPU kernel's one pass,
    whose runs follow from the gradients' sizes (`adam_step_loose`); False where it does not apply."""
    runs = [grads] if isinstance(grads, LooseGrads) else grads
    flats = [flat_list(x) for x in (params, mu, nu)]
    if not all(f is not None and len(f) == len(runs) for f in flats):
        return False
    p, m, v = ([f.buffer for f in run_flats] for run_flats in flats)
    kernel = numba_kernel(name, backend, _KERNELS, p[:1])
    return bool(hasattr(kernel, "adam_step_loose") and kernel.adam_step_loose(
        p, [g.tensors for g in runs], m, v, **hp, grad_sq=grad_sq))


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    bias_correction: bool = True,
    backend: str = "auto",
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """AdamW: Adam with decoupled weight decay (DeepSpeed's adam_w_mode=True); `mask` as in `adam`."""
    return adam(lr, b1, b2, eps, weight_decay, bias_correction=bias_correction, adam_w_mode=True, backend=backend,
                mask=mask)


def _torch_adam(p, g, m, v, cast, t, lr, b1, b2, eps, wd, decoupled, bias_correction, bc1, bc2) -> None:
    """The torch path of `apply` over lists of tensors, then the cast into `cast` (None entries skipped)."""
    g = [gi if gi.dtype == pi.dtype else gi.to(pi.dtype) for gi, pi in zip(g, p)]
    if bias_correction and _has_fused(p):
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        step = torch.tensor(float(t), device=p[0].device)
        fused(p, g, m, v, [], [step] * len(p), lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
              amsgrad=False, maximize=False)
    else:
        for pi, gi, mi, vi in zip(p, g, m, v):
            _adam_in_place(pi, gi, mi, vi, lr, b1, b2, eps, wd, decoupled, bc1, bc2)
    for ci, pi in zip(cast, p):
        if ci is not None:
            ci.copy_(pi)


def _has_fused(tensors: list[torch.Tensor]) -> bool:
    if not tensors or not hasattr(torch, "_fused_adam_"):
        return False
    first = tensors[0]
    return first.device.type in ("cpu", "cuda") and all(
        t.device == first.device and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        for t in tensors
    )


def _adam_in_place(p, g, m, v, lr, b1, b2, eps, wd, decoupled, bc1, bc2) -> None:
    if wd and not decoupled:
        g = g.add(p, alpha=wd)
    m.lerp_(g, 1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    if wd and decoupled:
        p.mul_(1.0 - lr * wd)
    p.addcdiv_(m, denom, value=-lr / bc1)
