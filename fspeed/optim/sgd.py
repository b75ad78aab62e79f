"""SGD with momentum, dampening, nesterov and L2 weight decay, as torch.optim.SGD computes it.

    g += wd * p
    buf = g (first step) or momentum * buf + (1 - dampening) * g
    g = g + momentum * buf (nesterov) or buf
    p -= lr * g
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ..pytree import tree_map, tree_zeros_like
from .adam import check_hparams
from .base import ELEMENTWISE, GradientTransformation, ScalarOrSchedule, TransformInfo, cast_params_into, resolve
from .masks import Mask, masked_weight_decay


class SGDState(NamedTuple):
    count: int
    lr: float
    momentum_buffer: Any  # None when momentum is 0


def sgd(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    *,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """Stochastic gradient descent; `lr` and `momentum` may be schedules. `mask(path)`: which
    parameters get weight decay (`fspeed.optim.masks`)."""
    check_hparams("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    uses_momentum = callable(momentum) or momentum != 0.0
    if nesterov and (not uses_momentum or dampening != 0.0):
        raise ValueError(
            f"sgd: nesterov needs momentum > 0 and dampening == 0 (got momentum={momentum}, dampening={dampening})"
        )
    if mask is not None:
        unmasked = sgd(lr, momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        return masked_weight_decay(unmasked, mask)

    def init(params):
        return SGDState(0, resolve(lr, 0), tree_zeros_like(params) if uses_momentum else None)

    def direction(grads, state: SGDState, params, in_place: bool):
        lr_t, mom = resolve(lr, state.count), resolve(momentum, state.count)
        if weight_decay:
            if params is None:
                raise ValueError("sgd with weight_decay needs params in update()")
            grads = tree_map(lambda g, p: g.add(p, alpha=weight_decay), grads, params)
        buf = state.momentum_buffer
        if uses_momentum:
            if state.count == 0:
                step_buf = lambda b, g: b.copy_(g) if in_place else g.clone()  # noqa: E731
            elif in_place:
                step_buf = lambda b, g: b.mul_(mom).add_(g, alpha=1.0 - dampening)  # noqa: E731
            else:
                step_buf = lambda b, g: b * mom + (1.0 - dampening) * g  # noqa: E731
            buf = tree_map(step_buf, buf, grads)
            grads = tree_map(lambda g, b: g.add(b, alpha=mom), grads, buf) if nesterov else buf
        updates = tree_map(lambda g: g * -lr_t, grads)
        return updates, SGDState(state.count + 1, resolve(lr, state.count + 1), buf)

    def update(grads, state: SGDState, params=None):
        return direction(grads, state, params, in_place=False)

    def apply(grads, state: SGDState, params, *, cast_to=None):
        updates, new_state = direction(grads, state, params, in_place=True)
        tree_map(lambda p, u: p.add_(u), params, updates)
        if cast_to is not None:
            cast_params_into(cast_to, params)
        return params, new_state

    info = TransformInfo(
        "sgd", dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov),
        factory=sgd,
    )
    return GradientTransformation(init, update, apply, info, capabilities=ELEMENTWISE)
