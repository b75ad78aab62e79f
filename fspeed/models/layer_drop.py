"""Progressive Layer Dropping (PLD, Zhang & He 2020), DeepSpeed's `progressive_layer_drop`.

The global keep ratio decays from 1 to ``theta``:

    theta(t) = (1 - theta) * exp(-gamma * t) + theta          (DeepSpeed's ProgressiveLayerDrop)

DeepSpeed updates it at each optimizer step's boundary with the step count *before* the step is
counted, after that step's forwards ran; it starts at 1.0. So the forward of optimizer step ``t``
(0-based) uses ``theta(t - 1)`` (1.0 at ``t = 0``): `pld_theta_at` gives that value, in the same
float64 arithmetic as DeepSpeed (numpy's exp); DeepSpeed's engine passes it to the model's
forward as ``pld_theta``.

The model does the dropping. Per depth it follows the paper (section 4.2): block ``l = 1..L`` is
kept with probability ``p_l = 1 - (l / L) * (1 - theta(t))``, so the first blocks are nearly always
kept and the last one at ``theta(t)``; a kept block's residual branches are scaled by ``1 / p_l``
so that the expected update matches the full model, which evaluation runs unscaled. (DeepSpeed's
BERT example samples block ``i = 0..L-1`` with ``1 - i (1 - theta) / L`` and rescales by the next
block's probability; fspeed uses the paper's ``p_l`` for both.) A dropped block is not run at
all: no forward, no backward, and under ZeRO-3 no gather.

The draw is made once per optimizer step, from a seed the step's batch carries with the keep
ratio (`LayerDrop`, under the batch key ``"layer_drop"``; fspeed-train derives the seed from the
run's seed and the step). So every micro-batch of a step, every rank (data, tensor) and a
resumed run drop the same blocks, and a run on N data ranks equals one process. (DeepSpeed draws
per forward from numpy's global generator.) Evaluation keeps every block.

The hook for any model: `kept_blocks(layer_drop, num_blocks, training)` gives, for each block,
None (skip it) or the scale of its residual branches. The reference GPT calls it (training is
``rng is not None``); a `functionalize`d module whose ``forward`` takes a ``layer_drop`` keyword
receives the batch's `LayerDrop` there and calls it with ``self.training``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .module import ModuleLoss

PLD_BATCH_KEY = "layer_drop"


@dataclass(frozen=True)
class LayerDrop:
    """One step's layer dropping: the keep ratio ``theta`` (`pld_theta_at`) and the seed of the draw.
    Not a tensor, so splitting a batch into micro-batches hands each the same one."""

    theta: float
    seed: int

    def __post_init__(self) -> None:
        if not 0.0 < self.theta <= 1.0:
            raise ValueError(f"LayerDrop.theta must be in (0, 1], got {self.theta}")


def step_layer_drop(step: int, seed: int, theta: float, gamma: float) -> LayerDrop:
    """The `LayerDrop` of optimizer step ``step`` of a run seeded ``seed``."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x5DEECE66D) % 2**63
    return LayerDrop(pld_theta_at(step, theta, gamma), mixed)


def pld_theta(global_step: int, theta: float, gamma: float) -> float:
    """DeepSpeed's keep ratio after `update_state(global_step)`: (1 - theta) exp(-gamma t) + theta."""
    return float((1.0 - theta) * np.exp(-gamma * global_step) + theta)


def pld_theta_at(step: int, theta: float, gamma: float) -> float:
    """The keep ratio DeepSpeed's model sees in the forward of optimizer step ``step`` (0-based)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return 1.0 if step == 0 else pld_theta(step - 1, theta, gamma)


def keep_probabilities(keep_ratio: float, num_blocks: int) -> list[float]:
    """The paper's per-depth keep probabilities ``p_l = 1 - (l / L)(1 - keep_ratio)``, l = 1..L."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"pld_theta must be in (0, 1], got {keep_ratio}")
    return [1.0 - (layer / num_blocks) * (1.0 - keep_ratio) for layer in range(1, num_blocks + 1)]


def kept_blocks(layer_drop: Optional[LayerDrop], num_blocks: int, training: bool = True) -> list[Optional[float]]:
    """For each block: None when it is dropped, else the scale ``1 / p_l`` of its residual branches.
    Every block is kept unscaled without a `LayerDrop` or outside training."""
    if layer_drop is None or not training or layer_drop.theta == 1.0:
        return [1.0] * num_blocks
    if not isinstance(layer_drop, LayerDrop):
        raise TypeError(f"the batch's {PLD_BATCH_KEY!r} must be a fspeed LayerDrop, got {type(layer_drop).__name__}")
    probs = keep_probabilities(layer_drop.theta, num_blocks)
    draws = torch.rand(num_blocks, generator=torch.Generator().manual_seed(layer_drop.seed), dtype=torch.float64)
    return [1.0 / p if u < p else None for u, p in zip(draws.tolist(), probs)]


def supports_layer_drop(model: Any) -> bool:
    """Whether ``model`` reads a batch's `LayerDrop`: the reference GPT, or a functionalized module
    whose ``forward`` names a ``layer_drop`` parameter (a ``**kwargs`` catch-all does not count:
    it would swallow the drop and train the full model, silently)."""
    if isinstance(model.loss, ModuleLoss):
        return "layer_drop" in inspect.signature(model.loss.module.forward).parameters
    return model.name == "gpt"


__all__ = ["PLD_BATCH_KEY", "LayerDrop", "keep_probabilities", "kept_blocks", "pld_theta", "pld_theta_at",
           "step_layer_drop",
           "supports_layer_drop"]
