"""Precision policies: fp32, bf16 and fp16 with DeepSpeed's loss scaling.

A policy says which dtype the model computes in, which dtype gradients accumulate in, whether
inf/NaN gradients skip the step, and (fp16) how the loss is scaled. bf16 and fp16 keep fp32
master weights; the optimizer updates the masters and the compute copy is cast from them.
Gradients accumulate in fp32 by default (DeepSpeed accumulates fp16 grads in fp16 without ZeRO;
fspeed defaults to fp32 because low-precision accumulation diverges, DeepSpeed issue #2768).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_from_name(name: str, what: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"{what}={name!r} is not a known dtype; allowed: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class LossScaleConfig:
    """DeepSpeed's `fp16` block. `loss_scale=0` means dynamic; > 0 is a fixed (static) scale."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min_scale: bool = True

    def __post_init__(self):
        if not math.isfinite(self.loss_scale) or self.loss_scale < 0 or isinstance(self.loss_scale, bool):
            raise ValueError(f"fp16.loss_scale={self.loss_scale!r} must be 0 (dynamic) or a positive finite number")
        for key in ("loss_scale_window", "hysteresis", "initial_scale_power"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"fp16.{key}={value!r} must be an integer")
        if self.dynamic:
            for key in ("loss_scale_window", "hysteresis"):
                if getattr(self, key) < 1:
                    raise ValueError(f"fp16.{key}={getattr(self, key)} must be >= 1 with dynamic loss scaling")
            if not math.isfinite(self.min_loss_scale) or self.min_loss_scale <= 0:
                raise ValueError(
                    f"fp16.min_loss_scale={self.min_loss_scale} must be a positive finite number with dynamic loss scaling"
                )
            if not 0 <= self.initial_scale_power <= 64:
                raise ValueError(f"fp16.initial_scale_power={self.initial_scale_power} must be in [0, 64]")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class Precision:
    """A precision policy; build one with `fp32()`, `bf16()` or `fp16()`."""

    name: str
    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    check_overflow: bool
    loss_scale: Optional[LossScaleConfig] = None
    # DeepSpeed unscales with the scale *after* update_scale(); on a growth step that halves the
    # update. fspeed unscales with the scale that produced the gradients unless this is set.
    unscale_with_updated_scale: bool = False

    @property
    def has_master(self) -> bool:
        return self.param_dtype != torch.float32


def fp32() -> Precision:
    """Everything in fp32; no overflow check (as DeepSpeed without fp16/bf16)."""
    return Precision("fp32", torch.float32, torch.float32, check_overflow=False)


def bf16(grad_accum_dtype: str = "fp32", check_grad_overflow: bool = True) -> Precision:
    """bf16 compute with fp32 masters; no loss scaling; inf/NaN gradients skip the step."""
    return Precision("bf16", torch.bfloat16, dtype_from_name(grad_accum_dtype, "bf16.grad_accum_dtype"),
                     check_overflow=check_grad_overflow)


def fp16(
    loss_scale: float = 0.0,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    raise_at_min_scale: bool = True,
    grad_accum_dtype: str = "fp32",
    unscale_with_updated_scale: bool = False,
) -> Precision:
    """fp16 compute with fp32 masters and DeepSpeed's (dynamic or static) loss scaling."""
    scale = LossScaleConfig(float(loss_scale), initial_scale_power, loss_scale_window, hysteresis,
                            consecutive_hysteresis, float(min_loss_scale), raise_at_min_scale)
    return Precision("fp16", torch.float16, dtype_from_name(grad_accum_dtype, "fp16.grad_accum_dtype"),
                     check_overflow=True, loss_scale=scale, unscale_with_updated_scale=unscale_with_updated_scale)
