"""1-bit LAMB (DeepSpeed OnebitLamb, deepspeed/runtime/fp16/onebit/lamb.py): LAMB whose
compression stage freezes the trust coefficient and 1-bit all-reduces all momenta together.

Update number t (1-based), per parameter tensor j, no bias correction:

    t <= freeze_step   warmup, full-precision all-reduced gradient: LAMB (fspeed `lamb`,
        bias_correction=False). Every trust ratio c != 1 feeds an EMA:
        coeff_freeze = coeff_beta * coeff_freeze + (1 - coeff_beta) * c. At t == freeze_step the
        variance is copied into v_fresh.
    t >  freeze_step   v frozen. On the first such step, scaling_j = mean_k(r_k) / r_j with r_j the
        RMS of m_j (equalises the tensors before one fused compression). Then, with the local g:
        m_j = (b1 m_j + (1-b1) g_j) * scaling_j; one 1-bit all-reduce of all momenta flattened
        together (padded with a persistent tail, as DeepSpeed's dummy buffer); m_j /= scaling_j;
        g^ = (m_j - b1 m_prev_j) / (1-b1); v_fresh = b2 v_fresh + (1-b2) g^2;
        u' = m / (sqrt(v) + eps); u = u' + wd p;
        factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps)); with wd > 0, r = min(1, ||u'||/||u||)
        and factor = factor r + (1 - r); clamp to [factor_min, factor_max], then to
        last_factor * (1 -+ factor_threshold); p -= lr * coeff_freeze * factor * u.

Differences from DeepSpeed: no dummy first step (see `fspeed.optim.onebit`); a tensor whose
momentum is exactly zero at the freeze gets scaling 1 (DeepSpeed divides by zero); error buffers,
scaling coefficients and the padding tail are state leaves and survive checkpoints (DeepSpeed
resets the errors on load). One process does no compression, as in DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from ..compressed_allreduce import compressed_allreduce, padded_numel
from ..pytree import tree_zeros_like
from .adam import check_hparams
from .base import Capabilities, GradientTransformation, ScalarOrSchedule, TransformInfo, cast_params_into, per_tensor_norms, resolve
from .onebit import (
    _check_b1, _device, check_comm, check_step_count, flat_view, masked_paths, momentum_mask, plan_cache,
    pure_update, resolve_world, segment_sizes, state_world,
)


class OneBitLambState(NamedTuple):
    count: int
    lr: float
    mu: Any
    nu: Any  # frozen after freeze_step
    nu_fresh: Any  # the variance the compression stage keeps tracking (from reconstructed gradients)
    coeff_freeze: torch.Tensor  # [tensors] float64: EMA of the warmup trust ratios
    last_factor: torch.Tensor  # [tensors] float64
    scaling_coeff: torch.Tensor  # [tensors] float64, set on the first compression step
    lamb_coeffs: torch.Tensor  # [tensors]: the coefficients of the last update (get_lamb_coeffs)
    momentum_tail: torch.Tensor  # the padding of the fused momentum buffer (persistent, as DeepSpeed's)
    worker_error: torch.Tensor
    server_error: torch.Tensor


def onebit_lamb(
    lr: ScalarOrSchedule = 1e-3,
    freeze_step: int = 100000,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    world_size: Optional[int] = None,
    exp_avg_mask: Optional[dict] = None,
) -> GradientTransformation:
    """1-bit LAMB (module docstring). `world_size` and `exp_avg_mask` as in `onebit_adam` (the mask
    multiplies the momentum once it is unscaled after the compressed all-reduce, as in DeepSpeed)."""
    name = "onebit_lamb"
    check_hparams(name, lr=lr, b2=b2, eps=eps, weight_decay=weight_decay)
    _check_b1(name, b1)
    check_step_count(name, "freeze_step", freeze_step)
    if not 0 < min_coeff <= max_coeff:
        raise ValueError(f"{name}: need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}")
    if not 0 < factor_min <= factor_max:
        raise ValueError(f"{name}: need 0 < factor_min <= factor_max, got factor_min={factor_min}, "
                         f"factor_max={factor_max}")
    if not 0 <= coeff_beta < 1:
        raise ValueError(f"{name}: coeff_beta={coeff_beta} must be in [0, 1)")
    if not 0 <= factor_threshold < 1:
        raise ValueError(f"{name}: factor_threshold={factor_threshold} must be in [0, 1)")
    plan_for = plan_cache()
    mask_momentum = momentum_mask(name, exp_avg_mask)

    def init(params, *, data_size=None):
        world = resolve_world(world_size, name, data_size)
        sizes = segment_sizes(params)
        numel, device, n = sum(sizes), _device(params), len(sizes)
        padded = padded_numel(numel, world)
        f64 = dict(dtype=torch.float64, device=device)
        return OneBitLambState(
            0, resolve(lr, 0), tree_zeros_like(params), tree_zeros_like(params), tree_zeros_like(params),
            torch.zeros(n, **f64), torch.ones(n, **f64), torch.ones(n, **f64), torch.ones(n, device=device),
            torch.zeros(padded - numel, device=device), torch.zeros(padded, device=device),
            torch.zeros(padded // world, device=device),
        )

    def gradient_allreduce(state: OneBitLambState) -> bool:
        return state.count < freeze_step

    def apply(grads, state: OneBitLambState, params, *, cast_to=None, comm=None):
        world = check_comm(name, state_world(state.worker_error, state.server_error), comm)
        lr_t, t = resolve(lr, state.count), state.count + 1
        sizes = segment_sizes(params)
        p, g, m, v, vf = (flat_view(x) for x in (params, grads, state.mu, state.nu, state.nu_fresh))
        grad = g.flat if g.flat.dtype == m.flat.dtype else g.flat.to(m.flat.dtype)
        if t <= freeze_step:
            m.flat.lerp_(grad, 1.0 - b1)
            v.flat.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
            if t == freeze_step:
                vf.flat.copy_(v.flat)
            u = m.flat / v.flat.sqrt().add_(eps)
            if weight_decay:
                u.add_(p.flat, alpha=weight_decay)
            coeffs = trust_ratios(per_tensor_norms(params), per_tensor_norms(_segments_of(u, sizes)),
                                  min_coeff, max_coeff)
            changed = coeffs != 1.0
            state.coeff_freeze.copy_(torch.where(
                changed, coeff_beta * state.coeff_freeze + (1 - coeff_beta) * coeffs.double(), state.coeff_freeze))
            step_scale = coeffs * -lr_t
            scaling, last_factor = state.scaling_coeff, state.last_factor
        else:
            m_prev = m.flat.clone()
            scaling = state.scaling_coeff
            if t == freeze_step + 1:
                scaling = momentum_scaling(per_tensor_norms(_segments_of(m_prev, sizes)), sizes).to(scaling)
                state.scaling_coeff.copy_(scaling)
            scale_elems = _expand(scaling.float(), sizes)
            m.flat.lerp_(grad, 1.0 - b1).mul_(scale_elems)
            if world > 1:
                plan = plan_for((len(m.flat),), world)
                fused = torch.cat([m.flat, state.momentum_tail])
                out = compressed_allreduce(fused, state.worker_error, state.server_error, plan, comm)
                m.flat.copy_(out[: m.flat.numel()])
                state.momentum_tail.copy_(out[m.flat.numel():])
            m.flat.div_(scale_elems)
            mask_momentum(params, m.flat)
            reconstructed = (m.flat - m_prev * b1) / (1 - b1)
            vf.flat.mul_(b2).addcmul_(reconstructed, reconstructed, value=1 - b2)
            denom = v.flat.sqrt().add_(eps)
            prelim = m.flat / denom
            u = prelim + weight_decay * p.flat if weight_decay else prelim.clone()
            ratio = torch.stack(torch._foreach_max(_segments_of(denom / vf.flat.sqrt().add_(eps), sizes))).double()
            if weight_decay:
                norms_u = per_tensor_norms(_segments_of(u, sizes)).double()
                norms_prelim = per_tensor_norms(_segments_of(prelim, sizes)).double()
                update_ratio = torch.clamp(norms_prelim / norms_u, max=1.0)
                ratio = ratio * update_ratio + (1.0 - update_ratio)
            last_factor = frozen_factor(ratio, state.last_factor, factor_min, factor_max, factor_threshold)
            state.last_factor.copy_(last_factor)
            coeffs = state.coeff_freeze * last_factor
            step_scale = (coeffs * -lr_t).float()
        u.mul_(_expand(step_scale, sizes))
        p.flat.add_(u)
        state.lamb_coeffs.copy_(coeffs)
        for view in (p, m, v, vf):
            view.write_back()
        if cast_to is not None:
            cast_params_into(cast_to, params)
        return params, state._replace(count=t, lr=resolve(lr, t))

    info = TransformInfo(name, dict(lr=lr, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                    max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
                                    factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold,
                                    **masked_paths(exp_avg_mask)))
    return GradientTransformation(init, pure_update(apply), apply, info, gradient_allreduce,
                                  Capabilities(elementwise=True, communicates=True))


def trust_ratios(p_norm: torch.Tensor, u_norm: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's per-tensor ||p|| / ||u|| clamped to [min_coeff, max_coeff]; 1 where either norm is 0."""
    return torch.where((p_norm > 0) & (u_norm > 0), (p_norm / u_norm).clamp(min_coeff, max_coeff),
                       torch.ones_like(p_norm))


def momentum_scaling(m_norms: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """scaling_j = mean_k(r_k) / r_j with r_j = ||m_j|| / sqrt(numel_j) (float64); 1 where r_j is 0."""
    rms = m_norms.double() / torch.tensor([math.sqrt(max(s, 1)) for s in sizes], dtype=torch.float64,
                                          device=m_norms.device)
    united = rms.mean()
    return torch.where(rms > 0, united / rms, torch.ones_like(rms))


def frozen_factor(ratio: torch.Tensor, last: torch.Tensor, factor_min: float, factor_max: float,
                  threshold: float) -> torch.Tensor:
    """The compression stage's factor: clamped to [factor_min, factor_max], then to within
    +-threshold of the last step's factor (in that order, as DeepSpeed)."""
    factor = ratio.clamp(factor_min, factor_max)
    return torch.minimum(torch.maximum(factor, last * (1.0 - threshold)), last * (1.0 + threshold))


def _segments_of(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, sizes))


def _expand(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return values.repeat_interleave(torch.tensor(sizes, device=values.device))


__all__ = ["OneBitLambState", "onebit_lamb"]
