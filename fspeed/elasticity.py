"""DeepSpeed's elastic batch: one global batch size that stays valid over a range of GPU counts.

    batch = elastic_batch(ElasticConfig(max_train_batch_size=2000, micro_batch_sizes=(2, 4, 6)), world_size=8)
    batch.train_batch_size, batch.valid_world_sizes, batch.micro_batch_size, batch.grad_accum

DeepSpeed's `elasticity` block (`compute_elastic_config`, versions 0.1 and 0.2) chooses the global
batch among multiples of the micro-batch sizes (and of their least common multiple) scaled by a
highly composite number to stay within `max_train_batch_size`, then keeps the one that divides
evenly over the most GPU counts in [min_gpus, max_gpus] (ties: the larger batch with
`prefer_larger_batch`, else the smaller). Version 0.2 works per node: it computes on nodes of
`num_gpus_per_node / model_parallel_size` data ranks and, when the current world is not one of the
valid counts, falls back to the largest (or smallest) multiple of a micro-batch times the current
data ranks within the maximum. For a given world size the micro-batch is the largest of
`micro_batch_sizes` dividing the per-rank share, and the gradient accumulation makes up the rest:
`train_batch_size = micro_batch_size x grad_accum x world_size`. The world size is the
data-parallel size, as DeepSpeed's engine passes it.

The computation is exactly DeepSpeed's; its failures are `ElasticityError`s naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120, 20160,
    25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720,
)
"""The smallest highly composite numbers (DeepSpeed's scale factors, enough for batches up to ~720K)."""

VERSIONS = (0.1, 0.2)
"""The elasticity versions DeepSpeed implements (0.2 is its default and latest)."""


class ElasticityError(ValueError):
    """An elastic configuration or world size DeepSpeed's rules reject; `key` is the key at fault
    (an `ElasticConfig` field, or "world_size")."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class ElasticConfig:
    """The keys of DeepSpeed's `elasticity` block that decide the batch (DeepSpeed's defaults)."""

    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    prefer_larger_batch: bool = True
    model_parallel_size: int = 1
    num_gpus_per_node: int = 1
    version: float = 0.2

    def __post_init__(self) -> None:
        object.__setattr__(self, "micro_batch_sizes", tuple(self.micro_batch_sizes))
        for key in ("max_train_batch_size", "min_gpus", "max_gpus", "model_parallel_size", "num_gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ElasticityError(key, f"{key}={value!r} must be a positive integer")
        micro = self.micro_batch_sizes
        if not micro or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro):
            raise ElasticityError("micro_batch_sizes", f"micro_batch_sizes={list(micro)} must be a non-empty list "
                                  "of positive integers")
        if self.max_gpus < self.min_gpus:
            raise ElasticityError("min_gpus", f"min_gpus={self.min_gpus} is greater than max_gpus={self.max_gpus}")
        if float(self.version) not in VERSIONS:
            raise ElasticityError("version", f"version={self.version!r} is not one DeepSpeed implements; allowed: "
                                  "0.1, 0.2")
        if self.model_parallel_size > 1 and float(self.version) != 0.2:
            raise ElasticityError("model_parallel_size", f"model_parallel_size={self.model_parallel_size} needs "
                                  f"version 0.2 (version {self.version} has no model parallelism)")
        if float(self.version) == 0.2 and self.num_gpus_per_node % self.model_parallel_size:
            raise ElasticityError("num_gpus_per_node", f"num_gpus_per_node={self.num_gpus_per_node} is not divisible "
                                  f"by model_parallel_size={self.model_parallel_size}")


@dataclass(frozen=True)
class ElasticBatch:
    """DeepSpeed's elastic result: the global batch, the valid (data-parallel) world sizes, and, for a
    given world size, its micro-batch and gradient accumulation (None without one)."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    micro_batch_size: Optional[int] = None
    grad_accum: Optional[int] = None


def _divisors_within(n: int, low: int, high: int) -> set[int]:
    """The divisors of n in [low, high]."""
    found = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            found.update(x for x in (d, n // d) if low <= x <= high)
    return found


def _scaled_candidates(bases: list[int], cap: int) -> set[int]:
    """Each base at most `cap`, times the largest highly composite number keeping it <= cap (the
    last one when even that does not reach it, as DeepSpeed's lookup does)."""
    candidates = set()
    for base in bases:
        if base > cap:
            continue
        if base == cap:
            candidates.add(base)
            continue
        room = cap // base
        above = next((i for i, h in enumerate(HIGHLY_COMPOSITE) if h > room), 0)
        candidates.add(HIGHLY_COMPOSITE[above - 1] * base)
    return candidates


def _valid_counts(batch: int, micro_batches: tuple[int, ...], low: int, high: int) -> list[int]:
    """The GPU counts in [low, high] over which `batch` splits into whole micro-batches of one of the sizes."""
    counts: set[int] = set()
    for micro in micro_batches:
        if batch % micro == 0:
            counts |= _divisors_within(batch // micro, low, high)
    return sorted(counts)


def _most_elastic(micro_batches: tuple[int, ...], cap: int, min_gpus: int, max_gpus: int,
                  prefer_larger: bool) -> tuple[int, Optional[list[int]]]:
    """Version 0.1: (the candidate batch valid on the most GPU counts, those counts; None if none won)."""
    low = min_gpus or 1
    high = max_gpus or cap // min(micro_batches)
    if any(m > cap for m in micro_batches):
        raise ElasticityError("micro_batch_sizes", f"micro_batch_sizes {list(micro_batches)} must each be <= the "
                              f"maximum train batch size {cap}")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    best, best_counts, best_valid = min(micro_batches), 0, None
    for batch in _scaled_candidates(bases, cap):
        valid = _valid_counts(batch, micro_batches, low, high)
        better = (batch > best) if prefer_larger else (batch < best)
        if len(valid) > best_counts or (len(valid) == best_counts and better):
            best, best_counts, best_valid = batch, len(valid), valid
    return best, best_valid


def _per_node(c: ElasticConfig, world_size: int) -> tuple[int, Optional[list[int]]]:
    """Version 0.2: the node-level computation, and its fallback when `world_size` is not a valid count."""
    micro, cap = c.micro_batch_sizes, c.max_train_batch_size
    ranks_per_node = c.num_gpus_per_node // c.model_parallel_size
    nodes_batch, nodes = _most_elastic(micro, int(cap / ranks_per_node), int(c.min_gpus / c.num_gpus_per_node),
                                       int(c.max_gpus / c.num_gpus_per_node), c.prefer_larger_batch)
    if nodes is None:  # DeepSpeed fails here too (it tests membership in None)
        raise ElasticityError("min_gpus", f"no node count in min_gpus={c.min_gpus}..max_gpus="
                              f"{c.max_gpus} (over num_gpus_per_node={c.num_gpus_per_node}) fits any candidate batch")
    batch = int(nodes_batch) * ranks_per_node
    valid = [n * ranks_per_node for n in nodes]
    if world_size // c.model_parallel_size in valid:
        return batch, valid
    data_ranks = (world_size / c.num_gpus_per_node) * ranks_per_node
    fallbacks = [math.floor(cap / float(m * data_ranks)) * (m * data_ranks) for m in micro]
    batch = max(fallbacks) if c.prefer_larger_batch else min(fallbacks)
    return int(batch), [int(data_ranks)]


def elastic_batch(config: ElasticConfig, world_size: int = 0) -> ElasticBatch:
    """DeepSpeed's `compute_elastic_config` for `config`; with `world_size` > 0 (the data-parallel
    size) also its micro-batch and gradient accumulation. Version 0.2 needs the world size."""
    if float(config.version) == 0.1:
        batch, valid = _most_elastic(config.micro_batch_sizes, config.max_train_batch_size, config.min_gpus,
                                     config.max_gpus, config.prefer_larger_batch)
    elif world_size < 1:
        raise ElasticityError("version", "version 0.2 computes the batch for the current world size, and none "
                              "was given")
    else:
        batch, valid = _per_node(config, world_size)
    batch, valid_sizes = int(batch), tuple(valid or ())
    if world_size < 1:
        return ElasticBatch(batch, valid_sizes)
    if world_size not in valid_sizes:
        shown = ", ".join(map(str, valid_sizes[:16])) + (f", ... ({len(valid_sizes)} in all)" if len(valid_sizes) > 16
                                                         else "")
        raise ElasticityError("world_size",
                              f"{world_size} data-parallel ranks is not a valid world size for the elastic batch "
                              f"{batch} (max_train_batch_size={config.max_train_batch_size}, "
                              f"micro_batch_sizes={list(config.micro_batch_sizes)}, min_gpus={config.min_gpus}, "
                              f"max_gpus={config.max_gpus}); valid: {shown or 'none'}")
    share = batch // world_size
    micro = next((m for m in sorted(set(config.micro_batch_sizes), reverse=True) if share % m == 0), None)
    if micro is None:
        raise ElasticityError("micro_batch_sizes", f"none of micro_batch_sizes {list(config.micro_batch_sizes)} "
                              f"divides the per-rank share {share} of the elastic batch {batch} on {world_size} ranks")
    return ElasticBatch(batch, valid_sizes, micro, batch // (micro * world_size))


__all__ = ["HIGHLY_COMPOSITE", "VERSIONS", "ElasticBatch", "ElasticConfig", "ElasticityError", "elastic_batch"]
