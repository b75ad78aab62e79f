"""Full weights out of any checkpoint, and into a fresh state: `export_weights` and `init_from_weights`.

    fs.checkpoint.export_weights("ck/global_step100", "model.safetensors", dtype=torch.bfloat16)
    state = fs.checkpoint.init_from_weights(state, "model.safetensors", mesh=mesh)   # fine-tuning

Export writes consolidated weights (fp32 masters where saved, else the compute copy) and the
model's state buffers under their parameter paths, which for a `functionalize`d module are its
`state_dict` names, so `module.load_state_dict(safetensors.torch.load_file(...))` takes them
(pass `aliases=` to also write a tied parameter under each of its names). It is streamed: the
header is written from meta.json's index, then one tensor at a time is assembled from its saved
boxes, cast and written, so no more than one tensor is ever in memory. `max_shard_bytes` splits
the output into `model-00001-of-0000N.safetensors` files and a `model.safetensors.index.json`,
as Hugging Face does.

`init_from_weights` fills a state's parameters (and buffers) in any layout from such a file or
directory (a single `.safetensors`, a directory with one or an HF index, or a
`torch.distributed.checkpoint` directory: `dcp_interop`), each rank reading only its own slices;
a missing, unexpected or mis-shaped key is an error listing all of them.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..train_state import TrainState
from .dcp_interop import DcpWeights, is_dcp
from .directory import checkpoint_path, latest_tag
from .errors import CheckpointError
from .meta import read_meta_file, verify_files
from .slices import Box, Slot
from .tensor_file import SAFETENSORS_DTYPES, open_tensor_file
from .universal import SHARED, ChunkReader, file_index, fill_slot, global_shape, lowest_rank_copies, state_slots

INDEX_FILE = "model.safetensors.index.json"
_TENSORS_FILE = "tensors.safetensors"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES_FIELD = "fspeed_aliases"


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
                   max_shard_bytes: int = 0, aliases: Optional[Mapping[str, Sequence[str]]] = None) -> list[Path]:
    """Write the full weights of `checkpoint` (a checkpoint directory, or a directory with `latest`)
    to `out`: one safetensors file, or with `max_shard_bytes` > 0 a directory of shards and an HF
    index. `dtype`: fp32, bf16 or fp16 (floating tensors only; integer buffers keep theirs).
    `aliases` (held name -> every name, `functionalize`'s ties) writes tied weights under every
    name. Returns the files written."""
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

    def out_dtype(key: str) -> torch.dtype:
        saved = {v: k for k, v in SAFETENSORS_DTYPES.items()}[index[key]["dtype"]]
        return dtype if saved.is_floating_point else saved

    specs = [(name, out_dtype(key), tuple(index[key]["shape"])) for name, key in names.items()]
    metadata = {"format": "pt", "fspeed_checkpoint": str(path), "fspeed_step": str(meta["step"])}
    if aliases:
        metadata[_ALIASES_FIELD] = json.dumps({k: list(v) for k, v in aliases.items()})
    produce = lambda name: _assemble(index[names[name]], chunks, names[name])  # noqa: E731
    out = Path(out)
    if max_shard_bytes <= 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_streamed(out, specs, produce, metadata)
        return [out]
    return _write_shards(out, specs, produce, metadata, max_shard_bytes)


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


def weight_files(source: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> file of a safetensors file, or of a directory holding one or an HF index."""
    source = Path(source)
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
        raise CheckpointError(f"checkpoint.init_from: {source} does not exist")
    out = {}
    for file in files:
        reader = open_tensor_file(file)
        out.update({name: file for name in reader.keys()})
    return out


def init_from_weights(state: TrainState, source: str | os.PathLike) -> TrainState:
    """`state` (any layout) with its parameters, fp32 masters and buffers taken from the weights at
    `source` (module docstring); the optimizer state and counters stay fresh. Each rank reads only
    the slices it holds. Raises CheckpointError listing every missing, unexpected or mis-shaped key."""
    if is_dcp(Path(source)):
        dcp = DcpWeights(Path(source))
        shapes, chunks, files, aliases = dcp.shapes, dcp, {name: Path(name) for name in dcp.shapes}, set()
    else:
        files = weight_files(source)
        readers = {file: open_tensor_file(file) for file in set(files.values())}
        aliases = set()
        for reader in readers.values():
            extra = (reader.metadata() or {}).get(_ALIASES_FIELD)
            if extra:
                aliases.update(a for held, every in json.loads(extra).items() for a in every if a != held)
        shapes = {name: tuple(readers[files[name]].get_slice(name).get_shape()) for name in files}
        chunks = ChunkReader(Path(source) if Path(source).is_dir() else Path(source).parent,
                             {file.name: reader for file, reader in readers.items()})
    slots, _ = state_slots(state)
    wanted: dict[str, list[Slot]] = {}
    for slot in slots:
        head, _, rest = slot.key.partition("/")
        if head in ("params", "master"):
            wanted.setdefault(rest, []).append(slot)
        elif slot.key.startswith("buffers."):
            wanted.setdefault(slot.key[len("buffers."):], []).append(slot)
    problems = _name_problems(wanted, shapes, state, aliases)
    if problems:
        raise CheckpointError(f"checkpoint.init_from={source} does not fit this model: " + "; ".join(problems))
    for name, name_slots in wanted.items():
        chunk = [files[name].name, name, [0] * len(shapes[name]), list(shapes[name]), SHARED]
        for slot in name_slots:
            fill_slot(slot, name, [chunk], chunks)
    return state


def _name_problems(wanted: dict[str, list[Slot]], shapes: dict[str, tuple], state: TrainState,
                   aliases: Iterable[str]) -> list[str]:
    missing = sorted(set(wanted) - set(shapes))
    unexpected = sorted(set(shapes) - set(wanted) - set(aliases))
    misshaped = [f"{n} is {list(shapes[n])}, the model's is {list(global_shape(s[0], state))}"
                 for n, s in wanted.items() if n in shapes and tuple(global_shape(s[0], state)) != shapes[n]]
    out = []
    if missing:
        out.append(f"{len(missing)} missing key(s): {missing[:8]}")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected key(s): {unexpected[:8]}")
    if misshaped:
        out.append(f"{len(misshaped)} mis-shaped: {', '.join(misshaped[:8])}")
    return out


__all__ = ["INDEX_FILE", "export_weights", "init_from_weights", "resolve_checkpoint", "weight_files", "write_streamed"]
