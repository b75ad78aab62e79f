"""Gradient clipping by global L2 norm, as DeepSpeed's `gradient_clipping`.

    coef = max_norm / (norm + 1e-6);  updates *= coef  when coef < 1

When this transform leads the optimizer chain, `train_step` folds it into the loss-scale
unscaling multiply (one pass, DeepSpeed's fused unscale+clip) and reuses the norm it already
computed for the overflow check; standalone, it computes the norm itself.
"""

from __future__ import annotations

import math

from ..pytree import tree_map
from .base import Capabilities, EmptyState, GradientTransformation, TransformInfo, global_norm

CLIP_EPS = 1e-6


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor (<= 1) that brings a gradient of L2 norm `norm` to at most `max_norm`."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates so that their global L2 norm is at most `max_norm`."""
    if not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm={max_norm!r} must be a positive finite number")

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        coef = clip_coefficient(float(global_norm(updates)), max_norm)
        if coef < 1.0:
            updates = tree_map(lambda u: u * coef, updates)
        return updates, state

    return GradientTransformation(init, update, None, TransformInfo("clip_by_global_norm", dict(max_norm=max_norm)),
                                  capabilities=Capabilities(cpu=True, clip_norm=float(max_norm)))
