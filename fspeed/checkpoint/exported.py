"""Exported weights back in: into a fresh state (`init_from_weights`) or the model's own tree (`load_exported`).

    state = fs.checkpoint.init_from_weights(state, "model.safetensors")     # any layout (fine-tuning)
    params = fs.checkpoint.load_exported("model.safetensors", model)        # model.init's tree

A source is a single `.safetensors` file, a directory with one or an HF index, or (for
`init_from_weights`) a `torch.distributed.checkpoint` directory (`dcp_interop`). Names are the
parameter paths. An export whose vocabulary padding was dropped (`export_weights`, its
`fspeed_vocab` metadata) goes back into a padded model: its rows fill the leading rows and the
padding rows (token ids no tokenizer produces) are zero. A missing, unexpected or mis-shaped key is
an error listing all of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..models import Model
from ..pytree import PyTree, tree_flatten_with_paths, tree_unflatten
from ..train_state import TrainState
from .dcp_interop import DcpWeights, is_dcp
from .directory import LATEST_FILE
from .errors import CheckpointError
from .meta import META_FILE
from .slices import Box, Slot
from .tensor_file import open_tensor_file
from .universal import SHARED, ChunkReader, fill_slot, global_shape, state_slots

INDEX_FILE = "model.safetensors.index.json"
ALIASES_FIELD = "fspeed_aliases"
VOCAB_FIELD = "fspeed_vocab"  # JSON: {"size", "padded_size", "tensors", "padding": "dropped" | "kept"}
VOCAB_KEY = "vocab"  # client_state: {"size", "padded_size", "tensors"} of a model whose vocabulary is padded
_PADDING = "<zero padding rows>"


def weight_files(source: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> file of a safetensors file, or of a directory holding one or an HF index."""
    source = Path(source)
    if source.is_file() and source.name == LATEST_FILE or (source / META_FILE).is_file() \
            or (source / LATEST_FILE).is_file():
        raise CheckpointError(f"{source} is an fspeed checkpoint, not exported weights: export it first "
                              f"(fspeed-export {source} model.safetensors), or resume it (checkpoint.resume=true)")
    if source.is_file():
        files = [source]
    elif (source / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((source / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{source / INDEX_FILE} is not an index of safetensors shards ({e})") from None
        return {name: source / file for name, file in weight_map.items()}
    elif source.is_dir():
        files = sorted(source.glob("*.safetensors"))
        if len(files) != 1:
            raise CheckpointError(f"{source} holds {len(files)} .safetensors files and no {INDEX_FILE}; give one file "
                                  "or a directory with one file or an index")
    else:
        raise CheckpointError(f"{source} does not exist")
    out = {}
    for file in files:
        reader = open_tensor_file(file)
        out.update({name: file for name in reader.keys()})
    return out


@dataclass
class _Weights:
    """The tensors at a source: shapes by name, a chunk reader, the tied names and the vocabulary record."""

    source: Path
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, Path]
    chunks: Any  # ChunkReader or DcpWeights
    aliases: set[str]
    vocab: Optional[dict]

    def read(self, chunk: list, box: Box) -> torch.Tensor:
        if chunk[0] == _PADDING:
            return torch.zeros(box.shape)
        return self.chunks.read(chunk, box)

    @property
    def path(self) -> Path:  # for fill_slot's messages
        return self.source

    def rows(self, name: str, model_shape: tuple[int, ...]) -> Optional[int]:
        """How many leading rows of `name` the source fills in a model tensor of `model_shape` (the
        rest are vocabulary padding); None when the shapes do not fit."""
        shape = self.shapes[name]
        if shape == model_shape:
            return shape[0] if shape else None
        vocab = self.vocab or {}
        if name not in vocab.get("tensors", ()) or len(shape) != len(model_shape) or shape[1:] != model_shape[1:]:
            return None
        rows = min(shape[0], model_shape[0])
        return rows if rows >= vocab.get("size", shape[0] + 1) else None

    def fill(self, name: str, slot: Slot, model_shape: tuple[int, ...]) -> None:
        rows = self.rows(name, model_shape)
        if rows is None or not model_shape:
            chunks = [[self.files[name].name, name, [0] * len(model_shape), list(model_shape), SHARED]]
        else:
            rest = [0] * (len(model_shape) - 1)
            chunks = [[self.files[name].name, name, [0, *rest], [rows, *model_shape[1:]], SHARED]]
            if rows < model_shape[0]:
                chunks.append([_PADDING, name, [rows, *rest], [model_shape[0] - rows, *model_shape[1:]], SHARED])
        fill_slot(slot, name, chunks, self)


def _open(source: str | os.PathLike) -> _Weights:
    source = Path(source)
    if is_dcp(source):
        dcp = DcpWeights(source)
        return _Weights(source, dcp.shapes, {name: Path(name) for name in dcp.shapes}, dcp, set(), None)
    files = weight_files(source)
    readers = {file: open_tensor_file(file) for file in set(files.values())}
    aliases, vocab = set(), None
    for reader in readers.values():
        metadata = reader.metadata() or {}
        if metadata.get(ALIASES_FIELD):
            aliases.update(a for held, every in json.loads(metadata[ALIASES_FIELD]).items() for a in every
                           if a != held)
        if metadata.get(VOCAB_FIELD):
            vocab = json.loads(metadata[VOCAB_FIELD])
    shapes = {name: tuple(readers[files[name]].get_slice(name).get_shape()) for name in files}
    chunks = ChunkReader(source if source.is_dir() else source.parent, {f.name: r for f, r in readers.items()})
    return _Weights(source, shapes, files, chunks, aliases, vocab)


def _check_names(weights: _Weights, wanted: dict[str, tuple[int, ...]], what: str) -> None:
    """A CheckpointError listing every missing, unexpected and mis-shaped name (`wanted`: name -> model shape)."""
    shapes = weights.shapes
    missing = sorted(set(wanted) - set(shapes))
    unexpected = sorted(set(shapes) - set(wanted) - weights.aliases)
    misshaped = [f"{n} is {list(shapes[n])}, the model's is {list(s)}" for n, s in wanted.items()
                 if n in shapes and shapes[n] != s and weights.rows(n, s) is None]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s): {missing[:8]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {unexpected[:8]}")
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped: {', '.join(misshaped[:8])}")
    if problems:
        raise CheckpointError(f"{weights.source} does not fit {what}: " + "; ".join(problems))


def init_from_weights(state: TrainState, source: str | os.PathLike) -> TrainState:
    """`state` (any layout) with its parameters, fp32 masters and buffers taken from the weights at
    `source` (module docstring); the optimizer state and counters stay fresh. Each rank reads only
    the slices it holds. Raises CheckpointError listing every missing, unexpected or mis-shaped key."""
    weights = _open(source)
    slots, _ = state_slots(state)
    wanted: dict[str, list[Slot]] = {}
    for slot in slots:
        head, _, rest = slot.key.partition("/")
        if head in ("params", "master"):
            wanted.setdefault(rest, []).append(slot)
        elif slot.key.startswith("buffers."):
            wanted.setdefault(slot.key[len("buffers."):], []).append(slot)
    shapes = {name: tuple(global_shape(name_slots[0], state)) for name, name_slots in wanted.items()}
    _check_names(weights, shapes, "this model")
    for name, name_slots in wanted.items():
        for slot in name_slots:
            weights.fill(name, slot, shapes[name])
    return state


def load_exported(source: str | os.PathLike, model: Model | PyTree, *, buffers: bool = False) -> Any:
    """The parameter tree of `model` (a Model: the tree its `init` builds; or such a tree itself, which
    gives the structure, dtypes and devices) with the values of the exported weights at `source`.
    With `buffers=True`, returns `(params, buffers)`, the buffers of `model.init_buffers()` filled too.
    Raises CheckpointError listing every missing, unexpected or mis-shaped key."""
    if buffers and not (isinstance(model, Model) and model.init_buffers is not None):
        raise ValueError("load_exported(buffers=True) needs a Model that has buffers (model.init_buffers)")
    trees = [model.init(torch.Generator().manual_seed(0)) if isinstance(model, Model) else model]
    if buffers:
        trees.append(model.init_buffers())
    weights = _open(source)
    flat = [tree_flatten_with_paths(tree) for tree in trees]
    wanted = {path: tuple(leaf.shape) for paths, leaves, _ in flat for path, leaf in zip(paths, leaves)}
    if not buffers and isinstance(model, Model) and model.init_buffers is not None:
        weights.aliases.update(tree_flatten_with_paths(model.init_buffers())[0])  # in the file, not asked for
    _check_names(weights, wanted, getattr(model, "name", "this parameter tree"))
    out = []
    for paths, leaves, treedef in flat:
        filled = []
        for path, leaf in zip(paths, leaves):
            value = torch.empty_like(leaf)
            weights.fill(path, Slot(path, Box((0,) * leaf.dim(), tuple(leaf.shape)), value), tuple(leaf.shape))
            filled.append(value)
        out.append(tree_unflatten(treedef, filled))
    return (out[0], out[1]) if buffers else out[0]


__all__ = ["ALIASES_FIELD", "INDEX_FILE", "VOCAB_FIELD", "VOCAB_KEY", "init_from_weights", "load_exported",
           "weight_files"]
