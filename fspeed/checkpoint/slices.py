"""Where a rank's tensors sit in the global ones: every stored piece as boxes of a global tensor.

A rank stores flat buffers (`Flat`s) whose 1-D pieces are named by parameter path
(`fspeed.parallel.layout`): a parameter's tensor-parallel block, whole (stage 0, stage-3 persistent
parameters) or cut to a contiguous range of its flattened elements (a ZeRO-1/2 partition or a
ZeRO-3 shard; padding has no path and never leaves the rank). A contiguous range of a row-major
tensor is a union of at most 2*ndim - 1 boxes (a partial first row, whole rows, a partial last
row, recursively), and a box of a tensor-parallel block is a box of the global tensor shifted by
the block's offset. So every piece becomes a few `Box`es of a global tensor, and a checkpoint that
stores boxes under global names fits any layout: loading asks, for each box a rank needs, which
saved boxes intersect it. Pipeline stages, once built, are one more such shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..flat import Flat, FlatLayout
from ..parallel.layout import Layout
from ..parallel.specs import PartitionSpec


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: its start and its shape per dim."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: "Box") -> Optional["Box"]:
        lo = tuple(max(a, b) for a, b in zip(self.start, other.start))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.start, self.shape, other.start, other.shape))
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))

    def within(self, outer: "Box") -> tuple[slice, ...]:
        """This box as slices of `outer`'s tensor."""
        return tuple(slice(a - o, a - o + n) for a, o, n in zip(self.start, outer.start, self.shape))


def range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes whose union is the flat range [lo, hi) of a row-major tensor of `shape`, in order."""
    shape = tuple(shape)
    if hi <= lo:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    boxes: list[Box] = []
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        boxes += [Box((row,) + b.start, (1,) + b.shape) for b in range_boxes(shape[1:], lo - row * inner,
                                                                               end - row * inner)]
        lo, row = end, row + 1
    full = (hi - lo) // inner
    if full > 0:
        boxes.append(Box((row,) + (0,) * (len(shape) - 1), (full,) + shape[1:]))
        lo, row = lo + full * inner, row + full
    if lo < hi:  # a partial last row
        boxes += [Box((row,) + b.start, (1,) + b.shape) for b in range_boxes(shape[1:], 0, hi - lo)]
    return boxes


def box_view(piece: torch.Tensor, local_shape: Sequence[int], lo: int, box: Box) -> torch.Tensor:
    """The view of `box` (in local coordinates) in `piece`, the 1-D flat range starting at `lo` of
    a row-major tensor of `local_shape` (the box lies inside that range)."""
    strides = [math.prod(local_shape[d + 1:]) for d in range(len(local_shape))]
    offset = sum(s * st for s, st in zip(box.start, strides)) - lo
    return piece.as_strided(box.shape, strides, piece.storage_offset() + offset)


def block_start(spec: PartitionSpec, local_shape: Sequence[int], mesh_sizes: dict, coords: dict) -> tuple[int, ...]:
    """Where this rank's tensor-parallel block starts in the global tensor (`specs.shard`'s chunks)."""
    start = []
    for entry, size in zip(spec, local_shape):
        index = 0
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            index = index * mesh_sizes.get(axis, 1) + coords.get(axis, 0)
        start.append(index * size)
    return tuple(start)


@dataclass(frozen=True)
class Piece:
    """A piece of a Flat: the parameter it belongs to and the flat range [lo, hi) of its local block."""

    index: int  # the piece's index among the Flat's leaves
    path: str
    lo: int
    hi: int


def _ranges(paths: Sequence[str], offsets: Sequence[int], sizes: Sequence[int], lo: int, hi: int) -> Iterator[tuple]:
    for path, off, size in zip(paths, offsets, sizes):
        a, b = max(off, lo), min(off + size, hi)
        if a < b:
            yield path, a - off, b - off


def flat_pieces(layout: Layout, flat_layout: FlatLayout) -> list[Piece]:
    """The pieces of a Flat of the state built with `layout` (params, masters, optimizer moments):
    which parameter and which range of its local block each leaf holds. Padding is left out."""
    if flat_layout is layout.local or flat_layout == layout.local:
        return [Piece(i, p, 0, n) for i, (p, n) in enumerate(zip(flat_layout.paths, flat_layout.sizes))]
    if flat_layout is layout.partition or flat_layout == layout.partition:
        part = layout.partition_numel
        lo = layout.data_rank * part
        ranges = list(_ranges(layout.local.paths, layout.local.offsets, layout.local.sizes, lo, lo + part))
    elif layout.stage == 3 and flat_layout in (layout.storage, layout.param_storage):
        ranges = []
        for unit in layout.units:
            if unit.sharded:
                lo = layout.data_rank * unit.shard_numel
                sl = unit.shard_layout
                ranges += _ranges(sl.paths, sl.offsets, sl.sizes, lo, lo + unit.shard_numel)
            if not layout.persistent:
                ranges += [(layout.params[i].path, 0, layout.params[i].local_numel) for i in unit.resident_params]
        if layout.persistent:
            whole = layout.persistent_layout
            if flat_layout == layout.storage:  # the rank's partition of them (masters, moments)
                lo = layout.data_rank * layout.persistent_part
                ranges += _ranges(whole.paths, whole.offsets, whole.sizes, lo, lo + layout.persistent_part)
            else:  # the compute parameters: their whole copies (the partition's copy is named zero.persistent)
                ranges += [(path, 0, size) for path, size in zip(whole.paths, whole.sizes)]
    else:
        raise TypeError("a Flat of this state matches none of its layout's buffers (local, partition, storage, "
                        "param_storage); cannot map it to global parameters")
    names = [p for p in flat_layout.paths]
    pieces, at = [], 0
    for i, name in enumerate(names):
        if at < len(ranges) and ranges[at][0] == name:
            pieces.append(Piece(i, *ranges[at]))
            at += 1
    if at != len(ranges):
        raise TypeError("a Flat's pieces do not follow its layout's order; cannot map it to global parameters")
    return pieces


@dataclass(frozen=True)
class Slot:
    """A box of a global tensor a rank holds, and the view of it in the rank's memory."""

    key: str
    box: Box
    view: torch.Tensor


def flat_slots(prefix: str, flat: Flat, layout: Layout) -> list[Slot]:
    """Every box of global tensors a Flat holds, keyed `prefix/param_path`, with views into it."""
    sizes, coords, info = dict(layout.mesh_sizes), dict(layout.mesh_coords), layout.info
    leaves = flat.layout.segments(flat.buffer)
    slots = []
    for piece in flat_pieces(layout, flat.layout):
        p = info[piece.path]
        origin = block_start(p.spec, p.local_shape, sizes, coords)
        for box in range_boxes(p.local_shape, piece.lo, piece.hi):
            view = box_view(leaves[piece.index], p.local_shape, piece.lo, box)
            shifted = Box(tuple(s + o for s, o in zip(box.start, origin)), box.shape)
            slots.append(Slot(f"{prefix}/{piece.path}", shifted, view))
    return slots


__all__ = ["Box", "Piece", "Slot", "block_start", "box_view", "flat_pieces", "flat_slots",
           "range_boxes"]
