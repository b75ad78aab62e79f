"""ZeRO's options: DeepSpeed's `zero_optimization` keys that fspeed implements, as frozen dataclasses.

Same names, defaults and meanings as DeepSpeed (reference 2.3); every field takes effect, and a
combination DeepSpeed rejects, or that fspeed cannot honour, is a `ValueError` naming the key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional


OFFLOAD_DEVICES = ("none", "cpu")


def _check_offload_device(block: str, device: object, pin_memory: object) -> None:
    if device == "nvme":
        raise ValueError(f"zero.{block}.device='nvme' is not supported by fspeed (NVMe offload needs DeepSpeed's "
                         "async I/O swapper); allowed: 'none', 'cpu'")
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"zero.{block}.device={device!r} is not allowed; allowed: 'none', 'cpu'")
    if not isinstance(pin_memory, bool):
        raise ValueError(f"zero.{block}.pin_memory={pin_memory!r} must be true or false")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """DeepSpeed's `offload_optimizer` block: with device "cpu", this rank's fp32 masters and
    optimizer state live in CPU memory and the optimizer runs there (ZeRO-Offload).
    `pin_memory`: page-locked buffers (only where CUDA exists). `ratio` < 1 (partial offload) is
    not supported."""

    device: str = "none"
    pin_memory: bool = True
    ratio: float = 1.0

    def __post_init__(self):
        _check_offload_device("offload_optimizer", self.device, self.pin_memory)
        if self.ratio != 1.0:
            raise ValueError(f"zero.offload_optimizer.ratio={self.ratio!r}: partial offload is not supported by "
                             "fspeed; allowed: 1.0 (the whole partition is updated on CPU)")

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class OffloadParamConfig:
    """DeepSpeed's `offload_param` block (stage 3): with device "cpu", the parameter shards of
    sharded units live in CPU memory and go to the device just before each gather."""

    device: str = "none"
    pin_memory: bool = True

    def __post_init__(self):
        _check_offload_device("offload_param", self.device, self.pin_memory)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


def _offload_block(cls: type, block: str, value: Any):
    """An offload config from the forms users write: the class, None, a device name or a mapping."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if isinstance(value, str):
        return cls(device=value)
    if isinstance(value, Mapping):
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"zero.{block}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**value)
    raise TypeError(f"zero.{block}={value!r} must be a {cls.__name__}, a mapping, a device name or None")


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's `zero_optimization` keys that fspeed implements (same names, same meanings)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize  # stage 3: cap on the total of persistent (unsharded) elements
    overlap_comm: Optional[bool] = None  # None: DeepSpeed's default, True for stage 3 and False otherwise
    prefetch: bool = True  # stage 3: gather the next unit while the current one computes
    recompute_blocks: bool = False  # stage 3: keep only each block's input, recompute it in backward
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage={self.stage!r} must be 0, 1, 2 or 3")
        object.__setattr__(self, "offload_optimizer",
                           _offload_block(OffloadOptimizerConfig, "offload_optimizer", self.offload_optimizer))
        object.__setattr__(self, "offload_param", _offload_block(OffloadParamConfig, "offload_param", self.offload_param))
        if self.offload_optimizer.enabled and self.stage == 0:
            raise ValueError("zero.offload_optimizer.device='cpu' needs zero stage 1, 2 or 3 (it offloads this "
                             "rank's ZeRO partition); got stage 0")
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f"zero.offload_param.device='cpu' is only valid with zero stage 3 (as in DeepSpeed); "
                             f"got stage {self.stage}")
        if self.offload_param.enabled and not self.offload_optimizer.enabled:
            raise ValueError("zero.offload_param.device='cpu' needs zero.offload_optimizer.device='cpu' too in "
                             "fspeed (the optimizer updates the CPU parameter shards in place)")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"zero.{key}={getattr(self, key)!r} must be a positive integer (elements)")
        for key in ("param_persistence_threshold", "model_persistence_threshold"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"zero.{key}={getattr(self, key)!r} must be an integer >= 0 (elements)")
        if self.overlap_comm not in (None, True, False):
            raise ValueError(f"zero.overlap_comm={self.overlap_comm!r} must be true, false or null (DeepSpeed's "
                             "default: true for stage 3, false otherwise)")
        if self.recompute_blocks and self.stage != 3:
            raise ValueError(f"zero.recompute_blocks=True needs zero stage 3 (it recomputes the blocks that stage 3 "
                             f"gathers); got stage {self.stage}. Allowed with stage {self.stage}: false")

    @property
    def overlaps(self) -> bool:
        """Whether gradient collectives run asynchronously during backward (overlap_comm resolved)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


__all__ = ["OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig"]
