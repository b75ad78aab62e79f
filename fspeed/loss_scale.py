"""DeepSpeed's dynamic loss scaler as a pure state machine (`DynamicLossScaler.update_scale`).

`update_loss_scale` runs once per optimizer-step attempt, skipped steps included:

    overflow:  if hysteresis == 1 or cur_hysteresis == 1: scale = max(scale / 2, min_scale)
               (raising first if scale is already at min_scale), else cur_hysteresis -= 1;
               last_overflow_iter = cur_iter
    clean:     refill cur_hysteresis every step if consecutive_hysteresis; when
               (cur_iter - last_overflow_iter - 1) is a positive multiple of the window, refill
               (non-consecutive mode) and double the scale
    cur_iter += 1

A static scale (`loss_scale > 0`) and bf16/fp32 (scale 1) never change.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .precision import LossScaleConfig


class LossScaleState(NamedTuple):
    scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 1


class LossScaleAtMinimumError(RuntimeError):
    """An overflow happened while the dynamic loss scale was already at its minimum."""


def init_loss_scale(cfg: Optional[LossScaleConfig]) -> LossScaleState:
    if cfg is None:
        return LossScaleState(1.0)
    if not cfg.dynamic:
        return LossScaleState(cfg.loss_scale)
    return LossScaleState(float(2**cfg.initial_scale_power), 0, -1, cfg.hysteresis)


def update_loss_scale(cfg: Optional[LossScaleConfig], state: LossScaleState, overflow: bool) -> LossScaleState:
    """The scaler state after one step attempt that did (`overflow=True`) or did not overflow."""
    if cfg is None or not cfg.dynamic:
        return state._replace(cur_iter=state.cur_iter + 1)
    scale, hysteresis, last_overflow = state.scale, state.cur_hysteresis, state.last_overflow_iter
    if overflow:
        if cfg.hysteresis == 1 or hysteresis == 1:
            if scale == cfg.min_loss_scale and cfg.raise_at_min_scale:
                raise LossScaleAtMinimumError(
                    f"fp16 gradients overflowed at step {state.cur_iter} while the loss scale is already at "
                    f"its minimum ({cfg.min_loss_scale}). The model is producing inf/NaN gradients: lower the "
                    "learning rate, check the data, use bf16 (precision=bf16), or set "
                    "precision.raise_at_min_scale=false to keep skipping steps instead of stopping."
                )
            scale = max(scale / 2.0, cfg.min_loss_scale)
        else:
            hysteresis -= 1
        last_overflow = state.cur_iter
    else:
        if cfg.consecutive_hysteresis:
            hysteresis = cfg.hysteresis
        stable = state.cur_iter - last_overflow - 1
        if stable > 0 and stable % cfg.loss_scale_window == 0:
            if not cfg.consecutive_hysteresis:
                hysteresis = cfg.hysteresis
            scale *= 2.0
    return LossScaleState(scale, state.cur_iter + 1, last_overflow, hysteresis)
