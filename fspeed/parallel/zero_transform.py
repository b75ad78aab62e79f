"""ZeRO over the `data` axis: the transform (`zero(stage)`), which partitions what each stage says.

    stage 0   nothing: parameters, gradients and optimizer state replicated; gradients all-reduced
    stage 1   fp32 masters and optimizer state: 1/N contiguous slice of the flat buffer per rank
    stage 2   + gradients: reduced during backward, bucket by bucket, into the rank's slice only
    stage 3   + parameters: each unit's parameters are flattened and split into N shards, gathered
              just in time for their use; a parameter of at most `param_persistence_threshold`
              elements is persistent (DeepSpeed's rule, per parameter), as long as the persistent
              total stays within `model_persistence_threshold`: its compute copy stays whole on
              every rank (never gathered or released), while its gradient, fp32 master and
              optimizer state are partitioned like every other parameter's (DeepSpeed's
              `ds_persist` parameters keep their `ds_tensor` partition, which the fp32 partition
              and the optimizer state are built from, and their gradients are reduce-scattered)

The runtime piece (how each stage stores its state and reduces its gradients) is chosen once per
layout in `fspeed.parallel.runtime` and `fspeed.parallel.grads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .config import ZeroConfig
from .plan import STORAGE, ParamEntry, Placement, Plan
from .specs import local_shape

# what each stage partitions over `data`
PARTITIONED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


@dataclass(frozen=True)
class Zero:
    """The ZeRO transform (build it with `zero(stage, **options)`)."""

    config: ZeroConfig
    name: str = "zero"
    phase: int = STORAGE

    def mesh_axes(self) -> tuple[str, ...]:
        return ("data",)

    def place(self, entries: Sequence[ParamEntry], placements: Sequence[Placement],
              mesh_sizes: Mapping[str, int]) -> tuple[Placement, ...]:
        cfg, stage = self.config, self.config.stage
        out, persistent_total = [], 0
        for entry, placement in zip(entries, placements):
            what = PARTITIONED[stage]
            if stage == 3:
                numel = _numel(local_shape(entry.shape, placement.compute, mesh_sizes, entry.path))
                if numel <= cfg.param_persistence_threshold and \
                        persistent_total + numel <= cfg.model_persistence_threshold:
                    persistent_total += numel
                    what = ("optimizer", "grads")  # persistent: only the compute parameter is whole
            out.append(placement.partitioned(repr(self), "data", *what) if what else placement)
        return tuple(out)

    def wrap_ops(self, ops: Any, mesh: Any, tensor_axes: Sequence[str]) -> Any:
        return ops  # ZeRO-3's gathering is the runtime's unit ops, driven by the layout

    def __repr__(self) -> str:
        cfg = self.config
        offload = "".join(f", {name}={getattr(cfg, name).device!r}"
                          for name in ("offload_optimizer", "offload_param") if getattr(cfg, name).enabled)
        return f"zero(stage={cfg.stage}{offload})"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def zero(stage: int | ZeroConfig, **options: Any) -> Plan:
    """ZeRO stage 0-3 over the `data` axis; `options` are `ZeroConfig` fields (DeepSpeed's keys).
    A `ZeroConfig` may be passed whole instead: `zero(config)`."""
    if isinstance(stage, ZeroConfig):
        if options:
            raise TypeError(f"zero(config) takes no other options; got {sorted(options)}")
        return Plan((Zero(stage),))
    return Plan((Zero(ZeroConfig(stage=stage, **options)),))


__all__ = ["PARTITIONED", "Zero", "zero"]
