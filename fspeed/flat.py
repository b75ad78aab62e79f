"""Flat buffers: a pytree of tensors stored as views into one contiguous 1-D buffer.

A `Flat` is itself a pytree node whose only child is the buffer. So `tree_map(f, flat)` runs `f`
once over the whole buffer: an optimizer written leaf-wise, Optax style, becomes one pass over
memory with no change to its code. `flat.tree()` gives the structured tree (zero-copy views);
`flat.segments()` gives the per-parameter 1-D views for per-tensor math (LAMB trust ratios).

ZeRO partitions and fused kernels slice these buffers; parameter paths index into them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import optree
import torch

from .pytree import PyTree, register_node, tree_flatten_with_paths, tree_unflatten


@dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a tree lives in a flat buffer: paths, shapes and the tree structure."""

    treedef: optree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of_tree(cls, tree: PyTree) -> "FlatLayout":
        paths, leaves, treedef = tree_flatten_with_paths(tree)
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"a flat buffer holds only tensors, but leaf {path!r} is {type(leaf).__name__}"
                )
        return cls(treedef, tuple(paths), tuple(tuple(leaf.shape) for leaf in leaves))

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        offsets, total = [], 0
        for size in self.sizes:
            offsets.append(total)
            total += size
        return tuple(offsets)

    @functools.cached_property
    def numel(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {path: i for i, path in enumerate(self.paths)}

    def segments(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The 1-D view of each leaf in `buffer` (elements past `numel` are padding)."""
        if buffer.numel() != self.numel:
            buffer = buffer.narrow(0, 0, self.numel)
        return list(torch.split(buffer, self.sizes))

    def unflatten(self, buffer: torch.Tensor) -> PyTree:
        """The structured tree of views into `buffer`."""
        views = [seg.view(shape) for seg, shape in zip(self.segments(buffer), self.shapes)]
        return tree_unflatten(self.treedef, views)

    def flatten(self, tree: PyTree, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new flat buffer holding the leaves of `tree` (which must match this layout)."""
        layout = FlatLayout.of_tree(tree)
        if layout != self:
            raise ValueError(
                "tree does not match the flat layout: "
                f"{_describe_mismatch(self, layout)}"
            )
        leaves = optree.tree_leaves(tree, namespace="fspeed")
        if not leaves:
            return torch.empty(0, dtype=dtype or torch.float32)
        dtype = dtype or leaves[0].dtype
        return torch.cat([leaf.detach().reshape(-1).to(dtype) for leaf in leaves])


def _describe_mismatch(expected: FlatLayout, got: FlatLayout) -> str:
    missing = sorted(set(expected.paths) - set(got.paths))
    extra = sorted(set(got.paths) - set(expected.paths))
    if missing or extra:
        return f"missing {missing[:5]}, unexpected {extra[:5]}"
    for path, a, b in zip(expected.paths, expected.shapes, got.shapes):
        if a != b:
            return f"{path!r} has shape {list(b)}, expected {list(a)}"
    return "the tree structure differs"


class Flat:
    """Tensors of one dtype and device stored contiguously, addressed by parameter path.

    The buffer may be longer than the layout (zero padding at the end, so that ZeRO can split it
    into equal slices); leaf-wise math over the padding is harmless by construction (zeros).
    """

    __slots__ = ("buffer", "layout")

    def __init__(self, buffer: torch.Tensor, layout: FlatLayout):
        if buffer.dim() != 1 or buffer.numel() < layout.numel:
            raise ValueError(
                f"a Flat buffer must be 1-D with at least {layout.numel} elements, got shape {list(buffer.shape)}"
            )
        self.buffer = buffer
        self.layout = layout

    @classmethod
    def from_tree(
        cls, tree: PyTree, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        padded_numel: int | None = None,
    ) -> "Flat":
        """Copy the tensors of `tree` into one new contiguous buffer (zero-padded to `padded_numel`)."""
        layout = FlatLayout.of_tree(tree)
        buffer = layout.flatten(tree, dtype=dtype)
        if padded_numel is not None and padded_numel > buffer.numel():
            buffer = torch.cat([buffer, buffer.new_zeros(padded_numel - buffer.numel())])
        if device is not None:
            buffer = buffer.to(device)
        return cls(buffer, layout)

    def tree(self) -> PyTree:
        """The structured tree of views (writes to a view write to the buffer)."""
        return self.layout.unflatten(self.buffer)

    def segments(self) -> list[torch.Tensor]:
        return self.layout.segments(self.buffer)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(path, view) for every parameter, in layout order."""
        for path, seg, shape in zip(self.layout.paths, self.segments(), self.layout.shapes):
            yield path, seg.view(shape)

    def __getitem__(self, path: str) -> torch.Tensor:
        try:
            i = self.layout.index[path]
        except KeyError:
            raise KeyError(f"no parameter {path!r}; known paths start with {list(self.layout.paths[:5])}") from None
        start = self.layout.offsets[i]
        return self.buffer[start : start + self.layout.sizes[i]].view(self.layout.shapes[i])

    def with_buffer(self, buffer: torch.Tensor) -> "Flat":
        return Flat(buffer, self.layout)

    def to(self, dtype: torch.dtype) -> "Flat":
        """A copy with another dtype (a new buffer, even if the dtype is the same)."""
        return Flat(self.buffer.to(dtype, copy=True), self.layout)

    def clone(self) -> "Flat":
        return Flat(self.buffer.clone(), self.layout)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def numel(self) -> int:
        return self.layout.numel

    def __repr__(self) -> str:
        return (
            f"Flat({len(self.layout.paths)} tensors, {self.numel:,} elements, "
            f"{str(self.dtype).replace('torch.', '')}, {self.device})"
        )


register_node(
    Flat,
    lambda flat: ((flat.buffer,), flat.layout),
    lambda layout, children: Flat(next(iter(children)), layout),
    child_names=lambda layout: ("flat",),
)


class LooseGrads:
    """A gradient as backward left it: one 1-D tensor per parameter of `layout`, in its order, not
    one buffer. What a gradient sink that reduces nothing hands an optimizer whose fused `apply`
    takes it (`Capabilities.loose_grads`): no pass copies the whole gradient into a flat buffer,
    and none is held between steps (as an eager loop's `.grad`s)."""

    __slots__ = ("tensors", "layout", "norms")

    def __init__(self, tensors: list[torch.Tensor], layout: FlatLayout, norms: list[torch.Tensor] | None = None):
        if len(tensors) != len(layout.paths) or any(t.numel() != n for t, n in zip(tensors, layout.sizes)):
            raise ValueError(f"LooseGrads needs one tensor per parameter of the layout ({len(layout.paths)}), "
                             f"sized as the layout says; got {len(tensors)}")
        self.tensors, self.layout = tensors, layout
        self.norms = norms  # each tensor's L2 norm (0-d), when its maker took them (in cache, as they came)

    def segments(self) -> list[torch.Tensor]:
        return self.tensors

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def __repr__(self) -> str:
        return f"LooseGrads({len(self.tensors)} tensors, {self.layout.numel:,} elements)"


def segments(tree: PyTree) -> list[torch.Tensor]:
    """One tensor per parameter: a Flat contributes its per-parameter views, other leaves themselves.

    Per-tensor math (LAMB's trust ratio) is written over this list, so it works the same on a Flat
    and on a plain pytree.
    """
    out: list[torch.Tensor] = []
    for leaf in optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Flat), namespace="fspeed"):
        if isinstance(leaf, (Flat, LooseGrads)):
            out.extend(leaf.segments())
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


def flat_list(tree: Any) -> list[Flat] | None:
    """A Flat, or a list of them (a parameter group's runs), as a list; else None."""
    if isinstance(tree, Flat):
        return [tree]
    if isinstance(tree, (list, tuple)) and tree and all(isinstance(x, Flat) for x in tree):
        return list(tree)
    return None


def is_loose(grads: Any) -> bool:
    """A `LooseGrads`, or a list of them (a parameter group's runs of one)."""
    return isinstance(grads, LooseGrads) or (isinstance(grads, (list, tuple)) and bool(grads)
                                             and all(isinstance(x, LooseGrads) for x in grads))


def is_flat(x: Any) -> bool:
    return isinstance(x, Flat)
