"""Dropout seeds: one per (run seed, step, micro-batch), and from it one per layer.

A model draws each layer's dropout from a generator of that layer's own (`layer_generators`), seeded
from the micro-batch's seed and the layer's index. A layer then draws the same masks whether it runs
in one process or on any pipeline stage, since no draw depends on what ran before it elsewhere. The
step seeds the micro-batch's generator (`dropout_seed`); a pipeline stage, which runs only some
layers, seeds each layer directly (`layer_seed`).
"""

from __future__ import annotations

from typing import Optional

import torch

_MASK = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser, to 63 bits (a torch seed must fit an int64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1


def dropout_seed(rng_seed: int, step: int, micro: int) -> int:
    """A 63-bit seed for (run seed, step, micro-batch), stable across processes."""
    return _mix((rng_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + micro * 0x94D049BB133111EB) & _MASK)


def layer_seed(micro_seed: int, layer: int) -> int:
    """The seed of layer `layer`'s dropout in the micro-batch seeded `micro_seed`."""
    return _mix((micro_seed * 0x9E3779B97F4A7C15 + (layer + 1) * 0xD6E8FEB86659FD93) & _MASK)


def layer_generator(micro_seed: int, layer: int, device: torch.device) -> torch.Generator:
    """A generator of its own for layer `layer` of the micro-batch seeded `micro_seed`."""
    return torch.Generator(device=device).manual_seed(layer_seed(micro_seed, layer))


def layer_generators(rng: Optional[torch.Generator], count: int) -> list[Optional[torch.Generator]]:
    """`count` generators, layer i's from `layer_generator(rng.initial_seed(), i)` (Nones without
    `rng`: evaluation, no dropout). `rng` itself is left as it is."""
    if rng is None:
        return [None] * count
    return [layer_generator(rng.initial_seed(), i, rng.device) for i in range(count)]


__all__ = ["dropout_seed", "layer_generator", "layer_generators", "layer_seed"]
