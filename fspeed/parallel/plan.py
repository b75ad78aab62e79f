"""Parallel plans: each parallelism is one transform of per-parameter placements; `|` composes them.

    plan = fs.zero(stage=3) | fs.tensor_slicing(fs.models.gpt_rules)
    print(plan)                                         # zero(stage=3) | tensor_slicing({...})
    print(fs.explain(plan, params, mesh, model.logical_axes))

A `Placement` says, for one parameter, how the model computes with it (`compute`, a partition
spec: tensor slicing over `model`) and over which mesh axis each stored copy is partitioned: the
compute parameters, the gradients, and the fp32 masters with the optimizer state (ZeRO over
`data`). A transform maps the placements of all parameters (given their shapes and the mesh
sizes) to new ones, and records which axis it placed. A plan applies its transforms in phase
order: first those that decide what a rank computes with (`COMPUTE`: tensor slicing, pipeline
stages), then those that decide how it is stored (`STORAGE`: ZeRO). Each transform may also wrap
the model ops (`wrap_ops`: tensor slicing's column/row-parallel linears); train_step sees only
the composed runtime (`fspeed.parallel.runtime`), never which transforms a plan holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from .specs import PartitionSpec

COMPUTE, STORAGE = 0, 1  # transform phases
STORED = ("params", "grads", "optimizer")  # what a placement partitions, besides the compute spec


@dataclass(frozen=True)
class ParamEntry:
    """What a transform knows of one parameter: its path, global shape and logical axes."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[Optional[str], ...]


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives (see the module docstring). `params`, `grads` and `optimizer`
    name the mesh axis that partitions the rank's flat copy of each (None: held whole);
    `placed_by` records `(what, axis, transform)` for every axis a transform placed."""

    compute: PartitionSpec
    params: Optional[str] = None
    grads: Optional[str] = None
    optimizer: Optional[str] = None
    placed_by: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def replicated(cls, ndim: int) -> "Placement":
        return cls(PartitionSpec(*([None] * ndim)))

    def partitioned(self, transform: str, axis: str, *what: str) -> "Placement":
        """This placement with `what` (among params, grads, optimizer) partitioned over `axis`."""
        unknown = set(what) - set(STORED)
        if unknown:
            raise ValueError(f"a placement partitions {STORED}, not {sorted(unknown)}")
        return replace(self, **{w: axis for w in what},
                       placed_by=self.placed_by + tuple((w, axis, transform) for w in what))

    def computed_as(self, transform: str, spec: PartitionSpec) -> "Placement":
        """This placement with the compute spec `spec`, whose axes `transform` placed."""
        return replace(self, compute=spec,
                       placed_by=self.placed_by + tuple(("compute", axis, transform) for axis in spec.axes()))

    def describe(self) -> str:
        """`params/grads/optimizer` storage in one short phrase: `opt+grads: 1/data`."""
        parts: dict[str, list[str]] = {}
        for what in STORED:
            axis = getattr(self, what)
            if axis is not None:
                parts.setdefault(axis, []).append({"optimizer": "opt"}.get(what, what))
        return ", ".join(f"{'+'.join(w)}: 1/{axis}" for axis, w in parts.items()) or "whole"


@runtime_checkable
class Transform(Protocol):
    """One parallelism. `place` rewrites the placements of all parameters; `wrap_ops` (optional)
    layers this transform's collectives over the model ops; `check` refuses a mesh it cannot use."""

    name: str
    phase: int

    def place(self, entries: Sequence[ParamEntry], placements: Sequence[Placement],
              mesh_sizes: Mapping[str, int]) -> tuple[Placement, ...]: ...

    def wrap_ops(self, ops: Any, mesh: Any, tensor_axes: Sequence[str]) -> Any: ...

    def mesh_axes(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Plan:
    """An ordered composition of transforms (at most one of each kind). Compose with `|`."""

    transforms: tuple = ()

    def __post_init__(self):
        for t in self.transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"a plan composes parallel transforms (fs.zero, fs.tensor_slicing), got {t!r}")
        names = [t.name for t in self.transforms]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"a plan holds at most one {repeated[0]}(...) transform; got {self!r}")

    def __or__(self, other: Any) -> "Plan":
        if isinstance(other, Plan):
            return Plan(self.transforms + other.transforms)
        if isinstance(other, Transform):
            return Plan(self.transforms + (other,))
        return NotImplemented

    def __ror__(self, other: Any) -> "Plan":
        if isinstance(other, Transform):
            return Plan((other,) + self.transforms)
        return NotImplemented

    def find(self, name: str) -> Optional[Any]:
        """The transform of kind `name` (`"zero"`, `"tensor_slicing"`), or None."""
        return next((t for t in self.transforms if t.name == name), None)

    def ordered(self) -> tuple:
        """The transforms in the order they apply: compute-phase first, then storage (stable)."""
        return tuple(sorted(self.transforms, key=lambda t: t.phase))

    def place(self, entries: Sequence[ParamEntry], mesh_sizes: Mapping[str, int]) -> tuple[Placement, ...]:
        """The placements of `entries` on a mesh of `mesh_sizes`, every transform applied."""
        for axis, size in mesh_sizes.items():
            if size > 1 and not any(axis in t.mesh_axes() for t in self.transforms) and axis != "data":
                raise ValueError(f"the mesh has {axis}={size} but no transform of {self!r} uses the {axis!r} axis; "
                                 f"{_axis_hint(axis)}")
        placements = tuple(Placement.replicated(len(e.shape)) for e in entries)
        for t in self.ordered():
            placements = tuple(t.place(entries, placements, mesh_sizes))
        return placements

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.transforms) or "Plan()"


def _axis_hint(axis: str) -> str:
    return {
        "model": "add fs.tensor_slicing(rules) to the plan, or use model=1",
        "pipe": "add fs.pipeline(micro_batches=...) to the plan, or use pipe=1",
    }.get(axis, f"use {axis}=1")


__all__ = ["COMPUTE", "STORAGE", "ParamEntry", "Placement", "Plan", "Transform"]
