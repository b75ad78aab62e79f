"""Checkpoints: a whole TrainState plus the user's client_state under `dir/tag/`, with `dir/latest`.

Layout of `dir/tag/`:

    tensors.safetensors   every tensor, keyed by tree path and parameter path
                          (`params/blocks.0.attn.wqkv`, `opt_state.1.mu/blocks.0.attn.wqkv`)
    meta.json             format, step, the non-tensor leaves (counters, scaler, lrs) by path,
                          client_state (tensors replaced by references), file sizes and sha256

A sharded state (a ZeRO / tensor-slicing plan over several ranks) is saved by every rank
together (`mesh=`): each rank streams its own part to `rank_00000.safetensors`, ... (its local
flat buffers: a shard for ZeRO, a slice for tensor slicing), `meta.json` records the layout, and
only the same plan on the same mesh sizes loads it back (resharding is not built yet).

Saving is atomic: everything is written into a temporary directory, fsynced, and renamed into
place; `latest` is replaced atomically afterwards. A crash at any point leaves the previous
checkpoint intact and `latest` pointing at it. Loading runs no pickle (safetensors + JSON),
verifies checksums, and fills a template state by path (so a one-process checkpoint loads into
another precision). Tensors are streamed from their flat buffers: no copy of the
state is made in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from .flat import Flat
from .pytree import tree_flatten_with_paths, tree_unflatten
from .train_state import TrainState

FORMAT = "fspeed-checkpoint/1"
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
LATEST_FILE = "latest"

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_SCALARS = (bool, int, float, str, type(None))


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted or does not match the state it is loaded into."""


def state_entries(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by key, non-tensor leaves by path) of a TrainState; Flats expand per parameter."""
    paths, leaves, _ = tree_flatten_with_paths(state, is_leaf=lambda x: isinstance(x, Flat))
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, Flat):
            for param_path, view in leaf.items():
                tensors[f"{path}/{param_path}"] = view
        elif isinstance(leaf, torch.Tensor):
            tensors[path] = leaf
        elif isinstance(leaf, _SCALARS):
            scalars[path] = leaf
        else:
            raise TypeError(f"cannot checkpoint state leaf {path!r} of type {type(leaf).__name__}")
    return tensors, scalars


def _split_client_state(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON form of client_state; tensors move to `tensors` under `client_state/<path>`."""
    if isinstance(value, torch.Tensor):
        key = f"client_state/{path}"
        tensors[key] = value.detach().contiguous()
        return {"__tensor__": key}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(f"client_state keys must be strings; {path or 'the root'} has key {k!r}")
        return {k: _split_client_state(v, f"{path}.{k}" if path else k, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split_client_state(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(value)]
    if isinstance(value, float) and value != value:
        return {"__float__": "nan"}
    if isinstance(value, _SCALARS):
        return value
    raise TypeError(
        f"client_state value at {path or 'the root'!r} is a {type(value).__name__}; allowed: tensors, "
        "dicts with str keys, lists, tuples, str, int, float, bool, None"
    )


def _join_client_state(value: Any, reader) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return reader(value["__tensor__"]).clone()
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _join_client_state(v, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_client_state(v, reader) for v in value]
    return value


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the safetensors format directly, streaming each tensor's bytes (no in-memory copy)."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    items = []
    for key, tensor in tensors.items():
        if tensor.dtype not in _ST_DTYPES:
            raise TypeError(f"cannot save tensor {key!r} of dtype {tensor.dtype}")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        items.append(tensor)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for tensor in items:
            if tensor.numel():
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty name without '/' that does not start with '.'")
    return tag


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    tag: Optional[str] = None,
    client_state: Optional[dict] = None,
    save_latest: bool = True,
    mesh=None,
) -> Path:
    """Save `state` (and `client_state`) atomically under `directory/tag`; returns that path.

    `tag` defaults to `global_step{state.step}` as in DeepSpeed. Saving over an existing tag
    replaces it atomically as well. A sharded state (built with a plan on a mesh of several
    ranks) needs `mesh=`: a collective, every rank writes its own file into the same directory
    (a filesystem all ranks share), rank 0 writes the metadata once every file is on disk.
    """
    directory = Path(directory)
    tag = _check_tag(tag or f"global_step{state.step}")
    if _is_sharded(state, mesh, "save_checkpoint"):
        return _save_sharded(directory, state, tag, client_state, save_latest, mesh)
    tensors, scalars = state_entries(state)
    client_json = _split_client_state(client_state or {}, "", tensors)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=directory))
    try:
        _write_safetensors(tmp / TENSORS_FILE, tensors)
        meta = _meta(tag, state, scalars, client_json, {TENSORS_FILE: _file_info(tmp / TENSORS_FILE)})
        final = _publish(directory, tmp, tag, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if save_latest:
        _write_latest(directory, tag)
    return final


def _is_sharded(state: TrainState, mesh, what: str) -> bool:
    """Whether `state` lives on several ranks (then each rank keeps its own file)."""
    if math.prod(size for _, size in state.layout.mesh_sizes) == 1:
        return False
    if mesh is None:
        raise ValueError(f"{what}: this state is sharded (zero stage {state.layout.stage} on mesh "
                         f"{dict(state.layout.mesh_sizes)}); pass mesh= so that every rank takes part")
    return True


def _file_info(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _meta(tag: str, state: TrainState, scalars: dict, client_json: Any, files: dict) -> dict:
    return {"format": FORMAT, "tag": tag, "step": state.step, "precision": state.precision.name,
            "scalars": scalars, "client_state": client_json, "files": files}


def _publish(directory: Path, tmp: Path, tag: str, meta: dict) -> Path:
    """Write meta.json into `tmp`, then rename `tmp` to `directory/tag` (replacing it atomically)."""
    with open(tmp / META_FILE, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = directory / tag
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{tag}.old-", dir=directory))
        os.rename(final, old / tag)
    os.rename(tmp, final)
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def layout_signature(layout) -> dict:
    """What must be equal for a rank's saved file to fit a rank of another run (same shards)."""
    return {
        "stage": layout.stage,
        "mesh": {axis: size for axis, size in layout.mesh_sizes},
        "params": {p.path: [list(p.shape), str(p.spec)] for p in layout.params},
        "sharded_units": {u.name: u.shard_numel for u in layout.units if u.sharded},
    }


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _save_sharded(directory: Path, state: TrainState, tag: str, client_state: Optional[dict],
                  save_latest: bool, mesh) -> Path:
    rank = mesh.rank
    all_gather_objects = mesh.all_gather_objects
    tmp_name = None
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        tmp_name = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=directory)
    tmp = Path(all_gather_objects(tmp_name, "checkpoint directory")[0])
    tensors, scalars = state_entries(state)
    client_json = _split_client_state(client_state or {}, "", tensors) if rank == 0 else None
    try:
        _write_safetensors(tmp / _rank_file(rank), tensors)
        report = (True, _file_info(tmp / _rank_file(rank)))
    except Exception as e:  # tell the other ranks before raising, so nobody waits or publishes
        report = (False, f"{type(e).__name__}: {e}")
    reports = all_gather_objects(report, "checkpoint files")
    failed = [f"rank {r}: {info}" for r, (ok, info) in enumerate(reports) if not ok]
    outcome = None
    if rank == 0:
        try:
            if failed:
                raise CheckpointError(f"saving {directory / tag} failed on {len(failed)} rank(s): "
                                      + "; ".join(failed) + ". The previous checkpoint is untouched.")
            meta = _meta(tag, state, scalars, client_json,
                         {_rank_file(r): info for r, (_, info) in enumerate(reports)})
            meta["layout"] = layout_signature(state.layout)
            meta["client_file"] = _rank_file(0)
            final = _publish(directory, tmp, tag, meta)
            if save_latest:
                _write_latest(directory, tag)
            outcome = (True, str(final))
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = (False, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
    ok, detail = all_gather_objects(outcome, "checkpoint publish")[0]
    if not ok:
        raise CheckpointError(detail if failed or rank == 0 else f"rank 0 could not publish {directory / tag}: {detail}")
    return Path(detail)


def _write_latest(directory: Path, tag: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".latest.tmp-", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST_FILE)
    _fsync_dir(directory)


def latest_tag(directory: str | os.PathLike) -> Optional[str]:
    """The tag `directory/latest` points to, or None when there is no checkpoint."""
    path = Path(directory) / LATEST_FILE
    if not path.exists():
        return None
    tag = path.read_text().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; it should name the latest checkpoint tag")
    return tag


def _checkpoint_dir(directory: Path, tag: str) -> Path:
    path = directory / tag
    if path.is_dir():
        return path
    # An interrupted overwrite of this tag leaves the old copy in .{tag}.old-*/{tag}.
    for candidate in sorted(directory.glob(f".{tag}.old-*/{tag}")):
        if (candidate / META_FILE).exists():
            return candidate
    raise CheckpointError(f"checkpoint {path} does not exist")


def read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete fspeed checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is truncated or corrupted ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _verify_files(path: Path, meta: dict) -> None:
    for name, info in meta["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{file} is truncated or corrupted: {size} bytes, expected {info['bytes']}")
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file} is corrupted: its sha256 does not match the one recorded at save time")


def _tensor_reader(file: Path) -> Any:
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{file} cannot be read as safetensors ({e})") from None
    return handle


def load_checkpoint(
    directory: str | os.PathLike,
    template: TrainState,
    *,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    mesh=None,
) -> tuple[TrainState, dict]:
    """Load `directory/tag` (default: `latest`) into the buffers of `template`.

    `template` is a state built the same way as the saved one (e.g. by `init_train_state`); it is
    donated. Precision may differ: fp32 masters are restored from the saved masters, or from the
    saved params when the checkpoint had none; the loss scaler is restored only when the precision is
    the same. With `load_optimizer_states=False` only the weights
    are loaded and the optimizer state and counters stay as in `template`.
    A sharded template needs `mesh=` (a collective) and a checkpoint saved with the same plan and
    mesh sizes: each rank reads back its own file.
    Returns (state, client_state).
    """
    directory = Path(directory)
    if tag is None:
        tag = latest_tag(directory)
        if tag is None:
            raise CheckpointError(f"no checkpoint in {directory} (no '{LATEST_FILE}' file)")
    if _is_sharded(template, mesh, "load_checkpoint"):
        return _load_sharded(directory, template, tag, load_optimizer_states, mesh)
    path = _checkpoint_dir(directory, tag)
    meta = read_meta(path)
    if "layout" in meta:
        raise CheckpointError(f"{path} was saved by {len(meta['files'])} ranks (zero stage "
                              f"{meta['layout']['stage']}, mesh {meta['layout']['mesh']}); load it with the same "
                              "plan and mesh (mesh=...); converting it to one process is not supported yet")
    _verify_files(path, meta)
    reader = _tensor_reader(path / TENSORS_FILE)
    return _fill(template, meta, reader, path / TENSORS_FILE, load_optimizer_states), \
        _join_client_state(meta.get("client_state", {}), reader.get_tensor)


def _load_sharded(directory: Path, template: TrainState, tag: str, load_optimizer_states: bool, mesh):
    rank = mesh.rank
    all_gather_objects = mesh.all_gather_objects
    result, client, error = None, None, None
    try:
        path = _checkpoint_dir(directory, tag)
        meta = read_meta(path)
        saved = meta.get("layout")
        wanted = layout_signature(template.layout)
        if saved != wanted:
            if saved is None:
                raise CheckpointError(f"{path} was saved by one process; loading it into a sharded state "
                                      f"(zero stage {wanted['stage']}, mesh {wanted['mesh']}) is not supported yet")
            diff = [k for k in wanted if saved.get(k) != wanted[k]]
            raise CheckpointError(
                f"{path} was saved with another layout ({', '.join(diff)} differ: saved zero stage "
                f"{saved['stage']} on mesh {saved['mesh']}, this state has zero stage {wanted['stage']} on mesh "
                f"{wanted['mesh']}); resume with the plan and mesh it was saved with")
        name = _rank_file(rank)
        _verify_files(path, {"files": {name: meta["files"][name]}})
        result = _fill(template, meta, _tensor_reader(path / name), path / name, load_optimizer_states)
        client_file = path / meta["client_file"]
        client = _join_client_state(meta.get("client_state", {}), _tensor_reader(client_file).get_tensor)
    except (CheckpointError, OSError, KeyError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    errors = [f"rank {r}: {err}" for r, err in enumerate(all_gather_objects(error, "checkpoint load")) if err]
    if errors:
        raise CheckpointError(f"loading {directory / tag} failed on {len(errors)} rank(s): " + "; ".join(errors))
    return result, client


def _fill(template: TrainState, meta: dict, reader, file: Path, load_optimizer_states: bool) -> TrainState:
    """Copy the saved tensors into `template`'s buffers (and, with optimizer states, its scalars)."""
    path = file.parent
    saved_keys = set(reader.keys())
    tensors, scalars = state_entries(template)
    weights_only = not load_optimizer_states
    wanted = {k: v for k, v in tensors.items()
              if not weights_only or k.startswith(("params/", "master/"))}
    sources = {key: _source_key(key, saved_keys, template.master is not None) for key in wanted}
    missing = sorted(k for k, source in sources.items() if source is None)
    if missing:
        raise CheckpointError(
            f"{path} does not match the state it is loaded into: {len(missing)} tensors missing "
            f"(e.g. {missing[:4]}); was it saved with another model or optimizer? "
            "Use load_optimizer_states=False to load only the weights."
        )
    for key, target in wanted.items():
        source_key = sources[key]
        try:
            value = reader.get_tensor(source_key)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {source_key!r} ({e})") from None
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{path}: tensor {source_key!r} has shape {list(value.shape)}, the state expects {list(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)

    state = template
    if not weights_only:
        saved_scalars = dict(meta["scalars"])
        if meta.get("precision") != template.precision.name:
            # a scaler from another precision (fp32's fixed 1.0) must not replace this one's
            saved_scalars = {k: v for k, v in saved_scalars.items() if not k.startswith("loss_scale.")}
        missing_scalars = sorted(k for k in set(scalars) - set(saved_scalars) if not k.startswith("loss_scale."))
        if missing_scalars:
            raise CheckpointError(f"{path / META_FILE} lacks state fields {missing_scalars[:4]}")
        state = _replace_scalars(template, saved_scalars)
        template.donate()
    return state


def _source_key(key: str, saved_keys: set[str], template_has_master: bool) -> Optional[str]:
    """Which saved tensor fills `key`: fp32 masters are preferred for weights, across precisions."""
    head, _, rest = key.partition("/")
    if head == "params" and not template_has_master and f"master/{rest}" in saved_keys:
        return f"master/{rest}"
    if key in saved_keys:
        return key
    if head == "master" and f"params/{rest}" in saved_keys:
        return f"params/{rest}"
    return None


def _replace_scalars(template: TrainState, saved: dict[str, Any]) -> TrainState:
    """A copy of `template` whose non-tensor leaves take the saved values (matched by path)."""
    paths, leaves, treedef = tree_flatten_with_paths(template, is_leaf=lambda x: isinstance(x, Flat))
    new_leaves = [saved[p] if p in saved and not isinstance(leaf, (Flat, torch.Tensor)) else leaf
                  for p, leaf in zip(paths, leaves)]
    return tree_unflatten(treedef, new_leaves)
