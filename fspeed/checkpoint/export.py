"""Full weights out of any checkpoint: `export_weights` (and `exported` for the way back in).

    fs.checkpoint.export_weights("ck/global_step100", "model.safetensors", dtype=torch.bfloat16)
    params = fs.checkpoint.load_exported("model.safetensors", model)                 # model.init's tree
    state = fs.checkpoint.init_from_weights(state, "model.safetensors", mesh=mesh)   # fine-tuning

Export writes consolidated weights (fp32 masters where saved, else the compute copy) and the
model's state buffers under their parameter paths, which for a `functionalize`d module are its
`state_dict` names, so `module.load_state_dict(safetensors.torch.load_file(...))` takes them
(pass `aliases=` to also write a tied parameter under each of its names). It is streamed: the
header is written from meta.json's index, then one tensor at a time is assembled from its saved
boxes, cast and written, so no more than one tensor is ever in memory. `max_shard_bytes` splits
the output into `model-00001-of-0000N.safetensors` files and a `model.safetensors.index.json`,
as Hugging Face does.

A model whose vocabulary was padded (fspeed-train pads the reference GPT's embedding to a multiple
of 8 x parallel.tensor rows and records it in the checkpoint's client_state) is exported with its
true vocabulary: the padding rows are dropped (`keep_vocab_padding=True` keeps them), and the
file's `fspeed_vocab` metadata says so (size, padded size, tensors, padding dropped or kept).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .directory import checkpoint_path, latest_tag
from .errors import CheckpointError
from .exported import ALIASES_FIELD, INDEX_FILE, VOCAB_FIELD, VOCAB_KEY, init_from_weights, load_exported, weight_files
from .meta import read_meta_file, verify_files
from .slices import Box, Slot
from .tensor_file import SAFETENSORS_DTYPES, open_tensor_file
from .universal import SHARED, ChunkReader, file_index, fill_slot, lowest_rank_copies

_TENSORS_FILE = "tensors.safetensors"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory: `path` itself, or the tag `latest` names when `path` holds checkpoints."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    if path.name == "latest" and path.is_file():
        path = path.parent
    tag = latest_tag(path) if path.is_dir() else None
    if tag is None:
        raise CheckpointError(f"{path} is neither an fspeed checkpoint (no meta.json) nor a directory with 'latest'")
    return checkpoint_path(path, tag)


def _weights(index: dict) -> dict[str, str]:
    """Exported name -> saved key: fp32 masters where saved, else params; then state buffers."""
    out: dict[str, str] = {}
    for key in index:
        head, _, rest = key.partition("/")
        if head == "master" or (head == "params" and f"master/{rest}" not in index):
            out[rest] = key
        elif key.startswith("buffers."):
            out[key[len("buffers."):]] = key
    return dict(sorted(out.items()))


def _assemble(entry: dict, chunks: ChunkReader, key: str) -> torch.Tensor:
    """The whole tensor of `entry` from its shared boxes (or, per rank, the lowest rank's copy)."""
    dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}[entry["dtype"]]
    shape = tuple(entry["shape"])
    out = torch.empty(shape, dtype=dtype)
    usable = entry["chunks"] if all(c[4] == SHARED for c in entry["chunks"]) else lowest_rank_copies(entry["chunks"])
    fill_slot(Slot(key, Box((0,) * len(shape), shape), out), key, usable, chunks)
    return out


def write_streamed(path: Path, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                   produce: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file of `specs` (name, dtype, shape), asking `produce(name)` for one
    tensor at a time; atomic (a temporary name, fsynced, renamed). Returns the data bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in specs:
            tensor = produce(name).to(dtype).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{name}: produced shape {list(tensor.shape)}, declared {list(shape)}")
            if tensor.numel():
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offset


def export_weights(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: str | torch.dtype = "fp32",
                   max_shard_bytes: int = 0, aliases: Optional[Mapping[str, Sequence[str]]] = None,
                   keep_vocab_padding: bool = False) -> list[Path]:
    """Write the full weights of `checkpoint` (a checkpoint directory, or a directory with `latest`)
    to `out`: one safetensors file, or with `max_shard_bytes` > 0 a directory of shards and an HF
    index. `dtype`: fp32, bf16 or fp16 (floating tensors only; integer buffers keep theirs).
    `aliases` (held name -> every name, `functionalize`'s ties) writes tied weights under every
    name. A padded vocabulary loses its padding rows unless `keep_vocab_padding` (module docstring).
    Returns the files written."""
    dtype = _check_dtype(dtype)
    path = resolve_checkpoint(checkpoint)
    meta = read_meta_file(path)
    verify_files(path, meta, sorted(meta["files"]))
    index = meta.get("index") or file_index(open_tensor_file(path / _TENSORS_FILE), _TENSORS_FILE)
    weights = _weights(index)
    names = {name: key for name, key in weights.items()}
    for held, every in (aliases or {}).items():
        if held not in weights:
            raise CheckpointError(f"aliases names {held!r}, which {path} does not hold; it holds "
                                  f"{list(weights)[:5]}...")
        names.update({alias: weights[held] for alias in every})
    names = dict(sorted(names.items()))
    chunks = ChunkReader(path)
    metadata = {"format": "pt", "fspeed_checkpoint": str(path), "fspeed_step": str(meta["step"])}
    if aliases:
        metadata[ALIASES_FIELD] = json.dumps({k: list(v) for k, v in aliases.items()})
    rows = {}  # exported name -> rows written, for the tensors whose vocabulary padding is dropped
    vocab = (meta.get("client_state") or {}).get(VOCAB_KEY)
    if vocab:
        vocab = _check_vocab(vocab, path, index, weights)
        metadata[VOCAB_FIELD] = json.dumps({**vocab, "padding": "kept" if keep_vocab_padding else "dropped"})
        if not keep_vocab_padding:
            rows = {name: vocab["size"] for name, key in names.items() if key in {weights[t] for t in vocab["tensors"]}}

    def out_dtype(key: str) -> torch.dtype:
        saved = {v: k for k, v in SAFETENSORS_DTYPES.items()}[index[key]["dtype"]]
        return dtype if saved.is_floating_point else saved

    def shape(name: str) -> tuple[int, ...]:
        saved = tuple(index[names[name]]["shape"])
        return (rows[name], *saved[1:]) if name in rows else saved

    def produce(name: str) -> torch.Tensor:
        tensor = _assemble(index[names[name]], chunks, names[name])
        return tensor[:rows[name]] if name in rows else tensor

    specs = [(name, out_dtype(key), shape(name)) for name, key in names.items()]
    out = Path(out)
    if max_shard_bytes <= 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_streamed(out, specs, produce, metadata)
        return [out]
    return _write_shards(out, specs, produce, metadata, max_shard_bytes)


def _check_vocab(vocab: Any, path: Path, index: dict, weights: dict[str, str]) -> dict:
    """The client_state's vocabulary record, checked against the saved tensors."""
    try:
        size, padded, tensors = int(vocab["size"]), int(vocab["padded_size"]), [str(t) for t in vocab["tensors"]]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: client_state[{VOCAB_KEY!r}] = {vocab!r} is not a vocabulary record "
                              "(size, padded_size, tensors)") from None
    for name in tensors:
        saved = index[weights[name]]["shape"] if name in weights else None
        if not saved or saved[0] != padded or not 0 < size <= padded:
            raise CheckpointError(f"{path}: client_state[{VOCAB_KEY!r}] says {name} has {padded} rows of which "
                                  f"{size} are the vocabulary, but it holds {saved if saved else 'no such tensor'}")
    return {"size": size, "padded_size": padded, "tensors": tensors}


def _write_shards(out: Path, specs: list, produce: Callable, metadata: dict, max_shard_bytes: int) -> list[Path]:
    groups: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(torch.Size(spec[2]).numel()) * torch.empty((), dtype=spec[1]).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    files, weight_map, total = [], {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_streamed(out / name, group, produce, metadata)
        weight_map.update({spec[0]: name for spec in group})
        files.append(out / name)
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return files + [out / INDEX_FILE]


def _check_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r}: allowed are {', '.join(_DTYPES)}")


__all__ = ["INDEX_FILE", "export_weights", "init_from_weights", "load_exported", "resolve_checkpoint", "weight_files",
           "write_streamed"]
