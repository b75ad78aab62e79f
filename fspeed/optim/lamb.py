"""LAMB with DeepSpeed FusedLamb's semantics.

Per parameter tensor:

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2          (raw moments, never bias-corrected)
    u = m / denom + wd * p,  denom = sqrt(v + eps) if eps_inside_sqrt else sqrt(v) + eps
    step = lr * sqrt(bc2) / bc1  (bias_correction)  else lr
    trust = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    p -= step * trust * u

Quirk matched: the trust ratio is computed from the raw-moment update `u`, not a bias-corrected
one; bias correction only enters through `step`. The last trust ratios are kept in the state
(DeepSpeed's `get_lamb_coeffs()`).

`backend` picks `apply`'s kernel: "auto" runs fspeed.kernels.cuda_lamb (three launches per flat
buffer: moments and per-tensor norm partials, trust ratios, update) on CUDA tensors when
numba-cuda is installed and the torch ops below elsewhere; "numba" demands the CUDA kernel;
"torch" always uses torch ops.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from ..flat import Flat, segments
from ..pytree import tensor_leaves, tree_leaves, tree_map, tree_zeros_like
from .adam import check_hparams
from .base import (
    Capabilities,
    GradientTransformation,
    ScalarOrSchedule,
    TransformInfo,
    cast_params_into,
    check_backend,
    numba_kernel,
    per_tensor_norms,
    resolve,
)
from .masks import Mask, masked_weight_decay

_KERNELS = {"cuda": "cuda_lamb"}


class LambState(NamedTuple):
    count: int
    lr: float
    mu: Any
    nu: Any
    trust_ratio: torch.Tensor  # per parameter tensor, from the last update


def lamb(
    lr: ScalarOrSchedule = 1e-3,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    backend: str = "auto",
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """LAMB (FusedLamb): Adam-style direction scaled per tensor by a clamped trust ratio.
    `backend`: "auto", "numba" or "torch" (see the module docstring). `mask(path)`: which
    parameters get weight decay (`fspeed.optim.masks`)."""
    check_hparams("lamb", lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    check_backend("lamb", backend)
    if not 0 < min_coeff <= max_coeff:
        raise ValueError(f"lamb: need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}")
    if mask is not None:
        unmasked = lamb(lr, b1, b2, eps, weight_decay, bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_coeff=max_coeff, min_coeff=min_coeff, backend=backend)
        return masked_weight_decay(unmasked, mask)

    def init(params):
        n = len(segments(params))
        return LambState(0, resolve(lr, 0), tree_zeros_like(params), tree_zeros_like(params), torch.ones(n))

    def moments_and_direction(grads, state: LambState, params, in_place: bool):
        b1_t = resolve(b1, state.count)
        if in_place:
            tree_map(lambda m, g: m.lerp_(g.to(m.dtype), 1.0 - b1_t), state.mu, grads)
            tree_map(lambda v, g: v.mul_(b2).addcmul_(g, g, value=1.0 - b2), state.nu, grads)
            mu, nu = state.mu, state.nu
        else:
            mu = tree_map(lambda m, g: m.lerp(g.to(m.dtype), 1.0 - b1_t), state.mu, grads)
            nu = tree_map(lambda v, g: v * b2 + (1.0 - b2) * g.to(v.dtype).square(), state.nu, grads)

        def direction(m, v, p):
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt().add_(eps)
            u = m / denom
            return u.add_(p, alpha=weight_decay) if weight_decay else u

        u = tree_map(direction, mu, nu, params)
        p_norm, u_norm = per_tensor_norms(params), per_tensor_norms(u)
        trust = torch.where(
            (p_norm > 0) & (u_norm > 0), (p_norm / u_norm).clamp(min_coeff, max_coeff), torch.ones_like(p_norm)
        )
        t = state.count + 1
        step = resolve(lr, state.count)
        if bias_correction:
            step *= math.sqrt(1.0 - b2**t) / (1.0 - b1_t**t)
        for seg, ratio in zip(segments(u), trust):
            seg.mul_(ratio * -step)
        new_state = LambState(t, resolve(lr, t), mu, nu, trust)
        return u, new_state

    def update(grads, state: LambState, params=None):
        if params is None:
            raise ValueError("lamb needs params in update() (the trust ratio uses ||p||)")
        return moments_and_direction(grads, state, params, in_place=False)

    def apply(grads, state: LambState, params, *, cast_to=None):
        kernel = numba_kernel("lamb", backend, _KERNELS, tensor_leaves(params))
        groups = list(zip(*(_buffers_with_sizes(x) for x in (params, grads, state.mu, state.nu))))
        if kernel is not None and (backend == "numba" or all(kernel.supports(*(b for b, _ in g)) for g in groups)):
            b1_t, t = resolve(b1, state.count), state.count + 1
            trust = [
                kernel.lamb_step(
                    p, g, m, v, sizes, lr=resolve(lr, state.count), beta1=b1_t, beta2=b2, eps=eps,
                    weight_decay=weight_decay, step=t, bias_correction=bias_correction,
                    eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff,
                )
                for (p, sizes), (g, _), (m, _), (v, _) in groups
            ]
            new_state = LambState(t, resolve(lr, t), state.mu, state.nu, torch.cat(trust))
        else:
            u, new_state = moments_and_direction(grads, state, params, in_place=True)
            tree_map(lambda p, d: p.add_(d), params, u)
        if cast_to is not None:
            cast_params_into(cast_to, params)
        return params, new_state

    info = TransformInfo(
        "lamb",
        dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
             eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff, backend=backend),
        factory=lamb,
    )
    return GradientTransformation(init, update, apply, info, capabilities=Capabilities(whole_tensors=True))


def _buffers_with_sizes(tree) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """(1-D buffer, sizes of the parameter tensors in it) per Flat or tensor leaf, in `segments` order."""
    out = []
    for leaf in tree_leaves(tree, is_leaf=lambda x: isinstance(x, Flat)):
        if isinstance(leaf, Flat):
            out.append((leaf.buffer, leaf.layout.sizes))
        elif isinstance(leaf, torch.Tensor):
            out.append((leaf.reshape(-1), (leaf.numel(),)))
    return out
