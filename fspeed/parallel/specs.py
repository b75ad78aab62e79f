"""Partition specs and logical-axis rules, as in JAX and Flax.

A `PartitionSpec` has one entry per tensor dim: None (replicated), a mesh axis name, or a tuple of
axis names (sharded over their product). Models name their parameter dims logically
(`("embed", "mlp")`); ordered rules map logical names to mesh axes, first free axis wins (Flax's
`_logical_to_mesh_axes`): for each rule in order, if the tensor has a dim with that logical name,
that dim is still unassigned and none of the rule's mesh axes is used yet, assign them.

    rules = {"heads": "model", "mlp": "model", "vocab": "model"}
    logical_to_spec(("embed", "mlp"), rules, {"model": 2})   # -> P(None, 'model')
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

AxisEntry = Union[None, str, tuple[str, ...]]
Rules = Union[Mapping[str, AxisEntry], Sequence[tuple[str, AxisEntry]]]


class PartitionSpec(tuple):
    """Per-dim sharding: None, a mesh axis, or a tuple of mesh axes. `P('model', None)`."""

    def __new__(cls, *entries: AxisEntry):
        for e in entries:
            if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
                raise TypeError(f"PartitionSpec entries are None, a mesh axis name or a tuple of names; got {e!r}")
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __getnewargs__(self):
        return tuple(self)

    def axes(self) -> list[str]:
        """Every mesh axis used, in dim order."""
        out: list[str] = []
        for e in self:
            out.extend((e,) if isinstance(e, str) else (e or ()))
        return out

    def dim_of(self, axis: str) -> Optional[int]:
        """The tensor dim sharded over mesh `axis`, or None."""
        for d, e in enumerate(self):
            if e == axis or (isinstance(e, tuple) and axis in e):
                return d
        return None


P = PartitionSpec


def _rule_items(rules: Rules) -> list[tuple[str, AxisEntry]]:
    return list(rules.items()) if isinstance(rules, Mapping) else list(rules)


def logical_to_spec(logical: Sequence[Optional[str]], rules: Rules, mesh_sizes: Mapping[str, int]) -> PartitionSpec:
    """Resolve logical dim names to a PartitionSpec (first free axis wins; size-1 axes are skipped)."""
    names = [n for n in logical if n is not None]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"logical axis name(s) {duplicates} appear twice in {tuple(logical)}")
    assigned: list[AxisEntry] = [None] * len(logical)
    used: set[str] = set()
    for name, target in _rule_items(rules):
        if target is None or name not in logical:
            continue
        dim = list(logical).index(name)
        axes = (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if mesh_sizes.get(a, 1) > 1)
        if assigned[dim] is not None or not axes or used & set(axes):
            continue
        assigned[dim] = axes[0] if len(axes) == 1 else axes
        used.update(axes)
    return PartitionSpec(*assigned)


def local_shape(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: Mapping[str, int], name: str = "") -> tuple[int, ...]:
    """The per-rank shape of a tensor of `shape` sharded by `spec` (dims must divide evenly)."""
    if len(spec) != len(shape):
        raise ValueError(f"{name or 'tensor'}: spec {spec} has {len(spec)} entries for a {len(shape)}-d shape {list(shape)}")
    out = []
    for d, (size, entry) in enumerate(zip(shape, spec)):
        parts = 1
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            parts *= mesh_sizes.get(axis, 1)
        if size % parts:
            raise ValueError(
                f"{name or 'tensor'}: dim {d} of size {size} cannot be split into {parts} equal parts over {entry!r}; "
                "choose sizes divisible by the tensor-parallel degree"
            )
        out.append(size // parts)
    return tuple(out)


def shard(tensor: torch.Tensor, spec: PartitionSpec, mesh_sizes: Mapping[str, int],
          coords: Mapping[str, int]) -> torch.Tensor:
    """This rank's piece of a full `tensor` under `spec` (a contiguous copy)."""
    piece = tensor
    for d, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else (entry or ())
        parts, index = 1, 0
        for axis in axes:
            index = index * mesh_sizes.get(axis, 1) + coords.get(axis, 0)
            parts *= mesh_sizes.get(axis, 1)
        if parts > 1:
            piece = piece.chunk(parts, dim=d)[index]
    return piece.contiguous()
