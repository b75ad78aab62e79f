"""The layout-free checkpoint: boxes of global tensors under global names, loadable into any layout.

Saving (every rank, one collective): each rank lists the boxes of global tensors it holds
(`state_slots`); a box held by several ranks (replicated parameters, stage-0 optimizer
state, a tensor-parallel-replicated norm weight) is written once, by the lowest such rank, if
every copy is equal; copies that differ are state that belongs to each rank (1-bit optimizers'
error buffers, 0/1 Adam's local drift, per-rank BatchNorm statistics) and every rank writes its
own, marked with its rank. meta.json's `index` says, per tensor key, its global shape, dtype and
where each box is:

    index[key] = {"shape": [..], "dtype": "F32", "chunks": [[file, name, start, shape, rank], ..]}

(rank -1: shared by every layout). Loading (any template, any mesh): each rank lists the boxes
it needs and reads only their intersections with the saved boxes, through safetensors' lazy
slices, straight into its buffers; no rank ever holds more than one intersection beyond its own
state. State that belongs to one rank is restored in the same layout and reset (with a warning
naming it) in another, as DeepSpeed's universal checkpoint drops it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from ..flat import Flat
from ..pytree import tree_flatten_with_paths
from ..train_state import TrainState
from .errors import CheckpointError
from .slices import Box, Slot, flat_slots
from .tensor_file import SAFETENSORS_DTYPES, open_tensor_file

log = logging.getLogger("fspeed")

SHARED = -1  # a chunk's rank when every layout may read it
_DTYPE_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
CAST_FROM_FP32 = (torch.bfloat16, torch.float16)
_SCALARS = (bool, int, float, str, type(None))


def state_slots(state: TrainState) -> tuple[list[Slot], dict[str, Any]]:
    """(every box of a global tensor the state holds, with its view; the non-tensor leaves by path)."""
    paths, leaves, _ = tree_flatten_with_paths(state, is_leaf=lambda x: isinstance(x, Flat))
    slots: list[Slot] = []
    scalars: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, Flat):
            slots += flat_slots(path, leaf, state.layout)
        elif isinstance(leaf, torch.Tensor):
            slots.append(Slot(path, Box((0,) * leaf.dim(), tuple(leaf.shape)), leaf.detach()))
        elif isinstance(leaf, _SCALARS):
            scalars[path] = leaf
        else:
            raise TypeError(f"cannot checkpoint state leaf {path!r} of type {type(leaf).__name__}")
    return slots, scalars


def global_shape(slot: Slot, state: TrainState) -> tuple[int, ...]:
    """The shape of the global tensor a slot is a box of: its parameter's, or its own (whole tensors)."""
    head, _, rest = slot.key.rpartition("/")
    info = state.layout.info.get(rest) if head and not slot.key.startswith("client_state/") else None
    return tuple(info.shape) if info is not None else tuple(slot.box.shape)


def chunk_name(key: str, box: Box) -> str:
    return f"{key}@{','.join(map(str, box.start))}"


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.blake2b(memoryview(t.reshape(-1).view(torch.uint8).numpy()), digest_size=16).hexdigest()


def assign_chunks(slots: list[Slot], rank: int, all_gather_objects) -> list[tuple[Slot, int]]:
    """Which of this rank's slots it writes, each with its rank (SHARED or this rank). A collective:
    duplicated boxes are compared by digest; equal copies are written once by the lowest rank."""
    mine = [(s.key, s.box.start, s.box.shape) for s in slots]
    holders: dict[tuple, list[int]] = {}
    for r, listed in enumerate(all_gather_objects(mine, "checkpoint boxes")):
        for entry in listed:
            holders.setdefault(entry, []).append(r)
    shared_by_several = [i for i, entry in enumerate(mine) if len(holders[entry]) > 1]
    digests = {mine[i]: _digest(slots[i].view) for i in shared_by_several}
    seen: dict[tuple, set] = {}
    for listed in all_gather_objects(digests, "checkpoint digests"):
        for entry, d in listed.items():
            seen.setdefault(entry, set()).add(d)
    out = []
    for slot, entry in zip(slots, mine):
        ranks = holders[entry]
        if len(ranks) == 1 or len(seen[entry]) == 1:
            if ranks[0] == rank:
                out.append((slot, SHARED))
        else:
            out.append((slot, rank))
    return out


def chunk_tensors(chunks: list[tuple[Slot, int]]) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """(the tensors of this rank's file by name, its index entries (key, name, start, shape, rank))."""
    tensors, entries = {}, []
    for slot, rank in chunks:
        name = chunk_name(slot.key, slot.box)
        tensors[name] = slot.view
        entries.append((slot.key, name, list(slot.box.start), list(slot.box.shape), rank))
    return tensors, entries


def build_index(per_rank: list[tuple[str, list[tuple], dict]]) -> dict:
    """meta.json's `index` from every rank's (file, index entries, {key: (global shape, dtype)})."""
    index: dict[str, dict] = {}
    for file, entries, described in per_rank:
        for key, (shape, dtype) in described.items():
            index.setdefault(key, {"shape": list(shape), "dtype": dtype, "chunks": []})
        for key, name, start, shape, rank in entries:
            index[key]["chunks"].append([file, name, start, shape, rank])
    return index


def describe(slots: list[Slot], state: TrainState) -> dict[str, tuple]:
    return {s.key: (global_shape(s, state), SAFETENSORS_DTYPES[s.view.dtype]) for s in slots}


def file_index(reader: Any, file: str) -> dict:
    """The index of a one-process checkpoint's tensor file: every tensor one whole box."""
    index = {}
    for key in reader.keys():
        sl = reader.get_slice(key)
        shape = list(sl.get_shape())
        index[key] = {"shape": shape, "dtype": sl.get_dtype(), "chunks": [[file, key, [0] * len(shape), shape,
                                                                            SHARED]]}
    return index


class ChunkReader:
    """Lazily opened tensor files of one checkpoint; reads a box's intersection with a chunk."""

    def __init__(self, path: Path, readers: Optional[dict[str, Any]] = None):
        self.path = path
        self.readers: dict[str, Any] = dict(readers or {})  # file name -> open reader

    def read(self, chunk: list, box: Box) -> torch.Tensor:
        file, name, start, shape, _ = chunk
        if file not in self.readers:
            self.readers[file] = open_tensor_file(self.path / file)
        try:
            sl = self.readers[file].get_slice(name)
            if not shape:
                return self.readers[file].get_tensor(name)
            return sl[box.within(Box(tuple(start), tuple(shape)))]
        except Exception as e:  # safetensors' own error types
            raise CheckpointError(f"{self.path / file}: cannot read tensor {name!r} ({e})") from None


def source_key(key: str, index: dict, prefer_master: bool) -> Optional[str]:
    """Which saved tensor fills `key`: fp32 masters are preferred for weights, across precisions."""
    head, _, rest = key.partition("/")
    if head == "params" and prefer_master and f"master/{rest}" in index:
        return f"master/{rest}"
    if key in index:
        return key
    if head == "master" and f"params/{rest}" in index:
        return f"params/{rest}"
    return None


def saved_sources(keys, saved: Any, prefer_master: bool, path: Path) -> dict[str, str]:
    """Which saved tensor fills each of `keys` (`source_key`); a CheckpointError naming the missing."""
    sources = {key: source_key(key, saved, prefer_master) for key in keys}
    missing = sorted(k for k, src in sources.items() if src is None)
    if missing:
        raise CheckpointError(
            f"{path} does not match the state it is loaded into: {len(missing)} tensors missing "
            f"(e.g. {missing[:4]}); was it saved with another model or optimizer? "
            "Use load_optimizer_states=False to load only the weights.")
    return sources


def fill_from_index(template: TrainState, index: dict, chunks: ChunkReader, *,
                    same_layout: bool, weights_only: bool, converting: bool) -> tuple[list[str], list[str]]:
    """Copy every box `template` holds from the saved chunks into its buffers. State that belonged
    to each saving rank is restored from this rank's own copy in the same layout; in another, a
    parameter-shaped tensor (0/1 Adam's local weights and moments) takes the lowest saving rank's
    copy and anything else (error buffers) keeps the template's fresh value. Returns (the keys
    reset, the keys taken from one rank)."""
    slots, _ = state_slots(template)
    wanted = [s for s in slots if not weights_only or s.key.startswith(("params/", "master/"))]
    prefer_master = template.master is None or converting
    by_key: dict[str, list[Slot]] = {}
    for slot in wanted:
        by_key.setdefault(slot.key, []).append(slot)
    sources = saved_sources(by_key, index, prefer_master, chunks.path)
    my_rank = _global_rank(template)
    reset: list[str] = []
    synced: list[str] = []
    for key, key_slots in by_key.items():
        source = sources[key]
        entry = index[source]
        usable = [c for c in entry["chunks"] if c[4] in (SHARED, my_rank)]
        if not same_layout and any(c[4] != SHARED for c in entry["chunks"]):
            if key.partition("/")[2] not in template.layout.info:
                reset.append(key)
                continue
            synced.append(key)
            usable = lowest_rank_copies(entry["chunks"])
        _check_fits(key, source, entry, key_slots[0], template, chunks.path)
        for slot in key_slots:
            fill_slot(slot, source, usable, chunks)
    return reset, synced


def lowest_rank_copies(chunks: list) -> list:
    """The shared chunks, and of each box saved per rank the copy of the lowest rank."""
    best: dict[tuple, list] = {}
    for c in chunks:
        box = (tuple(c[2]), tuple(c[3]))
        held = best.get(box)
        if held is None or (held[4] != SHARED and (c[4] == SHARED or c[4] < held[4])):
            best[box] = c
    return list(best.values())


def _check_fits(key: str, source: str, entry: dict, slot: Slot, template: TrainState, path: Path) -> None:
    shape = global_shape(slot, template)
    if list(shape) != entry["shape"]:
        raise CheckpointError(f"{path}: tensor {source!r} has global shape {entry['shape']}, the state expects "
                              f"{list(shape)}")
    saved, target = _DTYPE_OF[entry["dtype"]], slot.view.dtype
    if saved != target and not (key.startswith("params/") and saved == torch.float32 and target in CAST_FROM_FP32):
        raise CheckpointError(
            f"{path}: tensor {source!r} is {saved}, the state's {key!r} is {target}; the only conversion is fp32 "
            "weights cast to a bf16/fp16 compute copy (was it saved with another precision or optimizer?)")


def fill_slot(slot: Slot, source: str, usable: list, chunks: ChunkReader) -> None:
    covered = 0
    for chunk in usable:
        part = slot.box.intersect(Box(tuple(chunk[2]), tuple(chunk[3])))
        if part is None:
            continue
        value = chunks.read(chunk, part)
        with torch.no_grad():
            slot.view[part.within(slot.box)].copy_(value)
        covered += part.numel
    if covered != slot.box.numel:
        raise CheckpointError(
            f"{chunks.path}: tensor {source!r} is incomplete: the saved chunks cover {covered} of the "
            f"{slot.box.numel} elements at {list(slot.box.start)} (shape {list(slot.box.shape)}) this rank needs")


def _global_rank(state: TrainState) -> int:
    """This rank's global rank in the mesh the state was built on (pipe, data, model order)."""
    sizes, coords = dict(state.layout.mesh_sizes), dict(state.layout.mesh_coords)
    r = 0
    for axis in ("pipe", "data", "model"):
        r = r * sizes.get(axis, 1) + coords.get(axis, 0)
    return r


__all__ = ["CAST_FROM_FP32", "SHARED", "ChunkReader", "assign_chunks", "build_index", "chunk_tensors", "describe",
           "file_index", "fill_from_index", "fill_slot", "global_shape", "lowest_rank_copies", "saved_sources",
           "source_key", "state_slots"]
